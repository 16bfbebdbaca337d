"""Load DeepSeek-V2/V3 weights: Hugging Face safetensors (single file or sharded), FP8 block-quantized checkpoints
kept in FP8 with their scales, or `dummy` random weights of the configured shapes (benchmarks at real sizes).

Checkpoint names are mapped onto pdserve's modules (hf_to_internal); per-expert tensors are stacked into the
layer's w13/w2. Every parameter must be filled exactly once: missing tensors, unexpected tensors and shape
mismatches are errors that name the tensor, raised before the model is used.

Under tensor parallelism each rank loads its own shards: a module that splits a parameter says which part of the
checkpoint tensor it holds (its `weight_loader`), and the tensor is opened lazily (safetensors' get_slice), so a
rank reads its slices and nothing of the other ranks' parts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from safetensors import safe_open

from pdserve.config import ModelConfig
from pdserve.kernels import KernelBackends
from pdserve.common.progress import say
from pdserve.kernels.gemm import FP8_DTYPE, block_quant
from pdserve.model import DeepseekV3, Gate, Linear, MoE, RotaryEmbedding
from pdserve.parallel.group import SINGLE, TPGroup
from pdserve.parallel.linear import ShardError, load_shard

log = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightsError(ValueError):
    """A checkpoint that does not match its config; the message names the tensors."""


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a parameter, optionally one expert's slice [row0, row1) of it (the expert's
    index in this rank's stack). elsewhere: another rank's expert under expert parallelism, not read here."""

    param: str
    expert: Optional[int] = None
    rows: Optional[tuple[int, int]] = None
    elsewhere: bool = False


# Tensors some checkpoints carry that pdserve derives or shares instead of loading.
_IGNORED = re.compile(r"(rotary_emb\.inv_freq$)|(^model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$)")


