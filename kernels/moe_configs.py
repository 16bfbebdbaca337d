"""Tile configurations of the fused-MoE Triton kernels, tuned per shape and device (benchmarks/tune_moe.py).

Files live in kernels/configs/moe/, one per (E, N, K, dtype, device), named as vLLM names them:
    E={E},N={N},K={K},device_name={device},dtype={dtype}.json
with N = the expert intermediate size I (w2 is (E, H, I)), K = the hidden size H, dtype "fp8_w8a8" (block-FP8
weights, 128x128) or the weight dtype's name ("bfloat16"), device the CUDA device name with spaces as
underscores (e.g. NVIDIA_H100_80GB_HBM3). Content: {"<tokens>": {"BLOCK_M": .., "gate_up": {...}, "down":
{...}}}, where each GEMM's entry holds BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages (optionally LAYOUT, see
DOWN_LAYOUTS, and for a contiguous GEMM KERNEL "triton" or "gluon" with the Gluon kernel's STAGES and UNROLL in
place of BLOCK_N..num_stages); both GEMMs share BLOCK_M because they walk the same aligned token layout.
BLOCK_N counts weight rows per tile, as in vLLM/SGLang configs: a gate-up tile of BLOCK_N rows holds BLOCK_N / 2
gate rows and their up rows, so it yields BLOCK_N / 2 activation columns (fp8: 128 or 256 keep the activation's
1x128 quantization fused). A call with T tokens takes the entry whose key is nearest T; with no file,
`default_config` decides.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

import torch

CONFIG_DIR = Path(__file__).resolve().parent / "configs" / "moe"
GEMM_KEYS = ("BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
GLUON_KEYS = ("GROUP_M", "num_warps", "STAGES", "UNROLL")
# The down GEMM's optional "LAYOUT": "fused" (default: the fused kernel reads the activation per pair) or
# "contiguous" (DeepGEMM's contiguous layout, triton_grouped_gemm.py; the activation by layout row). The gate-up
# GEMM may be "contiguous" too, when the down GEMM is (then the token rows are gathered into that layout first).
DOWN_LAYOUTS = ("fused", "contiguous")


def device_name(device: Optional[torch.device] = None) -> str:
    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(device).replace(" ", "_")


def dtype_key(weight_dtype: torch.dtype) -> str:
    return "fp8_w8a8" if weight_dtype == torch.float8_e4m3fn else str(weight_dtype).removeprefix("torch.")


def config_file_name(num_experts: int, inter: int, hidden: int, dtype: str, device: str) -> str:
    return f"E={num_experts},N={inter},K={hidden},device_name={device},dtype={dtype}.json"


@functools.lru_cache(maxsize=None)
def load_configs(num_experts: int, inter: int, hidden: int, dtype: str, device: str) -> Optional[dict[int, dict]]:
    """The tuned table for this shape and device, or None if there is no file."""
    path = CONFIG_DIR / config_file_name(num_experts, inter, hidden, dtype, device)
    if not path.is_file():
        return None
    with open(path) as f:
        table = {int(m): cfg for m, cfg in json.load(f).items()}
    for m, cfg in table.items():
        gemms = [cfg.get(g, {}) for g in ("gate_up", "down")]
        missing = [k for gemm in gemms for k in _required_keys(gemm) if k not in gemm]
        if "BLOCK_M" not in cfg or missing:
            raise ValueError(f"{path}: entry {m} lacks BLOCK_M or {missing}; rerun benchmarks/tune_moe.py")
        layouts = [gemm.get("LAYOUT", "fused") for gemm in gemms]
        if any(lay not in DOWN_LAYOUTS for lay in layouts) or layouts == ["contiguous", "fused"]:
            raise ValueError(f"{path}: entry {m}: LAYOUT must be one of {DOWN_LAYOUTS}, and a contiguous gate_up "
                             f"needs a contiguous down")
    return table


def _required_keys(gemm_cfg: dict) -> tuple[str, ...]:
    return GLUON_KEYS if gemm_cfg.get("KERNEL") == "gluon" else GEMM_KEYS


def default_config(tokens: int, num_experts: int, top_k: int, fp8: bool) -> dict:
    """Untuned fallback, sized by the average rows per expert (tokens * top_k / E). The fp8 gate-up tile of 128
    weight rows at 4 warps yields 64 activation columns; a program runs two of them back to back to fuse the 1x128
    quantization (triton_moe_kernels.gemm_geometry)."""
    rows = tokens * top_k / max(num_experts, 1)
    block_k = 128 if fp8 else 64
    if rows <= 8:
        block_m, group_m, stages = 16, 1, 4
    elif rows <= 32:
        block_m, group_m, stages = 32, 4, 4
    else:
        block_m, group_m, stages = 64, 8, 3
    gemm = dict(BLOCK_N=128, BLOCK_K=block_k, GROUP_M=group_m, num_warps=4, num_stages=stages)
    return {"BLOCK_M": block_m, "gate_up": dict(gemm), "down": dict(gemm)}


def get_config(tokens: int, num_experts: int, inter: int, hidden: int, top_k: int, weight_dtype: torch.dtype,
               device: Optional[str] = None) -> dict:
    """{"BLOCK_M", "gate_up": {...}, "down": {...}} for a call with `tokens` tokens."""
    table = load_configs(num_experts, inter, hidden, dtype_key(weight_dtype), device or device_name())
    if table:
        return table[min(table, key=lambda m: (abs(m - tokens), m))]
    return default_config(tokens, num_experts, top_k, weight_dtype == torch.float8_e4m3fn)
