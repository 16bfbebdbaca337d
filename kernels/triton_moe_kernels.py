"""Fused MoE in Triton (like vLLM's fused_moe_kernel): the kernels behind the "triton" MoE backend (triton_moe.py).

Per call, with T tokens, top_k slots, P = T * top_k (token, slot) pairs, E experts, hidden H, intermediate I:
1. fp8 weights: x is quantized once per token per 128 channels (e4m3 + fp32 scales, `per_token_group_quant`);
2. `align_tokens_layout` sorts the pairs by expert into segments padded to BLOCK_M rows (moe_align.py);
3. gate-up kernel: for each BLOCK_M rows of one expert and BLOCK_N rows of w13 (BLOCK_N / 2 gate rows and the
   matching up rows, interleaved in one accumulator), x[pair // top_k] @ w13[e]^T, SiLU(gate) * up in fp32,
   written per pair as (P, I); for fp8 the 1x128 quantization of that activation is fused in the epilogue (a
   program covers 128 columns: BLOCK_N = 256, or BLOCK_N = 128 run twice; other tiles quantize separately);
4. down kernel: act[pair] @ w2[e]^T times the pair's routing weight, written per pair as (P, H);
5. the combine sums each token's top_k rows into (T, H).
A config whose down entry says "LAYOUT": "contiguous" runs step 4 as DeepGEMM's contiguous grouped GEMM in
Triton (triton_grouped_gemm.py: TMA loads): gate-up then writes its activation by layout row, and the combine
gathers each pair's row (`gather_combine`).
Everything is sized by T (never by routing results): no host syncs, so the whole layer captures in a CUDA graph.
Programs whose rows are all past `num_tokens_post_padded` exit at once.

The down kernel reads the same aligned layout as the gate-up kernel, so both share BLOCK_M (moe_configs.py).
`silu_mul_quant` and `gather_combine` serve the DeepGEMM backend (deep_gemm_moe.py).

Imports triton: imported lazily by the backends, never by pdserve.kernels (see triton_support.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .gemm import FP8_DTYPE, FP8_MAX, INV_FP8_MAX
from .grouped_contract import contiguous_layout
from .moe_align import AlignedTokens, align_tokens_layout, inverse_rows, row_experts
from .moe_configs import get_config
from .triton_fp8 import GROUP, per_token_group_quant
from .triton_support import interpreter_requested, patch_interpreter_for_numpy2

if interpreter_requested():
    patch_interpreter_for_numpy2()


@triton.jit
def _expert_block(a_ptr, as_ptr, w_ptr, ws_ptr, a_rows, e, col0, N, K,
                  stride_am, stride_asm, stride_asg, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk,
                  GLU: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr, WS_MODE: tl.constexpr,
                  GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  OUT_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """fp32 (BLOCK_M, OUT_N): output columns [col0, col0 + OUT_N) of A[a_rows] @ W[e]^T, one accumulator.

    The tile holds BLOCK_N weight rows. GLU: rows alternate gate, up (tile column 2j is gate row col0 + j, 2j + 1
    is up row N + col0 + j), so OUT_N = BLOCK_N / 2 and SiLU(gate) * up pairs columns that sit in the same thread
    of the MMA layout. Weight scales of a K step (WS_MODE, see `gemm_geometry`): 1 = one number (the tile lies in
    one 128-row scale block), 2 = two numbers (gate and up blocks with GLU, else the tile's two 128-row halves),
    0 = one per weight row (any other tile)."""
    j = tl.arange(0, BLOCK_N)
    if GLU:
        col = col0 + j // 2
        is_up = (j % 2) == 1
        w_row = tl.where(is_up, col + N, col)
    else:
        col = col0 + j
        w_row = col
    # Columns past N (ragged N) read a valid row instead of masking; they are never stored.
    w_row = tl.where(col < N, w_row, 0)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + e * stride_we + w_row.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    if FP8:
        as_ptrs = as_ptr + a_rows * stride_asm
        ws_base = ws_ptr + e * stride_wse
        if WS_MODE == 0:
            ws_ptrs = ws_base + (w_row // GROUP_N) * stride_wsn
        else:
            ws_lo = ws_base + (col0 // GROUP_N) * stride_wsn
            if GLU:
                ws_hi = ws_base + ((col0 + N) // GROUP_N) * stride_wsn
            else:
                ws_hi = ws_lo + stride_wsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k0 = kt * BLOCK_K
        # Rows are always valid (padding rows read row 0), so only a ragged K needs masks.
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        if FP8:
            g = k0 // GROUP_K
            a_s = tl.load(as_ptrs + g * stride_asg)
            # NOTE: wgmma cannot apply per-row x per-column scales itself, so every K step waits for its product
            # and scales it on the CUDA cores; one FMA per element (not a multiply and an FMA) keeps that short.
            if WS_MODE == 1:
                acc += tl.dot(a, w) * (a_s * tl.load(ws_lo + g * stride_wsk))[:, None]
            elif WS_MODE == 2:
                s_lo = a_s * tl.load(ws_lo + g * stride_wsk)
                s_hi = a_s * tl.load(ws_hi + g * stride_wsk)
                if GLU:  # tile columns alternate gate (lo), up (hi)
                    s = tl.broadcast_to(tl.join(s_lo, s_hi)[:, None, :], (BLOCK_M, OUT_N, 2))
                else:  # the tile's two 128-column halves
                    s = tl.broadcast_to(tl.join(s_lo, s_hi)[:, :, None], (BLOCK_M, 2, GROUP_N))
                acc += tl.dot(a, w) * tl.reshape(s, (BLOCK_M, BLOCK_N))
            else:
                acc += tl.dot(a, w) * a_s[:, None] * tl.load(ws_ptrs + g * stride_wsk)[None, :]
        elif IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if GLU:
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, OUT_N, 2)))
        h = gate * tl.sigmoid(gate) * up  # SiLU(gate) * up, in fp32
    else:
        h = acc
    return h


# NOTE: token-dependent integers are not specialised, so a new batch size does not recompile (CUDA-graph
# capture of many sizes, the tuner sweeping T).
@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
def _fused_moe_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, os_ptr, topk_w_ptr,
                      sorted_ptr, expert_ids_ptr, ntpp_ptr,
                      num_pairs, N, K, num_blocks_m,
                      stride_am, stride_asm, stride_asg,
                      stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk,
                      stride_om, stride_osm, stride_osg,
                      A_DIV: tl.constexpr, GLU: tl.constexpr, MUL_WEIGHT: tl.constexpr, FP8: tl.constexpr,
                      QUANT_OUT: tl.constexpr, OUT_BY_ROW: tl.constexpr, IEEE: tl.constexpr, WS_MODE: tl.constexpr,
                      FP8_MAX_C: tl.constexpr, INV_FP8_MAX_C: tl.constexpr, GROUP_N: tl.constexpr,
                      GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, OUT_N: tl.constexpr,
                      SUB_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    """out[pair, n] = f(A[pair // A_DIV] @ W[e]^T) for the BLOCK_M rows of one expert block.

    A (rows, K) (fp8 + (rows, K/128) scales, or bf16/fp32); W (E, N or 2N, K) (fp8 + (E, ./128, K/128) scales).
    GLU: W holds [gate; up] (2N rows) and f = SiLU(gate) * up. MUL_WEIGHT: f times the pair's routing weight.
    QUANT_OUT: the result is written as fp8 with one fp32 scale per 128 columns (os_ptr). OUT_BY_ROW: output rows
    are the layout's rows (padding rows left unset) instead of the pairs. A program writes
    SUB_N * OUT_N columns: SUB_N = 2 (QUANT_OUT only) runs two 64-column blocks back to back, so that a 128-column
    scale group stays in one program while the accumulator stays small (2 CTAs per SM at 4 warps)."""
    tl.static_assert(SUB_N == 1 or (QUANT_OUT and not MUL_WEIGHT and SUB_N * OUT_N == GROUP_N))
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, OUT_N * SUB_N)
    # Grouped ordering: GROUP_M row blocks (mostly of one expert) share each weight tile while it is in L2.
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    group_rows = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows
    if pid_m * BLOCK_M >= tl.load(ntpp_ptr):
        return
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

    offs_tok = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    tok_ok = offs_tok < num_pairs
    # Padding rows read row 0 (valid memory, no masks in the K loop); they are never stored.
    a_rows = tl.where(tok_ok, offs_tok // A_DIV, 0).to(tl.int64)
    col0 = pid_n * (OUT_N * SUB_N)
    h = _expert_block(a_ptr, as_ptr, w_ptr, ws_ptr, a_rows, e, col0, N, K, stride_am, stride_asm, stride_asg,
                      stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, GLU, FP8, IEEE, WS_MODE, GROUP_N,
                      GROUP_K, BLOCK_M, BLOCK_N, OUT_N, BLOCK_K, EVEN_K)
    if SUB_N == 2:
        h2 = _expert_block(a_ptr, as_ptr, w_ptr, ws_ptr, a_rows, e, col0 + OUT_N, N, K, stride_am, stride_asm,
                           stride_asg, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, GLU, FP8, IEEE,
                           WS_MODE, GROUP_N, GROUP_K, BLOCK_M, BLOCK_N, OUT_N, BLOCK_K, EVEN_K)
    if MUL_WEIGHT:
        h = h * tl.load(topk_w_ptr + offs_tok, mask=tok_ok, other=0.0).to(tl.float32)[:, None]

    if OUT_BY_ROW:  # output row = the aligned layout's row (a contiguous-layout GEMM reads it next)
        out_idx = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    else:  # output row = the pair
        out_idx = offs_tok.to(tl.int64)
    out_rows = out_idx * stride_om
    offs_n = col0 + tl.arange(0, OUT_N)
    st_mask = tok_ok[:, None] & (offs_n[None, :] < N)
    if QUANT_OUT:
        # 1x128 quantization of the activation, as per_token_group_quant would do it.
        if SUB_N == 2:  # the two halves of one group
            amax = tl.maximum(tl.max(tl.abs(h), axis=1), tl.max(tl.abs(h2), axis=1))
            scale = tl.maximum(amax, 1e-12) * INV_FP8_MAX_C  # (BLOCK_M,)
            q = tl.minimum(tl.maximum(tl.math.div_rn(h, scale[:, None]), -FP8_MAX_C), FP8_MAX_C)
            q2 = tl.minimum(tl.maximum(tl.math.div_rn(h2, scale[:, None]), -FP8_MAX_C), FP8_MAX_C)
            tl.store(os_ptr + out_idx * stride_osm + (col0 // GROUP_N) * stride_osg, scale,
                     mask=tok_ok)
            tl.store(out_ptr + out_rows[:, None] + (offs_n + OUT_N)[None, :], q2.to(out_ptr.dtype.element_ty),
                     mask=tok_ok[:, None] & ((offs_n + OUT_N)[None, :] < N))
        elif OUT_N == GROUP_N:  # one group per tile: a plain row reduction
            scale = tl.maximum(tl.max(tl.abs(h), axis=1), 1e-12) * INV_FP8_MAX_C  # (BLOCK_M,)
            q = tl.minimum(tl.maximum(tl.math.div_rn(h, scale[:, None]), -FP8_MAX_C), FP8_MAX_C)
            tl.store(os_ptr + out_idx * stride_osm + (col0 // GROUP_N) * stride_osg, scale,
                     mask=tok_ok)
        else:
            G: tl.constexpr = OUT_N // GROUP_N
            hg = tl.reshape(h, (BLOCK_M, G, GROUP_N))
            scale = tl.maximum(tl.max(tl.abs(hg), axis=2), 1e-12) * INV_FP8_MAX_C  # (BLOCK_M, G)
            q = tl.minimum(tl.maximum(tl.math.div_rn(hg, scale[:, :, None]), -FP8_MAX_C), FP8_MAX_C)
            q = tl.reshape(q, (BLOCK_M, OUT_N))
            offs_g = col0 // GROUP_N + tl.arange(0, G)
            tl.store(os_ptr + out_idx[:, None] * stride_osm + offs_g[None, :] * stride_osg, scale,
                     mask=tok_ok[:, None] & (offs_g[None, :] * GROUP_N < N))
        tl.store(out_ptr + out_rows[:, None] + offs_n[None, :], q.to(out_ptr.dtype.element_ty), mask=st_mask)
    else:
        tl.store(out_ptr + out_rows[:, None] + offs_n[None, :], h.to(out_ptr.dtype.element_ty), mask=st_mask)


@triton.jit(do_not_specialize=["R"])
def _silu_mul_quant_kernel(h_ptr, q_ptr, s_ptr, R, I, stride_hm, stride_qm, stride_sm, stride_sg,
                           GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, FP8_MAX_C: tl.constexpr,
                           INV_FP8_MAX_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    cols = g * GROUP_SIZE + tl.arange(0, GROUP_SIZE)
    ok = (rows[:, None] < R) & (cols[None, :] < I)
    base = h_ptr + rows[:, None].to(tl.int64) * stride_hm + cols[None, :]
    gate = tl.load(base, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(base + I, mask=ok, other=0.0).to(tl.float32)
    h = gate * tl.sigmoid(gate) * up
    scale = tl.maximum(tl.max(tl.abs(h), axis=1), 1e-12) * INV_FP8_MAX_C
    q = tl.minimum(tl.maximum(tl.math.div_rn(h, scale[:, None]), -FP8_MAX_C), FP8_MAX_C)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + rows.to(tl.int64) * stride_sm + g * stride_sg, scale, mask=rows < R)


def silu_mul_quant(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, 2I) [gate | up] -> SiLU(gate) * up quantized per row per 128 columns: fp8 (R, I), fp32 (R, I/128)."""
    rows, two_inter = gate_up.shape
    inter = two_inter // 2
    assert gate_up.stride(1) == 1
    q = torch.empty(rows, inter, dtype=FP8_DTYPE, device=gate_up.device)
    s = torch.empty(rows, triton.cdiv(inter, GROUP), dtype=torch.float32, device=gate_up.device)
    if rows:
        block_m = 16
        _silu_mul_quant_kernel[(triton.cdiv(rows, block_m), s.shape[1])](
            gate_up, q, s, rows, inter, gate_up.stride(0), q.stride(0), s.stride(0), s.stride(1),
            GROUP_SIZE=GROUP, BLOCK_M=block_m, FP8_MAX_C=FP8_MAX, INV_FP8_MAX_C=INV_FP8_MAX, num_warps=4)
    return q, s


def gemm_geometry(cfg: dict, n: int, glu: bool, fp8: bool, quant_out: bool) -> dict:
    """The constexprs a GEMM config implies. cfg["BLOCK_N"] counts weight rows per tile, as in vLLM/SGLang
    configs: with GLU a tile yields BLOCK_N / 2 output columns (its gate and up rows interleaved)."""
    out_n = cfg["BLOCK_N"] // 2 if glu else cfg["BLOCK_N"]
    sub_n = 2 if quant_out and out_n == GROUP // 2 else 1
    if quant_out:
        assert (out_n * sub_n) % GROUP == 0 and n % GROUP == 0, \
            "fused activation quantization needs 64 or a multiple of 128 output columns per tile"
    # Weight-scale blocks a tile's rows span (tiles start at multiples of out_n): 1 or 2 let each K step apply
    # them as per-row vectors; otherwise they are loaded per weight row (WS_MODE 0).
    ws_mode = 0
    if fp8 and glu:
        ws_mode = 2 if GROUP % out_n == 0 and n % GROUP == 0 else 0
    elif fp8 and GROUP % out_n == 0:
        ws_mode = 1
    elif fp8 and out_n == 2 * GROUP and n % out_n == 0:
        ws_mode = 2
    return dict(OUT_N=out_n, SUB_N=sub_n, WS_MODE=ws_mode)


def gate_up_fuses_quant(cfg: dict, inter: int) -> bool:
    """Whether this gate-up config writes the activation already quantized (fp8, 1x128 scales)."""
    out_n = cfg["BLOCK_N"] // 2
    return inter % GROUP == 0 and (out_n % GROUP == 0 or out_n == GROUP // 2)


def invoke_fused_moe_gemm(a: torch.Tensor, a_scale: Optional[torch.Tensor], w: torch.Tensor,
                          w_scale: Optional[torch.Tensor], out: torch.Tensor, out_scale: Optional[torch.Tensor],
                          topk_weights: Optional[torch.Tensor], aligned: AlignedTokens, a_div: int, glu: bool,
                          block_m: int, cfg: dict, out_by_row: bool = False) -> None:
    """One grouped GEMM over the aligned layout (see `_fused_moe_kernel`); writes `out` (P, N) per pair, or with
    out_by_row (rows, N) per row of the layout."""
    n = w.shape[1] // 2 if glu else w.shape[1]
    k = w.shape[2]
    fp8 = w.dtype == FP8_DTYPE
    quant_out = out.dtype == FP8_DTYPE
    assert a.stride(1) == 1 and w.stride(2) == 1 and out.stride(1) == 1
    assert block_m == aligned.block_m, "the kernel's BLOCK_M must be the one the layout was padded to"
    if fp8:
        assert GROUP % cfg["BLOCK_K"] == 0, "a K tile must stay inside one scale group"
    geo = gemm_geometry(cfg, n, glu, fp8, quant_out)
    num_blocks_m = aligned.expert_ids.numel()
    dummy = out  # stands in for absent optional pointers (never read: the constexpr flags are off)
    grid = (num_blocks_m * triton.cdiv(n, geo["OUT_N"] * geo["SUB_N"]),)
    _fused_moe_kernel[grid](
        a, a_scale if fp8 else dummy, w, w_scale if fp8 else dummy, out, out_scale if quant_out else dummy,
        topk_weights if topk_weights is not None else dummy,
        aligned.sorted_token_ids, aligned.expert_ids, aligned.num_tokens_post_padded,
        aligned.num_pairs, n, k, num_blocks_m,
        a.stride(0), a_scale.stride(0) if fp8 else 0, a_scale.stride(1) if fp8 else 0,
        w.stride(0), w.stride(1), w_scale.stride(0) if fp8 else 0, w_scale.stride(1) if fp8 else 0,
        w_scale.stride(2) if fp8 else 0,
        out.stride(0), out_scale.stride(0) if quant_out else 0, out_scale.stride(1) if quant_out else 0,
        A_DIV=a_div, GLU=glu, MUL_WEIGHT=topk_weights is not None, FP8=fp8, QUANT_OUT=quant_out, OUT_BY_ROW=out_by_row,
        IEEE=a.dtype == torch.float32, FP8_MAX_C=FP8_MAX, INV_FP8_MAX_C=INV_FP8_MAX, GROUP_N=GROUP,
        GROUP_K=GROUP, BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        EVEN_K=k % cfg["BLOCK_K"] == 0, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **geo)


def contiguous_down_gemm(act: torch.Tensor, act_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                         out: torch.Tensor, aligned: AlignedTokens, cfg: dict) -> None:
    """The down GEMM of a `"LAYOUT": "contiguous"` config: act (rows, I) fp8 by layout row -> out (rows, H) by layout
    row, without the routing weights (the combine applies them)."""
    from .triton_grouped_gemm import m_grouped_fp8_gemm_nt_contiguous

    m_grouped_fp8_gemm_nt_contiguous((act, act_scale), (w2, w2_scale), out, row_experts(aligned), aligned.block_m,
                                     _without_layout(cfg))


def _contiguous_experts(a, a_scale, topk_weights, w13, w2, w13_scale, w2_scale, aligned: AlignedTokens,
                        top_k: int, cfg: dict, out_dtype: torch.dtype) -> torch.Tensor:
    """Both GEMMs on DeepGEMM's contiguous layout (a config whose gate_up says "LAYOUT": "contiguous"): the token
    rows gathered into the aligned layout, gate-up into bf16, SiLU-and-mul with the 1x128 quantization, the down
    GEMM, the weighted combine. The gather and the bf16 round trip cost a pass over the activations each, which
    pays where the grouped GEMM is enough faster than the fused gate-up: the Gluon kernel at >= 16k tokens (see
    benchmarks/results/README.md, `moe`)."""
    from .triton_grouped_gemm import m_grouped_fp8_gemm_nt_contiguous

    rows_a, rows_s, m_indices = contiguous_layout(a, a_scale, aligned, top_k, align=aligned.block_m)
    gate_up = torch.empty(rows_a.shape[0], w13.shape[1], dtype=torch.bfloat16, device=a.device)
    m_grouped_fp8_gemm_nt_contiguous((rows_a, rows_s), (w13, w13_scale), gate_up, m_indices, aligned.block_m,
                                     _without_layout(cfg["gate_up"]))
    act, act_scale = silu_mul_quant(gate_up)
    down = torch.empty(rows_a.shape[0], w2.shape[1], dtype=out_dtype, device=a.device)
    contiguous_down_gemm(act, act_scale, w2, w2_scale, down, aligned, cfg["down"])
    return gather_combine(down, inverse_rows(aligned), topk_weights, out_dtype)


def _without_layout(gemm_cfg: dict) -> dict:
    return {key: val for key, val in gemm_cfg.items() if key != "LAYOUT"}


def fused_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, w13_scale: Optional[torch.Tensor], w2_scale: Optional[torch.Tensor],
                  config: Optional[dict] = None, device: Optional[str] = None, absent: bool = False) -> torch.Tensor:
    """sum_k topk_weights[:, k] * expert_{topk_ids[:, k]}(x) as (T, H) in x's dtype (MoEBackend.experts; absent:
    ids may be E, another rank's expert, whose pairs take no row of the layout and add nothing)."""
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    fp8 = w13.dtype == FP8_DTYPE
    if tokens == 0:
        return torch.zeros_like(x)
    if not fp8:
        assert w13.dtype == w2.dtype == x.dtype, "bf16/fp16/fp32 expert weights must match the activation dtype"
    cfg = config or get_config(tokens, num_experts, inter, hidden, top_k, w13.dtype, device)
    block_m = cfg["BLOCK_M"]
    x = x if x.stride(1) == 1 else x.contiguous()
    aligned = align_tokens_layout(topk_ids, num_experts, block_m)
    pairs = aligned.num_pairs

    if fp8:
        a, a_scale = per_token_group_quant(x)  # (T, H) fp8, (T, H/128)
    else:
        a, a_scale = x, None
    if cfg["gate_up"].get("LAYOUT") == "contiguous":
        if not fp8 or cfg["down"].get("LAYOUT") != "contiguous":
            raise ValueError("a contiguous gate-up GEMM takes fp8 expert weights and a contiguous down GEMM")
        return _contiguous_experts(a, a_scale, topk_weights, w13, w2, w13_scale, w2_scale, aligned, top_k, cfg,
                                   x.dtype)
    fuse_quant = fp8 and gate_up_fuses_quant(cfg["gate_up"], inter)
    # The contiguous down GEMM (TMA, triton_grouped_gemm.py) reads the activation by layout row: gate-up writes
    # it so, quantized in its epilogue, and the combine gathers each pair's row.
    contiguous_down = cfg["down"].get("LAYOUT") == "contiguous"
    if contiguous_down and not fuse_quant:
        raise ValueError("a contiguous down GEMM needs fp8 weights and a gate-up tile that fuses the activation's "
                         "quantization (BLOCK_N 128 or 256)")
    act_rows = aligned.sorted_token_ids.numel() if contiguous_down else pairs
    # A tile too narrow to fuse the 1x128 quantization writes the activation in fp32, so that the separate
    # quantizer sees the values the fused epilogue would (a bf16 round trip first moves some fp8 codes).
    act_dtype = FP8_DTYPE if fuse_quant else torch.float32 if fp8 else x.dtype
    act = torch.empty(act_rows, inter, dtype=act_dtype, device=x.device)
    act_scale = (torch.empty(act_rows, triton.cdiv(inter, GROUP), dtype=torch.float32, device=x.device)
                 if fuse_quant else None)
    invoke_fused_moe_gemm(a, a_scale, w13, w13_scale, act, act_scale, None, aligned, top_k, True, block_m,
                          cfg["gate_up"], out_by_row=contiguous_down)
    if contiguous_down:
        # NOTE: padding rows of `act` are never written (they hold whatever memory was there); the grouped GEMM
        # computes over them but never stores them, and the combine reads only pairs' rows.
        down = torch.empty(act_rows, hidden, dtype=x.dtype, device=x.device)
        contiguous_down_gemm(act, act_scale, w2, w2_scale, down, aligned, cfg["down"])
        return gather_combine(down, inverse_rows(aligned), topk_weights, x.dtype)
    if fp8 and not fuse_quant:
        act, act_scale = per_token_group_quant(act)

    # An absent expert's pair is never written by the down GEMM: it must read as 0 in the sum.
    per_pair = (torch.zeros if absent else torch.empty)(pairs, hidden, dtype=x.dtype, device=x.device)
    invoke_fused_moe_gemm(act, act_scale, w2, w2_scale, per_pair, None, topk_weights.reshape(-1).contiguous(),
                          aligned, 1, False, block_m, cfg["down"])
    return per_pair.view(tokens, top_k, hidden).sum(dim=1)


@triton.jit
def _gather_combine_kernel(d_ptr, rows_ptr, w_ptr, out_ptr, H, stride_d, stride_o, TOP_K: tl.constexpr,
                           BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(rows_ptr + t * TOP_K + j)
        w = tl.load(w_ptr + t * TOP_K + j).to(tl.float32)
        # -1: a pair of an absent expert (another rank's), which adds nothing (a select, not a product: the row
        # read in its place may hold anything)
        val = tl.load(d_ptr + tl.maximum(row, 0) * stride_d + offs, mask=ok, other=0.0).to(tl.float32)
        acc += tl.where(row >= 0, w * val, 0.0)
    tl.store(out_ptr + t * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def gather_combine(d: torch.Tensor, row_of_pair: torch.Tensor, topk_weights: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * d[row_of_pair[t * top_k + j]]  -> (T, H); a row of -1 adds nothing."""
    tokens, top_k = topk_weights.shape
    hidden = d.shape[1]
    out = torch.empty(tokens, hidden, dtype=out_dtype, device=d.device)
    if tokens:
        block_h = 1024
        _gather_combine_kernel[(tokens, triton.cdiv(hidden, block_h))](
            d, row_of_pair, topk_weights.contiguous(), out, hidden, d.stride(0), out.stride(0), TOP_K=top_k,
            BLOCK_H=block_h, num_warps=4)
    return out