def resolve_dtype(name: str, cfg: ModelConfig) -> torch.dtype:
    if name == "auto":
        name = cfg.checkpoint_dtype if cfg.checkpoint_dtype in DTYPES else "bfloat16"
    if name not in DTYPES:
        raise ValueError(f"--dtype {name!r} is not supported; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def checkpoint_names(model: DeepseekV3, fused_experts: bool = False) -> dict[str, Target]:
    """Every tensor name a checkpoint for this model must hold (Hugging Face layout) -> where it goes.

    The one table both loading and exporting use. Experts are per expert (`mlp.experts.{e}.gate_proj.weight`), or
    transformers' fused `mlp.experts.gate_up_proj` / `down_proj` with fused_experts; the NextN layer j is
    `model.layers.{num_hidden_layers + j}.*`.
    """
    cfg = model.cfg
    names: dict[str, Target] = {}
    params = [n for n, _ in model.named_parameters() if not n.startswith("rotary.")]
    params += [n for n, _ in model.named_buffers() if n.endswith("e_score_correction_bias")]
    for param in params:
        m = re.match(r"mtp\.(\d+)\.(block\.)?(.*)", param)
        if m:
            prefix = f"model.layers.{cfg.num_hidden_layers + int(m.group(1))}."
            rest = m.group(3).replace("shared_head_norm", "shared_head.norm")
        elif param == "lm_head.weight":
            prefix, rest = "", param
        else:
            m = re.match(r"layers\.(\d+)\.(.*)", param)
            prefix, rest = (f"model.layers.{m.group(1)}.", m.group(2)) if m else ("model.", param)
        e = re.match(r"mlp\.(w13|w2)(_scale_inv)?$", rest)
        if not e:
            names[prefix + rest] = Target(param)
            continue
        is_scale = bool(e.group(2))
        if fused_experts and not is_scale:
            names[prefix + ("mlp.experts.gate_up_proj" if e.group(1) == "w13" else "mlp.experts.down_proj")] = \
                Target(param)
            continue
        kind = "weight_scale_inv" if is_scale else "weight"
        rows = model.get_parameter(param).shape[-2] // 2  # this rank's rows of gate (and of up) in w13[e]
        first, here = model.get_submodule(param.rpartition(".")[0]).first_expert, model.get_parameter(param).shape[0]
        for x in range(cfg.n_routed_experts):
            at = dict(expert=x - first) if first <= x < first + here else dict(expert=x, elsewhere=True)
            if e.group(1) == "w2":
                names[f"{prefix}mlp.experts.{x}.down_proj.{kind}"] = Target(param, **at)
            else:
                names[f"{prefix}mlp.experts.{x}.gate_proj.{kind}"] = Target(param, rows=(0, rows), **at)
                names[f"{prefix}mlp.experts.{x}.up_proj.{kind}"] = Target(param, rows=(rows, 2 * rows), **at)
    return names


def single_process_shapes(model: DeepseekV3) -> Iterator[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every parameter as a single process holds it: a tensor-parallel rank's shard counted
    whole, so that ranks and workers of any split describe the same model alike."""
    for module_name, module in model.named_modules():
        shard = getattr(module, "shard", None)
        for name, p in module.named_parameters(recurse=False):
            part = shard(name, p.data) if shard is not None else None
            shape = tuple(p.shape) if part is None else part.full_shape(tuple(p.shape))
            yield f"{module_name}.{name}" if module_name else name, shape, p.dtype


def tensor_view(model: DeepseekV3, target: Target) -> torch.Tensor:
    """The part of the model's parameter a checkpoint tensor fills (a view: writes go into the model)."""
    t = model.get_parameter(target.param) if not target.param.endswith("bias") else model.get_buffer(target.param)
    t = t.data
    if target.expert is not None:
        t = t[target.expert]
    if target.rows is not None:
        t = t[target.rows[0]: target.rows[1]]
    return t


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


@contextlib.contextmanager
def _checkpoint_file(path: str):
    """safe_open, with a file safetensors cannot read (a truncated or corrupt download, not a safetensors file) as
    a WeightsError naming it: the user's to fix, not an internal error."""
    from safetensors import SafetensorError

    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise WeightsError(f"{path} cannot be read as safetensors ({e}): a truncated or corrupt download? "
                           "Fetch the file again") from None


class LazyTensor:
    """A checkpoint tensor not read yet: `.shape`, and `[index]` reads that part only (`[...]`: all of it)."""

    def __init__(self, f, key: str):
        self._f, self._key = f, key

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._f.get_slice(self._key).get_shape())

    def __getitem__(self, index) -> torch.Tensor:
        if index is Ellipsis:
            return self._f.get_tensor(self._key)
        return self._f.get_slice(self._key)[index]


def _iter_tensors(files: list[str], progress: Callable[[str], None]) -> Iterator[tuple[str, LazyTensor]]:
    start = time.monotonic()
    for i, path in enumerate(files):
        with _checkpoint_file(path) as f:
            for key in f.keys():
                yield key, LazyTensor(f, key)
        progress(f"loaded shard {i + 1}/{len(files)} ({os.path.basename(path)}) in {time.monotonic() - start:.1f}s")


class _NoRandomInit(torch.overrides.TorchFunctionMode):
    """Skips torch.nn.init's fills (nn.Embedding, nn.Linear) while build_model lays the model out on the meta
    device: every parameter is replaced and loaded afterwards.

    NOTE: a random fill of a meta tensor runs torch's Python reference, whose first call imports torch._dynamo:
    seconds of every worker's start-up, for values nobody reads."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


def build_model(cfg: ModelConfig, dtype: torch.dtype, kernels: KernelBackends, device: str = "cpu",
                prefix_chunk_tokens: int = 4096, fp8_linears: Optional[set[str]] = None,
                tp: TPGroup = SINGLE, ep: bool = False, dp_attention: bool = False) -> DeepseekV3:
    """Allocate an uninitialised model (tp: this rank's shards, ep: of the experts rather than of each expert,
    dp_attention: attention whole on every rank): each
    parameter gets the dtype it will hold (fp8, fp32 scales, ...).

    fp8_linears names (by checkpoint name, e.g. model.layers.0.self_attn.q_a_proj) the Linear modules stored in
    FP8; by default every quantizable one is, when cfg.fp8 is set.
    """
    with torch.device("meta"), _NoRandomInit():
        model = DeepseekV3(cfg, kernels, prefix_chunk_tokens, tp, ep, dp_attention)
    hf_name = {t.param: name for name, t in checkpoint_names(model).items() if t.expert is None}
    for mod_name, module in model.named_modules():
        if isinstance(module, Linear) and module.block is not None and fp8_linears is not None \
                and hf_name[mod_name + ".weight"][: -len(".weight")] not in fp8_linears:
            module.block, module.weight_scale_inv = None, None  # this checkpoint stores it unquantized
        for pname, p in list(module.named_parameters(recurse=False)):
            if pname.endswith("scale_inv"):
                dt = torch.float32
            elif isinstance(module, Gate):
                # The router scores in fp32 (as transformers): stored so, its weight is not cast on every call
                # (a (E, D) cast per MoE layer and step: 11 MB of traffic per V3 layer; an exact upcast of bf16).
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
               progress: Optional[Callable[[str], None]] = None, seed: int = 0, tp: TPGroup = SINGLE,
               ep: bool = False, dp_attention: bool = False) -> DeepseekV3:
    """The model with its weights; under tensor parallelism (tp; ep: expert parallelism; dp_attention: attention
    replicated) this rank's shards of them
    (dummy weights: the shards of the same random weights a single process draws)."""
    progress = progress or say
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format {load_format!r} is not supported; choose one of {', '.join(LOAD_FORMATS)}")
    if load_format == "dummy":
        model = build_model(cfg, dtype, kernels, device, prefix_chunk_tokens, tp=tp, ep=ep, dp_attention=dp_attention)
        init_dummy_weights(model, seed)
        model.post_load()
        return model
    assert model_dir is not None
    files = checkpoint_files(model_dir)
    keys = _checkpoint_keys(files)
    fp8_linears = None
    if cfg.fp8:  # linears the checkpoint stores with block scales stay FP8; the others load unquantized
        fp8_linears = {k[: -len(".weight_scale_inv")] for k in keys if k.endswith(".weight_scale_inv")}
    model = build_model(cfg, dtype, kernels, device, prefix_chunk_tokens, fp8_linears, tp, ep, dp_attention)
    _load_tensors(model, cfg, _iter_tensors(files, progress), keys)
    model.post_load()
    return model


def _checkpoint_keys(files: list[str]) -> set[str]:
    keys: set[str] = set()
    for path in files:
        with _checkpoint_file(path) as f:
            keys.update(f.keys())
    return keys


def _weight_loader(model: DeepseekV3, param: str) -> tuple[str, Callable]:
    """(the parameter's own name, the loader of the module owning it): its weight_loader when it splits its
    parameters over tensor-parallel ranks, else a copy of the whole tensor."""
    module_name, _, name = param.rpartition(".")
    module = model.get_submodule(module_name)
    loader = getattr(module, "weight_loader", None)
    return name, loader or (lambda _name, dest, loaded: load_shard(dest, loaded, None))


def _load_tensors(model: DeepseekV3, cfg: ModelConfig, tensors: Iterator[tuple[str, LazyTensor | torch.Tensor]],
                  keys: set[str]) -> None:
    expected = checkpoint_names(model, fused_experts=any(k.endswith("mlp.experts.gate_up_proj") for k in keys))
    seen: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in tensors:
        if _IGNORED.search(name):
            continue
        target = expected.get(name)
        if target is None:
            layer = re.match(r"model\.layers\.(\d+)\.", name)
            if layer and int(layer.group(1)) >= cfg.num_kv_layers:
                continue  # NextN weights the config does not enable (transformers ignores them too)
            unexpected.append(name)
            continue
        if name in seen:
            raise WeightsError(f"tensor {name} appears twice in the checkpoint")
        if target.elsewhere:  # another rank's expert: present, not read
            seen.add(name)
            continue
        param_name, loader = _weight_loader(model, target.param)
        try:
            loader(param_name, tensor_view(model, target), tensor)  # reads this rank's part of the tensor only
        except ShardError as e:
            raise WeightsError(f"tensor {name} {e}") from None
        seen.add(name)
    if unexpected:
        raise WeightsError(f"{len(unexpected)} checkpoint tensors match no module of this config: "
                           f"{', '.join(sorted(unexpected)[:10])}")
    if "lm_head.weight" not in seen and cfg.tie_word_embeddings and "model.embed_tokens.weight" in seen:
        model.lm_head.weight.data.copy_(model.embed_tokens.weight.data)
        seen.add("lm_head.weight")
    missing = [n for n in expected if n not in seen]
    mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
    main_missing = [n for n in missing if not n.startswith(mtp_prefix)]
    mtp_missing = [n for n in missing if n.startswith(mtp_prefix)]
    if main_missing:
        raise WeightsError(f"checkpoint lacks {len(main_missing)} tensors: {', '.join(main_missing[:10])}")
    if mtp_missing:
        if len(mtp_missing) < sum(1 for n in expected if n.startswith(mtp_prefix)):
            raise WeightsError(f"the NextN/MTP layer is only partly present; missing: {', '.join(mtp_missing[:10])}")
        # transformers' save_pretrained drops MTP layers even when num_nextn_predict_layers is set.
        log.warning("checkpoint has no NextN/MTP weights (num_nextn_predict_layers=%d): speculative decoding "
                    "is unavailable", cfg.num_nextn_predict_layers)
        model.has_mtp_weights = False


@torch.no_grad()
def init_dummy_weights(model: DeepseekV3, seed: int = 0, std: float = 0.02) -> None:
    """Random weights of the right shapes and dtypes (FP8 weights quantized from random values).

    Generated on the parameters' own device, one leading slice (e.g. one expert) at a time, so real DeepSeek-V3
    widths initialise in seconds on a GPU without a full-size fp32 temporary.
    """
    gens: dict[torch.device, torch.Generator] = {}
    for module in model.modules():
        shard = getattr(module, "shard", lambda _name, _dest: None)
        load = getattr(module, "weight_loader", lambda _name, dest, loaded: load_shard(dest, loaded, None))
        for pname, p in module.named_parameters(recurse=False):
            if pname.endswith("scale_inv"):
                continue
            if p.dim() == 1:  # norms
                p.data.fill_(1.0)
                continue
            gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
            scale_name = "weight_scale_inv" if pname == "weight" else f"{pname}_scale_inv"
            # Stacked experts one at a time, every expert's values drawn (another rank's expert too, under expert
            # parallelism: each rank's weights are then those of a single process).
            first = getattr(module, "first_expert", 0)
            slices = [(slice(None),)] if p.dim() == 2 else [(i - first,) for i in range(getattr(
                module, "num_experts", p.shape[0]))]
            for idx in slices:
                if p.dim() == 3 and not 0 <= idx[0] < p.shape[0]:  # another rank's (whole) expert: its draw only
                    torch.randn(p.shape[1:], generator=gen, device=p.device)
                    continue
                dest = p.data[idx]
                # A tensor-parallel rank draws the whole tensor and keeps its shard: every rank's weights are then
                # the shards of a single process's.
                part = shard(pname, dest)
                full = tuple(dest.shape) if part is None else part.full_shape(tuple(dest.shape))
                values = torch.randn(full, generator=gen, device=p.device) * std
                if p.dtype == FP8_DTYPE:
                    q, scale = block_quant(values, module.block)
                    load(pname, dest, q)
                    load(scale_name, getattr(module, scale_name).data[idx], scale)
                else:
                    load(pname, dest, values.to(p.dtype))
        for bname, b in module.named_buffers(recurse=False):
            if bname == "e_score_correction_bias":
                b.data.zero_()
