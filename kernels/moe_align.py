"""Token permutation for grouped expert GEMMs: (token, slot) pairs sorted by expert, each expert's segment
padded to a multiple of block_m (like SGLang/vLLM's moe_align_block_size).

The layout contract, shared by the Triton fused-MoE kernels and DeepGEMM's grouped GEMMs:
- a *pair* is p = token * top_k + slot, for p in [0, P), P = T * top_k;
- `sorted_token_ids[r]` is the pair held by row r of the permuted layout, or the sentinel P on a padding row;
  rows of expert e are [expert_offsets[e], expert_offsets[e] + expert_counts[e]), then padding up to
  expert_offsets[e + 1] (a multiple of block_m);
- `expert_ids[b]` is the expert of rows [b * block_m, (b + 1) * block_m), -1 for blocks at or past
  `num_tokens_post_padded`;
- a pair whose id is E (an expert on another rank, under expert parallelism) holds no row: its expert computes
  nothing here, and `inverse_rows` gives it -1;
- every buffer has a static size fixed by (T, top_k, E, block_m) alone:
  rows = round_up(P + min(E, P) * (block_m - 1), block_m), so the computation never syncs with the host and can
  be captured in a CUDA graph. (At most min(E, P) experts are non-empty, each padding fewer than block_m rows.)

Imports triton (the Triton version); imported lazily by the backends, never by pdserve.kernels.

With block_m = 1 there is no padding: the rows are simply the pairs sorted by expert (DeepGEMM's masked layout
is built from that). Row order inside an expert's segment is unspecified (the Triton version places pairs with
atomics); results do not depend on it because every row is computed independently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_support import interpreter_requested, patch_interpreter_for_numpy2

if interpreter_requested():
    patch_interpreter_for_numpy2()


@dataclass(frozen=True)
class AlignedTokens:
    sorted_token_ids: torch.Tensor  # (rows,) int32 pair per row, sentinel num_pairs on padding rows
    expert_ids: torch.Tensor  # (rows / block_m,) int32 expert per block of rows, -1 past the end
    num_tokens_post_padded: torch.Tensor  # (1,) int32: rows in use (sum of padded segments)
    expert_offsets: torch.Tensor  # (E + 1,) int32 start row of each expert's segment; [E] = rows in use
    expert_counts: torch.Tensor  # (E,) int32 pairs routed to each expert
    block_m: int
    num_pairs: int  # P = T * top_k, also the sentinel value


def max_aligned_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static worst-case number of rows of the aligned layout."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


def runs_triton(t: torch.Tensor) -> bool:
    """Triton kernels take CUDA tensors, or CPU tensors under Triton's interpreter (TRITON_INTERPRET=1)."""
    return t.is_cuda or interpreter_requested()


@triton.jit(do_not_specialize=["num_pairs", "max_rows", "max_blocks"])
def _align_plan_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, offsets_ptr, counts_ptr, cursor_ptr, ntpp_ptr,
                       num_pairs, num_experts, max_rows, max_blocks,
                       BLOCK_M: tl.constexpr, E_P: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr,
                       BLOCKS_CHUNK: tl.constexpr):
    """Every program fills its FILL rows of sorted_ids with the sentinel; program 0 also counts pairs per expert
    (histogram), lays out the padded segments (cumsum), writes each block's expert and zeroes the cursors."""
    pid = tl.program_id(0)
    rows = pid * FILL + tl.arange(0, FILL)
    tl.store(sorted_ptr + rows, tl.full((FILL,), 0, tl.int32) + num_pairs, mask=rows < max_rows)
    if pid == 0:
        ex = tl.arange(0, E_P)
        is_expert = ex < num_experts
        counts = tl.zeros((E_P,), dtype=tl.int32)
        for start in range(0, num_pairs, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            # Out-of-range lanes count into bin num_experts (< E_P), which is dropped below.
            e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=num_experts).to(tl.int32)
            counts += tl.histogram(e, E_P)
        counts = tl.where(is_expert, counts, 0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, 0)
        total = tl.sum(padded)
        tl.store(counts_ptr + ex, counts, mask=is_expert)
        tl.store(offsets_ptr + ex, ends - padded, mask=is_expert)
        tl.store(offsets_ptr + num_experts + ex, tl.zeros((E_P,), tl.int32) + total, mask=ex == 0)
        tl.store(ntpp_ptr + ex, tl.zeros((E_P,), tl.int32) + total, mask=ex == 0)
        tl.store(cursor_ptr + ex, tl.zeros((E_P,), tl.int32), mask=is_expert)
        ends = tl.where(is_expert, ends, 1 << 30)
        for b0 in range(0, max_blocks, BLOCKS_CHUNK):
            b = b0 + tl.arange(0, BLOCKS_CHUNK)
            first_row = b * BLOCK_M
            # The expert holding a row = how many segments end at or before it.
            eid = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
            eid = tl.where(first_row < total, eid, -1)
            tl.store(expert_ids_ptr + b, eid, mask=b < max_blocks)


