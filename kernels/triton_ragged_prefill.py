"""Ragged multi-head flash attention in Triton (the prefill half of MLA: qk 192 / v 128 per head for V3).

Grid (query blocks over all sequences, heads): the host lays the batch out as a list of (sequence, first query row)
blocks of BLOCK_M rows; qo_indptr / kv_indptr arrive as host lists (AttentionBackend contract), so this costs no
sync, and they go to the device as one small int32 tensor. Each program streams its sequence's keys BLOCK_N at a
time with an online softmax in fp32 (exp2 domain) and writes out in q's dtype and the natural-log LSE.

The qk width is split into a power-of-two part and a padded remainder (192 = 128 + 64 exactly; 24 = 16 + 16 with
the last 8 masked), so V3's rope tail costs no padding. Causal: query i of a sequence sees keys
0..kv_len - q_len + i; a row that sees no key gets out 0 and LSE -inf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_support import check_device, interpreter_requested, next_pow2, patch_interpreter_for_numpy2

if interpreter_requested():
    patch_interpreter_for_numpy2()


@dataclass(frozen=True)
class PrefillConfig:
    """Tile sizes. Chosen from offline sm_90a compiles (ptxas: no spills for 16-bit inputs at qk 192 / v 128),
    not yet timed on a GPU."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2


def default_prefill_config(dtype: torch.dtype) -> PrefillConfig:
    if dtype == torch.float32:  # fp32 tiles are twice as large: small tiles keep registers in bounds
        return PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    return PrefillConfig()


def split_head_dim(d: int) -> tuple[int, int, int]:
    """qk width -> (first part, its block, remainder block): both blocks powers of two >= 16, remainder 0 if none."""
    if d <= 16 or d & (d - 1) == 0:
        return max(16, next_pow2(d)), max(16, next_pow2(d)), 0
    first = 1 << (d.bit_length() - 1)  # largest power of two below d
    return first, first, max(16, next_pow2(d - first))


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, meta_ptr, num_seqs, sm_scale_log2,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_ot, stride_oh, stride_lt, stride_lh,
                    DQK: tl.constexpr, D1: tl.constexpr, BLOCK_D2: tl.constexpr, DV: tl.constexpr,
                    BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    IEEE: tl.constexpr):
    # meta (int32): qo_indptr[num_seqs + 1], kv_indptr[num_seqs + 1], block_seq[num_blocks], block_row[num_blocks]
    pid = tl.program_id(0)
    h = tl.program_id(1)
    num_blocks_base = 2 * (num_seqs + 1)
    seq = tl.load(meta_ptr + num_blocks_base + pid)
    m0 = tl.load(meta_ptr + num_blocks_base + tl.num_programs(0) + pid)
    q_start = tl.load(meta_ptr + seq)
    q_len = tl.load(meta_ptr + seq + 1) - q_start
    k_start = tl.load(meta_ptr + num_seqs + 1 + seq)
    kv_len = tl.load(meta_ptr + num_seqs + 2 + seq) - k_start

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    offs_d1 = tl.arange(0, D1)
    offs_dv = tl.arange(0, BLOCK_DV)
    d1_mask = offs_d1 < DQK
    dv_mask = offs_dv < DV

    q_rows = q_ptr + (q_start + offs_m).to(tl.int64) * stride_qt + h * stride_qh  # (BLOCK_M,)
    q1 = tl.load(q_rows[:, None] + offs_d1[None, :], mask=m_mask[:, None] & d1_mask[None, :], other=0.0)
    if BLOCK_D2 > 0:  # the remainder of the qk width (V3: the 64 rope dims)
        offs_d2 = tl.arange(0, BLOCK_D2)
        d2_mask = D1 + offs_d2 < DQK
        q2 = tl.load(q_rows[:, None] + D1 + offs_d2[None, :], mask=m_mask[:, None] & d2_mask[None, :], other=0.0)

    if CAUSAL:  # the last row of this block sees keys up to kv_len - q_len + m0 + BLOCK_M - 1
        hi = tl.minimum(kv_len, tl.maximum(kv_len - q_len + m0 + BLOCK_M, 0))
    else:
        hi = kv_len

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for start in range(0, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_len
        k_rows = k_ptr + (k_start + offs_n).to(tl.int64) * stride_kt + h * stride_kh
        v_rows = v_ptr + (k_start + offs_n).to(tl.int64) * stride_vt + h * stride_vh
        k1 = tl.load(k_rows[:, None] + offs_d1[None, :], mask=n_mask[:, None] & d1_mask[None, :],
                     other=0.0).to(q1.dtype)
        if IEEE:
            s = tl.dot(q1, tl.trans(k1), input_precision="ieee")
        else:
            s = tl.dot(q1, tl.trans(k1))
        if BLOCK_D2 > 0:
            k2 = tl.load(k_rows[:, None] + D1 + offs_d2[None, :], mask=n_mask[:, None] & d2_mask[None, :],
                         other=0.0).to(q1.dtype)
            if IEEE:
                s = tl.dot(q2, tl.trans(k2), acc=s, input_precision="ieee")
            else:
                s = tl.dot(q2, tl.trans(k2), acc=s)  # (BLOCK_M, BLOCK_N) fp32
        visible = n_mask[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= (kv_len - q_len + offs_m)[:, None])
        s = tl.where(visible, s * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_rows[:, None] + offs_dv[None, :], mask=n_mask[:, None] & dv_mask[None, :],
                    other=0.0).to(q1.dtype)
        if IEEE:
            acc = tl.dot(p.to(q1.dtype), v, acc=acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(q1.dtype), v, acc=acc * alpha[:, None])
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    rows = (q_start + offs_m).to(tl.int64)
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & dv_mask[None, :])
    tl.store(lse_ptr + rows * stride_lt + h * stride_lh, lse, mask=m_mask)


