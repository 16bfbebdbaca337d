"""Linear layers of a tensor-parallel model (nano-vllm `layers/linear.py`, vLLM `model_executor/layers/linear.py`).

y = x W^T with W (N, K), optionally block-FP8 (`weight_scale_inv`, one scale per (bn, bk) block):
- `Linear`: replicated; every rank holds all of W.
- `ColumnParallelLinear`: the output features split; rank r holds rows [r N/tp, (r+1) N/tp) of W and computes its
  slice of y, which the next layer consumes split the same way (its heads, its part of an MLP's intermediate).
- `RowParallelLinear`: the input features split; rank r holds columns [r K/tp, (r+1) K/tp) and computes a partial
  y; the all-reduce sums the partials (`reduce=False` leaves that to the caller, which adds several first).

Each layer owns its shard: `shard(name, dest)` says which part of a checkpoint tensor it holds and
`weight_loader(name, dest, loaded)` copies that part, reading no more of a lazily opened checkpoint tensor than it.
FP8 scales split with their blocks (ParallelConfig.check_model makes every shard whole blocks). At tp size 1 the
layers are plain Linears: no shard, no collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from pdserve.config import ModelConfig
from pdserve.kernels import KernelBackends
from pdserve.parallel.group import SINGLE, TPGroup

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor one rank holds: the tensor split into `size` equal parts along `dim`, part
    `index`. `stacked` > 1: the tensor stacks that many equal blocks along `dim` ([gate; up]) and each block is
    split so (the rank holds part `index` of each, stacked the same way)."""

    dim: int
    index: int
    size: int
    stacked: int = 1

    def full_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] *= self.size
        return tuple(shape)

    def pieces(self, local_shape: tuple[int, ...]) -> list[tuple[tuple[slice, ...], tuple[slice, ...]]]:
        """(index into the checkpoint tensor, index into this rank's tensor) of each contiguous piece it holds."""
        dim = self.dim % len(local_shape)
        part = local_shape[dim] // self.stacked  # this rank's rows of one stacked block
        out = []
        for b in range(self.stacked):
            src = [slice(None)] * len(local_shape)
            dst = list(src)
            first = b * part * self.size + self.index * part
            src[dim], dst[dim] = slice(first, first + part), slice(b * part, (b + 1) * part)
            out.append((tuple(src), tuple(dst)))
        return out


class ShardError(ValueError):
    """A checkpoint tensor that does not fit its parameter; the message follows the tensor's name."""


def load_shard(dest: torch.Tensor, loaded: Any, shard: Optional[Shard]) -> None:
    """Copy this rank's part of `loaded` into `dest`. `loaded`: a tensor, or a checkpoint tensor not read yet (any
    object with `.shape` and `[index]`; `[...]` reads all of it): only the indexed part is read."""
    full = tuple(dest.shape) if shard is None else shard.full_shape(tuple(dest.shape))
    if tuple(loaded.shape) != full:
        raise ShardError(f"has shape {tuple(loaded.shape)} but the config implies {full}; check config.json "
                         "against the checkpoint")
    pieces = [(..., ...)] if shard is None else shard.pieces(tuple(dest.shape))
    for src, dst in pieces:
        tensor = loaded[src]
        if tensor.dtype == FP8 and dest.dtype != FP8:
            raise ShardError("is FP8 but config.json has no fp8 quantization_config")
        dest[dst].copy_(tensor if dest.dtype == FP8 else tensor.to(dest.dtype))


class Linear(nn.Module):
    """y = x W^T, replicated on every rank; W may be block-FP8 (weight_scale_inv per block), dequantized by the
    reference kernel."""

    def __init__(self, in_features: int, out_features: int, cfg: ModelConfig, kernels: KernelBackends):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.kernels = kernels
        # The loader turns quantization off for linears a checkpoint stores unquantized.
        self.block = (cfg.fp8.block_n, cfg.fp8.block_k) if cfg.fp8 else None
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        if self.block:
            bn, bk = self.block
            scale = torch.ones(-(-out_features // bn), -(-in_features // bk))
            self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        else:
            self.weight_scale_inv = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.gemm.linear(x, self.weight, self.weight_scale_inv, self.block)

    def shard(self, name: str, dest: torch.Tensor) -> Optional[Shard]:
        """The part of checkpoint tensor `name` (weight or weight_scale_inv) this rank holds; None: all of it."""
        return None

    def weight_loader(self, name: str, dest: torch.Tensor, loaded: Any) -> None:
        load_shard(dest, loaded, self.shard(name, dest))

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        from pdserve.kernels.gemm import block_dequant

        if self.weight.dtype == FP8:
            return block_dequant(self.weight, self.weight_scale_inv, self.block, dtype)
        return self.weight.to(dtype)


class ColumnParallelLinear(Linear):
    """W's rows (output features) split over the ranks; y is this rank's slice of the output."""

    def __init__(self, in_features: int, out_features: int, cfg: ModelConfig, kernels: KernelBackends,
                 tp: TPGroup = SINGLE):
        assert out_features % tp.size == 0, f"{out_features} output features over {tp.size} ranks"
        super().__init__(in_features, out_features // tp.size, cfg, kernels)
        self.tp = tp

    def shard(self, name, dest):
        return Shard(0, self.tp.rank, self.tp.size) if self.tp.size > 1 else None


class RowParallelLinear(Linear):
    """W's columns (input features) split over the ranks: x is this rank's slice of the input, y a partial sum,
    all-reduced here unless reduce=False."""

    def __init__(self, in_features: int, out_features: int, cfg: ModelConfig, kernels: KernelBackends,
                 tp: TPGroup = SINGLE, reduce: bool = True):
        assert in_features % tp.size == 0, f"{in_features} input features over {tp.size} ranks"
        super().__init__(in_features // tp.size, out_features, cfg, kernels)
        self.tp = tp
        self.reduce = reduce and tp.size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernels.gemm.linear(x, self.weight, self.weight_scale_inv, self.block)  # (T, N) partial
        return self.tp.all_reduce(y) if self.reduce else y

    def shard(self, name, dest):
        return Shard(1, self.tp.rank, self.tp.size) if self.tp.size > 1 else None


__all__ = ["Linear", "ColumnParallelLinear", "RowParallelLinear", "Shard", "ShardError", "load_shard"]
