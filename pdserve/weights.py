"""Load DeepSeek-V2/V3 weights: Hugging Face safetensors (single file or sharded), FP8 block-quantized checkpoints
kept in FP8 with their scales, or `dummy` random weights of the configured shapes (benchmarks at real sizes).

Checkpoint names are mapped onto pdserve's modules (hf_to_internal); per-expert tensors are stacked into the
layer's w13/w2. Every parameter must be filled exactly once: missing tensors, unexpected tensors and shape
mismatches are errors that name the tensor, raised before the model is used.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from safetensors import safe_open

from pdserve.config import ModelConfig
from pdserve.kernels import KernelBackends
from pdserve.kernels.gemm import FP8_DTYPE, block_quant
from pdserve.model import DeepseekV3, Linear, MoE, RotaryEmbedding

log = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightsError(ValueError):
    """A checkpoint that does not match its config; the message names the tensors."""


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a parameter, optionally a slice [row0, row1) of dim 1 of an expert."""

    param: str
    expert: Optional[int] = None
    rows: Optional[tuple[int, int]] = None


# Tensors some checkpoints carry that pdserve derives or shares instead of loading.
_IGNORED = re.compile(r"(rotary_emb\.inv_freq$)|(^mtp\.\d+\.(embed_tokens|shared_head\.head)\.weight$)")