def prefill_metadata(qo_indptr: list[int], kv_indptr: list[int], block_m: int,
                     device: torch.device) -> tuple[torch.Tensor, int]:
    """One int32 device tensor [qo_indptr | kv_indptr | block_seq | block_row] and the number of query blocks."""
    block_seq, block_row = [], []
    for b in range(len(qo_indptr) - 1):
        for row in range(0, qo_indptr[b + 1] - qo_indptr[b], block_m):
            block_seq.append(b)
            block_row.append(row)
    meta = torch.tensor([*qo_indptr, *kv_indptr, *block_seq, *block_row], dtype=torch.int32)
    if device.type == "cuda":  # pinned + non_blocking: no host sync (a pageable upload would wait for the GPU)
        return meta.pin_memory().to(device, non_blocking=True), len(block_seq)
    return meta.to(device), len(block_seq)


def ragged_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qo_indptr: list[int], kv_indptr: list[int],
                   causal: bool, sm_scale: float, *, out: Optional[torch.Tensor] = None,
                   lse: Optional[torch.Tensor] = None, meta: Optional[tuple[torch.Tensor, int]] = None,
                   config: Optional[PrefillConfig] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged attention (contract of AttentionBackend.ragged_prefill), optionally into preallocated out / lse.

    q (Tq, H, Dqk), k (Tk, H, Dqk), v (Tk, H, Dv), any strides with the last dimension contiguous. `meta` is
    `prefill_metadata(qo_indptr, kv_indptr, config.block_m, device)`, for callers that reuse it across layers.
    Rows of q outside qo_indptr[0]:qo_indptr[-1] are left as they were in out / lse.
    """
    check_device(q)
    tq, heads, dqk = q.shape
    dv = v.shape[-1]
    if len(qo_indptr) != len(kv_indptr):
        raise ValueError(f"qo_indptr has {len(qo_indptr)} entries but kv_indptr has {len(kv_indptr)}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cfg = config or default_prefill_config(q.dtype)
    covered = (qo_indptr[0], qo_indptr[-1]) == (0, tq)  # the kernel writes every row: no need to pre-fill
    if out is None:
        out = q.new_empty(tq, heads, dv) if covered else q.new_zeros(tq, heads, dv)
    if lse is None:
        lse = torch.empty(tq, heads, dtype=torch.float32, device=q.device)
        if not covered:
            lse.fill_(float("-inf"))
    meta_t, num_blocks = meta if meta is not None else prefill_metadata(qo_indptr, kv_indptr, cfg.block_m, q.device)
    if num_blocks == 0 or heads == 0:
        return out, lse
    d1, _, block_d2 = split_head_dim(dqk)
    _prefill_kernel[(num_blocks, heads)](
        q, k, v, out, lse, meta_t, len(qo_indptr) - 1, sm_scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        DQK=dqk, D1=d1, BLOCK_D2=block_d2, DV=dv, BLOCK_DV=max(16, next_pow2(dv)), CAUSAL=bool(causal),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, IEEE=q.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out, lse