@triton.jit(do_not_specialize=["num_pairs"])
def _align_scatter_kernel(ids_ptr, sorted_ptr, offsets_ptr, cursor_ptr, num_pairs, num_experts,
                          BLOCK: tl.constexpr):
    """Each pair takes the next free row of its expert's segment; a pair of an absent expert (id num_experts)
    takes none."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_pairs
    e = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
    ok = ok & (e < num_experts)
    slot = tl.atomic_add(cursor_ptr + e, 1, mask=ok)
    start = tl.load(offsets_ptr + e, mask=ok, other=0)
    tl.store(sorted_ptr + start + slot, offs, mask=ok)


def align_tokens_layout(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedTokens:
    """topk_ids (T, top_k) -> the aligned layout (see the module docstring). Triton on CUDA, torch elsewhere."""
    if not runs_triton(topk_ids):
        return align_tokens_torch(topk_ids, num_experts, block_m)
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    num_pairs = ids.numel()
    rows = max_aligned_rows(num_pairs, num_experts, block_m)
    blocks = rows // block_m
    dev = topk_ids.device
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(blocks, dtype=torch.int32, device=dev)
    small = torch.empty(3 * num_experts + 2, dtype=torch.int32, device=dev)  # offsets | counts | cursor | ntpp
    offsets, counts = small[:num_experts + 1], small[num_experts + 1:2 * num_experts + 1]
    cursor, ntpp = small[2 * num_experts + 1:3 * num_experts + 1], small[3 * num_experts + 1:]
    fill = 1024
    _align_plan_kernel[(max(1, triton.cdiv(rows, fill)),)](
        ids, sorted_ids, expert_ids, offsets, counts, cursor, ntpp, num_pairs, num_experts, rows, blocks,
        BLOCK_M=block_m, E_P=triton.next_power_of_2(num_experts + 1), CHUNK=1024, FILL=fill, BLOCKS_CHUNK=64,
        num_warps=4)
    if num_pairs:
        block = 256
        _align_scatter_kernel[(triton.cdiv(num_pairs, block),)](ids, sorted_ids, offsets, cursor, num_pairs,
                                                                 num_experts, BLOCK=block, num_warps=4)
    return AlignedTokens(sorted_ids, expert_ids, ntpp, offsets, counts, block_m, num_pairs)


def align_tokens(topk_ids: torch.Tensor, num_experts: int,
                 block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids, expert_ids per block, num_tokens_post_padded), as vLLM's moe_align_block_size."""
    a = align_tokens_layout(topk_ids, num_experts, block_m)
    return a.sorted_token_ids, a.expert_ids, a.num_tokens_post_padded


def align_tokens_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedTokens:
    """Reference (and CPU) implementation: a stable sort by expert, no host syncs either."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    rows = max_aligned_rows(num_pairs, num_experts, block_m)
    # Bin E holds the pairs of absent experts (another rank's); it takes no rows.
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts] = 0
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.sort(flat, stable=True).indices  # pairs grouped by expert
    sorted_e = flat[order]
    rank = torch.arange(num_pairs, device=dev) - (counts.cumsum(0) - counts)[sorted_e]
    sorted_ids = torch.full((rows + 1,), num_pairs, dtype=torch.int32, device=dev)  # [rows]: absent pairs' dump
    sorted_ids[torch.where(sorted_e < num_experts, starts[sorted_e] + rank, rows)] = order.int()
    sorted_ids = sorted_ids[:rows]
    counts, ends, starts = counts[:num_experts], ends[:num_experts], starts[:num_experts]
    first_row = torch.arange(rows // block_m, device=dev) * block_m
    total = ends[-1:] if num_experts else torch.zeros(1, dtype=torch.long, device=dev)
    expert_ids = torch.searchsorted(ends, first_row, right=True)
    expert_ids = torch.where(first_row < total, expert_ids, -1).int()
    offsets = torch.cat([starts, total]).int()
    return AlignedTokens(sorted_ids, expert_ids, total.int(), offsets, counts.int(), block_m, num_pairs)


def inverse_rows(aligned: AlignedTokens) -> torch.Tensor:
    """(P,) int64: the row of the aligned layout that holds each pair (the inverse of sorted_token_ids), -1 for a
    pair of an absent expert."""
    rows = aligned.sorted_token_ids.numel()
    # -1: a pair of an absent expert, which no row holds.
    inv = torch.full((aligned.num_pairs + 1,), -1, dtype=torch.long, device=aligned.sorted_token_ids.device)
    # Padding rows all write to the extra slot P, which is dropped.
    inv.scatter_(0, aligned.sorted_token_ids.long(), torch.arange(rows, device=inv.device))
    return inv[:aligned.num_pairs]


def row_experts(aligned: AlignedTokens) -> torch.Tensor:
    """(rows,) int32: the expert of every row of the aligned layout, -1 on padding rows (DeepGEMM's m_indices)."""
    experts = aligned.expert_ids.repeat_interleave(aligned.block_m)
    return torch.where(aligned.sorted_token_ids < aligned.num_pairs, experts, -1).int()