def resolve_dtype(name: str, cfg: ModelConfig) -> torch.dtype:
    if name == "auto":
        name = cfg.checkpoint_dtype if cfg.checkpoint_dtype in DTYPES else "bfloat16"
    if name not in DTYPES:
        raise ValueError(f"--dtype {name!r} is not supported; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def hf_to_internal(name: str, cfg: ModelConfig) -> Optional[Target]:
    """Map a checkpoint tensor name to its destination; None for tensors that belong to no module we run."""
    if name == "lm_head.weight":
        return Target("lm_head.weight")
    if not name.startswith("model."):
        return Target(name)  # reported as unexpected by the caller
    name = name[len("model."):]
    m = re.match(r"layers\.(\d+)\.(.*)", name)
    if not m:
        return Target(name)
    idx, rest = int(m.group(1)), m.group(2)
    if idx >= cfg.num_hidden_layers:
        j = idx - cfg.num_hidden_layers
        if j >= cfg.num_nextn_predict_layers:
            return None  # MTP weights the config does not enable (as transformers does)
        if rest.split(".")[0] in ("enorm", "hnorm", "eh_proj", "embed_tokens"):
            return Target(f"mtp.{j}.{rest}")
        if rest.startswith("shared_head."):
            return Target(f"mtp.{j}.{rest.replace('shared_head.norm', 'shared_head_norm')}")
        prefix = f"mtp.{j}.block."
    else:
        prefix = f"layers.{idx}."
    e = re.match(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$", rest)
    if e:
        expert, proj, kind = int(e.group(1)), e.group(2), e.group(3)
        inter = cfg.moe_intermediate_size
        if kind == "weight_scale_inv":
            assert cfg.fp8 is not None
            inter //= cfg.fp8.block_n
        suffix = "" if kind == "weight" else "_scale_inv"
        if proj == "down_proj":
            return Target(f"{prefix}mlp.w2{suffix}", expert=expert)
        rows = (0, inter) if proj == "gate_proj" else (inter, 2 * inter)
        return Target(f"{prefix}mlp.w13{suffix}", expert=expert, rows=rows)
    if rest == "mlp.experts.gate_up_proj":  # transformers' fused layout (E, 2I, D)
        return Target(f"{prefix}mlp.w13")
    if rest == "mlp.experts.down_proj":
        return Target(f"{prefix}mlp.w2")
    return Target(prefix + rest)


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [p for p in files if not os.path.isfile(os.path.join(model_dir, p))]
        if missing:
            raise WeightsError(f"{index} names shard files that are missing: {', '.join(missing)}")
        return [os.path.join(model_dir, p) for p in files]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    found = sorted(p for p in os.listdir(model_dir) if p.endswith(".safetensors"))
    if found:
        return [os.path.join(model_dir, p) for p in found]
    raise WeightsError(f"no safetensors weights in {model_dir} (expected model.safetensors or "
                       "model.safetensors.index.json); use --load-format dummy for random weights")


def _iter_tensors(files: list[str], progress: Callable[[str], None]) -> Iterator[tuple[str, torch.Tensor]]:
    start = time.monotonic()
    for i, path in enumerate(files):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
        progress(f"loaded shard {i + 1}/{len(files)} ({os.path.basename(path)}) in {time.monotonic() - start:.1f}s")


def build_model(cfg: ModelConfig, dtype: torch.dtype, kernels: KernelBackends, device: str = "cpu",
                prefix_chunk_tokens: int = 4096, fp8_linears: Optional[set[str]] = None) -> DeepseekV3:
    """Allocate an uninitialised model: each parameter gets the dtype it will hold (fp8, fp32 scales, ...).

    fp8_linears names the Linear modules stored in FP8 (by default every quantizable one when cfg.fp8 is set).
    """
    with torch.device("meta"):
        model = DeepseekV3(cfg, kernels, prefix_chunk_tokens)
    for mod_name, module in model.named_modules():
        if isinstance(module, Linear) and module.block is not None and fp8_linears is not None \
                and mod_name not in fp8_linears:
            module.block, module.weight_scale_inv = None, None  # this checkpoint stores it unquantized
        for pname, p in list(module.named_parameters(recurse=False)):
            if pname.endswith("scale_inv"):
                dt = torch.float32
            elif (isinstance(module, Linear) and module.block and pname == "weight") or (
                    isinstance(module, MoE) and module.block and pname in ("w13", "w2")):
                dt = FP8_DTYPE
            else:
                dt = dtype
            setattr(module, pname, torch.nn.Parameter(torch.empty(p.shape, dtype=dt, device=device),
                                                      requires_grad=False))
        for bname, b in list(module.named_buffers(recurse=False)):
            dt = torch.float32 if bname == "e_score_correction_bias" else dtype
            module.register_buffer(bname, torch.zeros(b.shape, dtype=dt, device=device), persistent=False)
    model.rotary = RotaryEmbedding(cfg).to(device)  # computed, not loaded: rebuild it off the meta device
    return model.eval()


def load_model(model_dir: Optional[str], cfg: ModelConfig, dtype: torch.dtype, kernels: KernelBackends,
               load_format: str = "auto", device: str = "cpu", prefix_chunk_tokens: int = 4096,
               progress: Optional[Callable[[str], None]] = None, seed: int = 0) -> DeepseekV3:
    progress = progress or (lambda msg: print(f"[pdserve] {msg}", file=sys.stderr, flush=True))
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format {load_format!r} is not supported; choose one of {', '.join(LOAD_FORMATS)}")
    if load_format == "dummy":
        model = build_model(cfg, dtype, kernels, device, prefix_chunk_tokens)
        init_dummy_weights(model, seed)
        model.post_load()
        return model
    assert model_dir is not None
    files = checkpoint_files(model_dir)
    keys = _checkpoint_keys(files)
    fp8_linears = {_internal_module(k[: -len(".weight_scale_inv")], cfg) for k in keys
                   if k.endswith(".weight_scale_inv")}
    model = build_model(cfg, dtype, kernels, device, prefix_chunk_tokens, fp8_linears if cfg.fp8 else None)
    _load_tensors(model, cfg, _iter_tensors(files, progress), keys)
    model.post_load()
    return model


def _checkpoint_keys(files: list[str]) -> set[str]:
    keys: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt") as f:
            keys.update(f.keys())
    return keys


def _internal_module(hf_module: str, cfg: ModelConfig) -> str:
    target = hf_to_internal(hf_module + ".weight", cfg)
    return target.param[: -len(".weight")] if target else ""


def _load_tensors(model: DeepseekV3, cfg: ModelConfig, tensors: Iterator[tuple[str, torch.Tensor]],
                  keys: set[str]) -> None:
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    filled: dict[str, int] = {}  # param -> number of pieces loaded (experts fill one param in many pieces)
    expected_pieces = _expected_pieces(model, cfg, keys)
    unexpected: list[str] = []
    for name, tensor in tensors:
        target = hf_to_internal(name, cfg)
        if target is None or _IGNORED.search(target.param):
            continue
        param = params.get(target.param)
        if param is None:
            unexpected.append(name)
            continue
        dest = param.data
        if target.expert is not None:
            dest = dest[target.expert]
        if target.rows is not None:
            dest = dest[target.rows[0]: target.rows[1]]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise WeightsError(f"tensor {name} has shape {tuple(tensor.shape)} but the config implies "
                               f"{tuple(dest.shape)}; check config.json against the checkpoint")
        if tensor.dtype == FP8_DTYPE and dest.dtype != FP8_DTYPE:
            raise WeightsError(f"tensor {name} is FP8 but config.json has no fp8 quantization_config")
        dest.copy_(tensor.to(dest.dtype) if dest.dtype != FP8_DTYPE else tensor)
        filled[target.param] = filled.get(target.param, 0) + 1
    if unexpected:
        raise WeightsError(f"{len(unexpected)} checkpoint tensors match no module of this config: "
                           f"{', '.join(sorted(unexpected)[:10])}")
    if "lm_head.weight" not in filled and cfg.tie_word_embeddings and "embed_tokens.weight" in filled:
        model.lm_head.weight.data.copy_(model.embed_tokens.weight.data)
        filled["lm_head.weight"] = 1
    missing = [p for p, n in expected_pieces.items() if filled.get(p, 0) < n]
    mtp_missing = [p for p in missing if p.startswith("mtp.")]
    main_missing = [p for p in missing if not p.startswith("mtp.")]
    if main_missing:
        raise WeightsError(f"checkpoint lacks {len(main_missing)} tensors: {', '.join(main_missing[:10])}")
    if mtp_missing:
        mtp_params = [p for p in expected_pieces if p.startswith("mtp.")]
        if len(mtp_missing) < len(mtp_params):
            raise WeightsError(f"the NextN/MTP layer is only partly present; missing: {', '.join(mtp_missing[:10])}")
        # transformers' save_pretrained drops MTP layers even when num_nextn_predict_layers is set.
        log.warning("checkpoint has no NextN/MTP weights (num_nextn_predict_layers=%d): speculative decoding "
                    "is unavailable", cfg.num_nextn_predict_layers)
        model.has_mtp_weights = False


def _expected_pieces(model: DeepseekV3, cfg: ModelConfig, keys: set[str]) -> dict[str, int]:
    """How many checkpoint tensors each parameter needs (stacked experts: one or three per expert)."""
    fused = any(k.endswith("mlp.experts.gate_up_proj") for k in keys)
    pieces: dict[str, int] = {}
    for name, _ in model.named_parameters():
        if name.startswith("rotary."):
            continue
        if re.search(r"mlp\.w13(_scale_inv)?$", name):
            pieces[name] = 1 if fused and "scale" not in name else 2 * cfg.n_routed_experts
        elif re.search(r"mlp\.w2(_scale_inv)?$", name):
            pieces[name] = 1 if fused and "scale" not in name else cfg.n_routed_experts
        else:
            pieces[name] = 1
    for name, _ in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            pieces[name] = 1
    return pieces


@torch.no_grad()
def init_dummy_weights(model: DeepseekV3, seed: int = 0, std: float = 0.02) -> None:
    """Random weights of the right shapes and dtypes (FP8 weights quantized from random values)."""
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            if pname.endswith("scale_inv"):
                continue
            if p.dim() == 1:  # norms
                p.data.fill_(1.0)
                continue
            values = torch.randn(p.shape, generator=gen) * std
            scale_name = "weight_scale_inv" if pname == "weight" else f"{pname}_scale_inv"
            if p.dtype == FP8_DTYPE:
                block = module.block
                q, s = block_quant(values, block)
                p.data.copy_(q.to(p.device))
                getattr(module, scale_name).data.copy_(s.to(p.device))
            else:
                p.data.copy_(values.to(p.dtype))
        for bname, b in module.named_buffers(recurse=False):
            if bname == "e_score_correction_bias":
                b.data.zero_()
