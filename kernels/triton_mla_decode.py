"""Absorbed MLA decode over the paged latent cache, in Triton (split-KV + log-sum-exp merge).

One query row per sequence: q_latent (B, H, R) and q_pe (B, H, P) attend over the sequence's cached tokens, each
[c_kv (R) | k_pe (P)] in one row of kv_layer (num_slots, R + P); c_kv is both key (with k_pe) and value.

Stage 1, grid (cdiv(H, BLOCK_H), B, num_splits): a program owns BLOCK_H heads of one sequence and one contiguous
range of its pages (the split). It walks its tokens BLOCK_N at a time, gathering rows through the page table, and
loads each latent tile once for all BLOCK_H heads: scores = q_lat @ c_kv^T + q_pe @ k_pe^T, (BLOCK_H, BLOCK_N), then
acc += p @ c_kv, (BLOCK_H, R), with an online softmax in fp32. It writes its normalised partial output and
natural-log LSE; a split past the sequence's end writes output 0 and LSE -inf. The head blocks of one (sequence,
split) are adjacent in launch order, so they run together and share each latent tile through L2.
When BLOCK_N divides the page size, a tile lies in one page: one scalar page-table load and BLOCK_N consecutive
rows (far fewer registers than a page id per row).
Stage 2, grid (B, H): merges the splits by LSE into the output, in q's dtype. With one split, stage 1 writes the
output itself and stage 2 is skipped.

CUDA graphs: no host syncs and no data-dependent host control flow. The grid depends only on B, H and num_splits,
which `choose_num_splits` derives from static shapes (page_table.shape[1]); loop bounds inside the kernels come from
seq_lens on the device, so a captured launch replays correctly after seq_lens / page_table change in place.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_support import check_device, interpreter_requested, next_pow2, num_sms, patch_interpreter_for_numpy2

if interpreter_requested():
    patch_interpreter_for_numpy2()

PROGRAMS_PER_SM = 2  # DecodeConfig's default: split sequences until about this many programs per SM
MIN_TOKENS_PER_SPLIT = 512  # below this, the merge's extra traffic (H x R fp32 per split) stops paying
MAX_SPLITS = 64


@dataclass(frozen=True)
class DecodeConfig:
    """Stage 1's tiles and how finely sequences are split (benchmarks/bench_mla_decode.py --sweep times both).

    The split knobs live here because the programs an SM holds at once depend on the tiles (registers, shared
    memory): choose_num_splits aims at programs_per_sm programs per SM (may be fractional), each split holding at
    least min_tokens_per_split tokens of the page table's capacity.

    NOTE: the c_kv load's address depends on a page-table load in the same iteration, and Triton's pipeliner
    (3.6) splits num_stages - 1 between those two loads: num_stages <= 4 gives the tile load one stage, issued
    after the tile's dots, with one buffer (no overlap of load and math); 5 or 6 double-buffer it, 7 triple-buffers
    it (seen in sm_90a TTGIR). Each buffer is BLOCK_N x (R + P) x 2 bytes of shared memory."""

    block_h: int = 16  # heads per program sharing each latent tile (the tl.dot M dimension: >= 16)
    block_n: int = 32  # tokens per tile
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: float = PROGRAMS_PER_SM
    min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT


# The defaults, by dtype and head count; the sweep prints replacement lines for the last two.
FP32_CONFIG = DecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)  # fp32 tiles are twice as large
# The two below won `benchmarks/bench_mla_decode.py --sweep` (B=64, ctx 4096, page 64, bf16; graph-replay kernel
# time; see benchmarks/results/README.md, `mla-tune`). 7 stages triple-buffer the gathered tile loads (see
# DecodeConfig).
FEW_HEADS_CONFIG = DecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=7,  # heads < 64 (V3 over 8 GPUs)
                                programs_per_sm=0.5, min_tokens_per_split=512)
# 64 heads per latent tile: M=64 allows Hopper's wgmma; 128 heads read each tile in two programs (shared via L2).
MANY_HEADS_CONFIG = DecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2,
                                 programs_per_sm=0.5, min_tokens_per_split=512)


def default_decode_config(dtype: torch.dtype, heads: int) -> DecodeConfig:
    if dtype == torch.float32:
        return FP32_CONFIG
    return MANY_HEADS_CONFIG if heads >= 64 else FEW_HEADS_CONFIG


def choose_num_splits(batch: int, heads: int, max_pages: int, page_size: int, block_h: int, sms: int, *,
                      programs_per_sm: float = PROGRAMS_PER_SM,
                      min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT) -> int:
    """Splits of each sequence's page range: enough programs for about `programs_per_sm` per SM, each split at
    least `min_tokens_per_split` tokens of the static capacity max_pages * page_size. Depends on shapes only
    (CUDA-graph safe)."""
    programs = batch * -(-heads // block_h)
    want = math.ceil(programs_per_sm * sms / programs)
    by_length = max(1, (max_pages * page_size) // min_tokens_per_split)
    splits = max(1, min(want, by_length, max_pages, MAX_SPLITS))
    pages_per_split = -(-max_pages // splits)
    return -(-max_pages // pages_per_split)  # no split left empty by rounding


# Triton compiles a variant per specialization of its integer arguments (== 1, a multiple of 16). Arguments that
# follow a request's length (max_pages and the page table's row stride: its width) are not specialized: the eager
# callers (a prefill worker's one-token NextN forward over each prompt) would compile a variant for a prompt length
# the warm-up never ran, in a request (a compile of hundreds of ms). Nor is the
# split count; so this kernel has two variants in all (DIRECT or not), whatever the lengths.
LENGTH_ARGS = ["max_pages", "pages_per_split", "stride_pt_b", "stride_ml_b", "stride_ml_h"]


@triton.jit(do_not_specialize=LENGTH_ARGS)
def _split_kernel(q_lat_ptr, q_pe_ptr, kv_ptr, page_table_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr, out_ptr,
                  sm_scale_log2, num_heads, max_pages, pages_per_split,
                  stride_ql_b, stride_ql_h, stride_qp_b, stride_qp_h, stride_kv, stride_pt_b,
                  stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h, stride_o_b, stride_o_h,
                  R: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                  DIRECT: tl.constexpr, TILE_IN_PAGE: tl.constexpr):
    head_block = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)

    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    h_mask = offs_h < num_heads
    r_mask = offs_r < R
    p_mask = offs_p < P

    kv_dtype = kv_ptr.dtype.element_ty
    q_lat = tl.load(q_lat_ptr + b * stride_ql_b + offs_h[:, None] * stride_ql_h + offs_r[None, :],
                    mask=h_mask[:, None] & r_mask[None, :], other=0.0).to(kv_dtype)  # (BLOCK_H, BLOCK_R)
    q_pe = tl.load(q_pe_ptr + b * stride_qp_b + offs_h[:, None] * stride_qp_h + offs_p[None, :],
                   mask=h_mask[:, None] & p_mask[None, :], other=0.0).to(kv_dtype)  # (BLOCK_H, BLOCK_P)

    seq_len = tl.minimum(tl.load(seq_lens_ptr + b).to(tl.int32), max_pages * PAGE_SIZE)
    tok_lo = split * pages_per_split * PAGE_SIZE
    tok_hi = tl.minimum(seq_len, tok_lo + pages_per_split * PAGE_SIZE)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for start in range(tok_lo, tok_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < tok_hi
        if TILE_IN_PAGE:  # tok_lo is page-aligned and BLOCK_N divides PAGE_SIZE: the tile is in one page
            page = tl.load(page_table_ptr + b * stride_pt_b + start // PAGE_SIZE).to(tl.int64)
            rows = kv_ptr + (page * PAGE_SIZE + start % PAGE_SIZE + tl.arange(0, BLOCK_N)) * stride_kv
        else:
            page = tl.load(page_table_ptr + b * stride_pt_b + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
            rows = kv_ptr + (page * PAGE_SIZE + offs_n % PAGE_SIZE) * stride_kv  # (BLOCK_N,) row pointers, int64
        # (r_mask / p_mask are all true for V3's R, P; Triton folds them: the PTX is the same without them)
        c_kv = tl.load(rows[:, None] + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :],
                       other=0.0)  # (BLOCK_N, BLOCK_R): key and value, loaded once for all BLOCK_H heads
        k_pe = tl.load(rows[:, None] + R + offs_p[None, :], mask=n_mask[:, None] & p_mask[None, :],
                       other=0.0)  # (BLOCK_N, BLOCK_P)
        if IEEE:
            qk = tl.dot(q_lat, tl.trans(c_kv), input_precision="ieee")
            qk = tl.dot(q_pe, tl.trans(k_pe), acc=qk, input_precision="ieee")
        else:
            qk = tl.dot(q_lat, tl.trans(c_kv))
            qk = tl.dot(q_pe, tl.trans(k_pe), acc=qk)  # (BLOCK_H, BLOCK_N) fp32
        qk = tl.where(n_mask[None, :], qk * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: every tile holds at least one key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = tl.dot(p.to(kv_dtype), c_kv, acc=acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(kv_dtype), c_kv, acc=acc * alpha[:, None])
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]  # a row or split without keys: 0
    if DIRECT:  # one split: this is the final output, no merge pass
        tl.store(out_ptr + b * stride_o_b + offs_h[:, None] * stride_o_h + offs_r[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & r_mask[None, :])
    else:
        lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(mid_o_ptr + b * stride_mo_b + offs_h[:, None] * stride_mo_h + split * stride_mo_s
                 + offs_r[None, :], out, mask=h_mask[:, None] & r_mask[None, :])
        tl.store(mid_lse_ptr + b * stride_ml_b + offs_h * stride_ml_h + split, lse, mask=h_mask)


@triton.jit(do_not_specialize=["num_splits", "stride_ml_b", "stride_ml_h"])
def _merge_kernel(mid_o_ptr, mid_lse_ptr, out_ptr, num_splits,
                  stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h, stride_o_b, stride_o_h,
                  R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    lse_row = mid_lse_ptr + b * stride_ml_b + h * stride_ml_h
    lses = tl.load(lse_row + offs_s, mask=offs_s < num_splits, other=float("-inf"))  # (BLOCK_S,)
    m = tl.max(lses, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: every weight below is 0
    denom = tl.sum(tl.exp(lses - m), 0)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    o_row = mid_o_ptr + b * stride_mo_b + h * stride_mo_h
    for s in range(0, num_splits):
        w = tl.exp(tl.load(lse_row + s) - m)  # 0 for an empty split (stage 1 wrote its partial output as 0)
        acc += w * tl.load(o_row + s * stride_mo_s + offs_r, mask=r_mask, other=0.0)
    out = tl.where(denom > 0.0, acc / tl.where(denom > 0.0, denom, 1.0), 0.0)
    tl.store(out_ptr + b * stride_o_b + h * stride_o_h + offs_r, out.to(out_ptr.dtype.element_ty), mask=r_mask)


def mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_layer: torch.Tensor, page_table: torch.Tensor,
               seq_lens: torch.Tensor, page_size: int, sm_scale: float, *, out: Optional[torch.Tensor] = None,
               num_splits: Optional[int] = None, config: Optional[DecodeConfig] = None,
               compile_only: bool = False) -> torch.Tensor:
    """Absorbed MLA decode (contract of AttentionBackend.mla_decode), optionally into a preallocated `out`.

    q_latent (B, H, R), q_pe (B, H, P); kv_layer (num_slots, R + P), last dim contiguous; page_table
    (B, max_pages) int32/int64; seq_lens (B,) int32/int64 on the device, each <= max_pages * page_size (longer is
    clipped). num_splits defaults to `choose_num_splits` on static shapes. Returns out (B, H, R) in q's dtype.
    compile_only: compile the kernels for these arguments (into Triton's on-disk cache) and launch nothing; `out`
    is returned unwritten (benchmarks compile candidate configs in parallel processes with it).
    """
    check_device(q_latent)
    batch, heads, rank = q_latent.shape
    rope = q_pe.shape[-1]
    if kv_layer.shape[-1] != rank + rope:
        raise ValueError(f"kv_layer width {kv_layer.shape[-1]} != R + P = {rank} + {rope}")
    if kv_layer.stride(-1) != 1:
        raise ValueError("kv_layer must be contiguous in its last dimension")
    if q_latent.stride(-1) != 1:
        q_latent = q_latent.contiguous()
    if q_pe.stride(-1) != 1:
        q_pe = q_pe.contiguous()
    cfg = config or default_decode_config(kv_layer.dtype, heads)
    max_pages = page_table.shape[1]
    if num_splits is None:
        num_splits = choose_num_splits(batch, heads, max_pages, page_size, cfg.block_h, num_sms(q_latent.device),
                                       programs_per_sm=cfg.programs_per_sm,
                                       min_tokens_per_split=cfg.min_tokens_per_split)
    pages_per_split = -(-max_pages // num_splits)
    if out is None:
        out = torch.empty_like(q_latent)
    elif out.shape != q_latent.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q_latent.shape)} with a contiguous last dimension")
    if batch == 0 or (compile_only and interpreter_requested()):  # (the interpreter compiles nothing)
        return out
    direct = num_splits == 1
    # Partial outputs and LSEs per split (unused, 1-element placeholders, when one split writes out directly).
    mid_o = torch.empty(*((1, 1, 1, 1) if direct else (batch, heads, num_splits, rank)), dtype=torch.float32,
                        device=q_latent.device)
    mid_lse = torch.empty(*((1, 1, 1) if direct else (batch, heads, num_splits)), dtype=torch.float32,
                          device=q_latent.device)

    grid = (-(-heads // cfg.block_h), batch, num_splits)  # head blocks of one (row, split) side by side: L2 reuse
    _launcher(_split_kernel, grid, compile_only)(
        q_latent, q_pe, kv_layer, page_table, seq_lens, mid_o, mid_lse, out,
        sm_scale * 1.4426950408889634, heads, max_pages, pages_per_split,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), kv_layer.stride(0),
        page_table.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        R=rank, P=rope, BLOCK_R=max(16, next_pow2(rank)), BLOCK_P=max(16, next_pow2(rope)), PAGE_SIZE=page_size,
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, IEEE=kv_layer.dtype == torch.float32, DIRECT=direct,
        TILE_IN_PAGE=page_size % cfg.block_n == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if direct:
        return out
    _launcher(_merge_kernel, (batch, heads), compile_only)(
        mid_o, mid_lse, out, num_splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        R=rank, BLOCK_R=next_pow2(rank), BLOCK_S=merge_block(num_splits), num_warps=4)
    return out


def merge_block(num_splits: int) -> int:
    """The merge's LSE vector: one width for every split count choose_num_splits gives (one compile, not one per
    power of two of the length), wider only for an explicit num_splits above MAX_SPLITS."""
    return max(next_pow2(MAX_SPLITS), next_pow2(num_splits))


def _launcher(kernel, grid: tuple, compile_only: bool):
    """kernel[grid], or with compile_only Triton's warmup: the same compile (into the on-disk cache), no launch."""
    return functools.partial(kernel.warmup, grid=grid) if compile_only else kernel[grid]
