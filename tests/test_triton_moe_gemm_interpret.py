"""The Triton FP8 GEMM / MoE kernels against their torch references on the CPU, through Triton's interpreter.

Tiny shapes (the interpreter runs every program in numpy); the same comparisons at DeepSeek-V3 shapes are in
test_gpu_moe_gemm.py. The DeepGEMM backend runs here with `TorchDeepGemmOps` (the DeepGEMM contract in torch),
which tests the layouts it builds with the same align helper the Triton kernels consume.
"""

from __future__ import annotations

import pytest
import torch

from interpreter_mode import enter_interpreter

rerun = enter_interpreter(__file__, "tests/test_gpu_moe_gemm.py")
if rerun is not None:
    test_interpreted_in_a_fresh_process = rerun

import torch.nn.functional as F  # noqa: E402

from pdserve.kernels import (deep_gemm_moe, deep_gemm_ops, moe_align, triton_fp8, triton_gemm,  # noqa: E402
                             triton_moe, triton_moe_kernels)
from pdserve.kernels.gemm import FP8_DTYPE, block_dequant, block_quant, per_token_group_quant  # noqa: E402
from pdserve.kernels.moe import RoutingConfig, TorchMoE, select_experts  # noqa: E402
from moe_checks import check_aligned_layout, moe_reference, rel_err  # noqa: E402
from triton_interpreter import exact_interpreter  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreter_only(request):
    if rerun is not None and request.node.name != "test_interpreted_in_a_fresh_process":
        pytest.skip("triton was imported compiled before this module; test_interpreted_in_a_fresh_process reruns it")


@pytest.fixture(autouse=True, scope="module")
def _exact_arithmetic():
    with exact_interpreter():
        yield


def test_backends_registered():
    from pdserve.kernels import GEMM_BACKENDS, MOE_BACKENDS

    assert "triton" in GEMM_BACKENDS and "triton" in MOE_BACKENDS
    assert ("scaled_mm" in GEMM_BACKENDS) == triton_gemm.scaled_mm_blockwise_available()
    # Registered wherever the package is installed; whether it runs is asked when a backend is resolved.
    assert ("deep_gemm" in MOE_BACKENDS) == ("deep_gemm" in GEMM_BACKENDS) == deep_gemm_ops.installed()


# ---- per-token-group quantization and the dense block-FP8 GEMM ------------------------------------------------

@pytest.mark.parametrize("m,k", [(1, 128), (7, 384), (33, 640), (5, 200)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_group_quant_matches_reference_bit_for_bit(m, k, dtype):
    gen = torch.Generator().manual_seed(m * k)
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    x[0, :130] = 0  # an all-zero group
    x[-1, -3:] = 1e-4  # tiny values: fp8 subnormals after scaling
    q, s = triton_fp8.per_token_group_quant(x)
    ref_q, ref_s = per_token_group_quant(x)
    assert torch.equal(s, ref_s)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))

    # cuBLAS layout: M-major scales, rows padded to a multiple of 4 with zeros.
    q4, s4 = triton_fp8.per_token_group_quant(x, column_major_scales=True, pad_rows_to=4)
    m4 = -(-m // 4) * 4
    assert q4.shape == (m4, k) and s4.shape == (m4, ref_s.shape[1]) and s4.stride() == (1, m4)
    assert torch.equal(q4[:m].view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s4[:m], ref_s)
    assert not q4[m:].float().any()


@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("k", [128, 384, 640, 200])  # K/128 = 1, 3, 5 (not a multiple of 4), and a ragged K
@pytest.mark.parametrize("n", [96, 200, 256])
def test_block_fp8_matmul_matches_dequantized_reference(m, k, n):
    gen = torch.Generator().manual_seed(m + 7 * k + 13 * n)
    wq, ws = block_quant(torch.randn(n, k, generator=gen) * 0.05)
    xq, xs = per_token_group_quant(torch.randn(m, k, generator=gen))
    # Reference from the SAME quantized activations: only fp32 accumulation order differs.
    ref = block_dequant(xq, xs, (1, 128), torch.float64) @ block_dequant(wq, ws, (128, 128), torch.float64).T
    out = triton_fp8.block_fp8_matmul(xq, xs, wq, ws, torch.float32)
    assert rel_err(out, ref) < 1e-5
    out_bf16 = triton_fp8.block_fp8_matmul(xq, xs, wq, ws, torch.bfloat16)
    assert out_bf16.dtype == torch.bfloat16 and rel_err(out_bf16, ref) < 8e-3


@pytest.mark.parametrize("split_k", [1, 2, 3, 4])  # 5 K tiles: uneven splits, and a split with no tile at 4
def test_block_fp8_matmul_split_k(split_k):
    gen = torch.Generator().manual_seed(split_k)
    wq, ws = block_quant(torch.randn(200, 640, generator=gen))
    xq, xs = per_token_group_quant(torch.randn(3, 640, generator=gen))
    ref = block_dequant(xq, xs, (1, 128), torch.float64) @ block_dequant(wq, ws, (128, 128), torch.float64).T
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=2, SPLIT_K=split_k)
    assert rel_err(triton_fp8.block_fp8_matmul(xq, xs, wq, ws, torch.float32, cfg), ref) < 1e-5


def test_dense_config_splits_k_only_for_small_m():
    assert triton_fp8.dense_config(1, 1536, 7168)["SPLIT_K"] > 1  # q_a_proj at decode: 24 tiles without it
    assert triton_fp8.dense_config(4096, 7168, 16384)["SPLIT_K"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_gemm_linear(dtype):
    gemm = triton_gemm.TritonGemm()
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(200, 640, generator=gen) * 0.05
    wq, ws = block_quant(w)
    x = torch.randn(2, 3, 640, generator=gen).to(dtype)
    y = gemm.linear(x, wq, ws, (128, 128))
    assert y.shape == (2, 3, 200) and y.dtype == dtype
    xq, xs = per_token_group_quant(x.reshape(6, 640))
    ref = block_dequant(xq, xs, (1, 128), torch.float64) @ block_dequant(wq, ws, (128, 128), torch.float64).T
    assert rel_err(y.reshape(6, 200), ref) < (1e-5 if dtype == torch.float32 else 8e-3)
    # Plain weights go to torch unchanged.
    wd = w.to(dtype)
    assert torch.equal(gemm.linear(x, wd, None, None), F.linear(x, wd))


@pytest.mark.skipif(not triton_gemm.scaled_mm_blockwise_available(), reason="this torch has no blockwise scaled_mm")
def test_scaled_mm_backend_leaves_decode_rows_to_the_triton_kernel(monkeypatch):
    """Up to TRITON_MAX_ROWS rows the scaled_mm backend runs the Triton kernel (decode's batches, where its
    small-M tiles are faster under CUDA graphs); from one row more, cuBLAS (here a stand-in that records the call)."""
    gemm = triton_gemm.ScaledMMGemm()
    calls = []
    monkeypatch.setattr(gemm, "_scaled_mm", lambda x2, *a: calls.append(x2.shape[0]) or None)  # None: Triton after
    gen = torch.Generator().manual_seed(4)
    wq, ws = block_quant(torch.randn(256, 512, generator=gen) * 0.05)
    for m in (1, triton_gemm.TRITON_MAX_ROWS, triton_gemm.TRITON_MAX_ROWS + 1):
        x = torch.randn(m, 512, generator=gen).to(torch.bfloat16)
        y = gemm.linear(x, wq, ws, (128, 128))
        ref = block_dequant(*per_token_group_quant(x), (1, 128), torch.float64) @ \
            block_dequant(wq, ws, (128, 128), torch.float64).T
        assert rel_err(y, ref) < 8e-3
    assert calls == [triton_gemm.TRITON_MAX_ROWS + 1]


def testscaled_mm_weight_scale_layout():
    scale = torch.rand(3, 5)  # N/128 = 3, K/128 = 5: not a multiple of 4
    sb = triton_gemm.scaled_mm_weight_scale(scale)
    assert sb.shape == (5, 3) and sb.stride() == (1, 8) and torch.equal(sb, scale.t())
    even = torch.rand(3, 8)
    assert triton_gemm.scaled_mm_weight_scale(even).data_ptr() == even.data_ptr()


# ---- routing -----------------------------------------------------------------------------------------------

ROUTINGS = [
    (RoutingConfig(8, "sigmoid", "noaux_tc", 8, 4, True, 2.5), 256),  # DeepSeek-V3
    (RoutingConfig(2, "sigmoid", "noaux_tc", 4, 2, True, 1.5), 8),
    (RoutingConfig(6, "softmax", "greedy", 1, 1, False, 1.0), 64),  # V2-Lite
    (RoutingConfig(3, "softmax", "group_limited_greedy", 4, 2, True, 1.0), 40),  # 10 experts per group
]


@pytest.mark.parametrize("cfg,num_experts", ROUTINGS, ids=lambda v: getattr(v, "topk_method", str(v)))
def test_fused_routing_matches_select_experts(cfg, num_experts):
    gen = torch.Generator().manual_seed(num_experts)
    logits = torch.randn(9, num_experts, generator=gen) * 2
    bias = torch.randn(num_experts, generator=gen) * 0.1 if cfg.scoring_func == "sigmoid" else None
    weights, ids = triton_moe.TritonMoE().select_experts(logits, bias, cfg)
    ref_w, ref_ids = select_experts(logits, bias, cfg)
    assert ids.dtype == ref_ids.dtype and weights.dtype == ref_w.dtype
    ids_sorted, order = ids.sort(dim=1)
    ref_sorted, ref_order = ref_ids.sort(dim=1)
    assert torch.equal(ids_sorted, ref_sorted)
    torch.testing.assert_close(weights.gather(1, order), ref_w.gather(1, ref_order), rtol=1e-6, atol=1e-7)


# ---- token alignment ---------------------------------------------------------------------------------------

def _random_ids(tokens, top_k, num_experts, gen, skew=False):
    if skew:  # every token on the same few experts: one long segment
        return torch.arange(top_k).repeat(tokens, 1)
    rows = [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)]
    return torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.long)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("tokens,top_k,num_experts,block_m,skew", [
    (1, 2, 8, 16, False), (5, 3, 8, 16, False), (17, 3, 8, 4, False), (17, 3, 8, 1, False),
    (33, 8, 64, 16, False), (40, 2, 8, 16, True), (3, 8, 256, 128, False), (0, 2, 8, 16, False),
])
def test_align_tokens_layout(impl, tokens, top_k, num_experts, block_m, skew):
    gen = torch.Generator().manual_seed(tokens * 31 + block_m)
    ids = _random_ids(tokens, top_k, num_experts, gen, skew)
    align = moe_align.align_tokens_layout if impl == "triton" else moe_align.align_tokens_torch
    a = align(ids, num_experts, block_m)
    check_aligned_layout(a, ids, num_experts, block_m, moe_align.max_aligned_rows(ids.numel(), num_experts, block_m))
    if impl == "triton":  # the same plan as the reference; only the order inside a segment may differ
        ref = moe_align.align_tokens_torch(ids, num_experts, block_m)
        for name in ("expert_ids", "num_tokens_post_padded", "expert_offsets", "expert_counts"):
            assert torch.equal(getattr(a, name), getattr(ref, name)), name
        sorted_ids, expert_ids, used = moe_align.align_tokens(ids, num_experts, block_m)
        assert torch.equal(expert_ids, ref.expert_ids) and torch.equal(used, ref.num_tokens_post_padded)
    inv = moe_align.inverse_rows(a)
    assert torch.equal(a.sorted_token_ids[inv].long(), torch.arange(tokens * top_k))


# ---- fused MoE ---------------------------------------------------------------------------------------------

def _experts(num_experts, hidden, inter, gen):
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    return w13, w2


def fp8_moe_reference(x, topk_weights, topk_ids, w13q, s13, w2q, s2):
    """The fused-MoE FP8 recipe in fp64: x and the SiLU-and-mul activation quantized per token per 128 channels
    exactly as the kernels do, weights dequantized per 128x128 block."""
    return moe_reference(x, topk_weights, topk_ids, w13q, w2q, s13, s2, quantize_activations=True)


@pytest.mark.parametrize("tokens,top_k,dtype,hidden", [
    (1, 2, torch.float32, 128), (5, 3, torch.float32, 128), (17, 3, torch.float32, 128), (17, 2, torch.float32, 200),
    (5, 3, torch.bfloat16, 128), (17, 2, torch.bfloat16, 128),
])
def test_fused_moe_plain_weights_match_torch(tokens, top_k, dtype, hidden):
    gen = torch.Generator().manual_seed(tokens * 10 + top_k)
    num_experts, inter = 8, 128
    w13, w2 = (w.to(dtype) for w in _experts(num_experts, hidden, inter, gen))
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids = _random_ids(tokens, top_k, num_experts, gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    out = triton_moe.TritonMoE().experts(x, weights, ids, w13, w2, None, None, None)
    ref = TorchMoE().experts(x.double(), weights.double(), ids, w13.double(), w2.double(), None, None, None)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 2, 128), (5, 3, 200), (17, 3, 128), (17, 2, 200)])
def test_fused_moe_fp8_matches_quantized_reference(tokens, top_k, hidden):
    gen = torch.Generator().manual_seed(tokens * 10 + top_k + hidden)
    num_experts, inter = 8, 128
    w13, w2 = _experts(num_experts, hidden, inter, gen)
    (w13q, s13), (w2q, s2) = block_quant(w13), block_quant(w2)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = _random_ids(tokens, top_k, num_experts, gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    out = triton_moe.TritonMoE().experts(x, weights, ids, w13q, w2q, s13, s2, (128, 128))
    # Tight against the same quantization recipe; loose against unquantized activations (TorchMoE).
    assert rel_err(out, fp8_moe_reference(x, weights, ids, w13q, s13, w2q, s2)) < 2e-3
    ref = TorchMoE().experts(x.double(), weights.double(), ids, w13q, w2q, s13, s2, (128, 128))
    assert rel_err(out, ref) < 8e-2


# (I, H, BLOCK_M, gate-up BLOCK_N, down BLOCK_N) -> the kernel variant each GEMM takes (gemm_geometry): the
# activation columns per tile and per program, and how the weight scales are applied per K step (WS_MODE).
TILE_VARIANTS = [
    # gate-up 32 columns: quantized by the separate kernel; down: one weight scale per K step
    ((256, 128, 16, 64, 64), dict(OUT_N=32, SUB_N=1, WS_MODE=2), dict(OUT_N=64, SUB_N=1, WS_MODE=1)),
    # gate-up 64-column blocks run twice per program to fuse the 128-column quantization (the 4-warp default)
    ((256, 128, 16, 128, 128), dict(OUT_N=64, SUB_N=2, WS_MODE=2), dict(OUT_N=128, SUB_N=1, WS_MODE=1)),
    # gate-up 128 columns at once; down 256 columns: two weight-scale blocks per K step
    ((128, 256, 32, 256, 256), dict(OUT_N=128, SUB_N=1, WS_MODE=2), dict(OUT_N=256, SUB_N=1, WS_MODE=2)),
    # gate-up 256 columns (two quantization groups per tile, scales per weight row); down: ragged last tile of H=384
    ((256, 384, 16, 512, 256), dict(OUT_N=256, SUB_N=1, WS_MODE=0), dict(OUT_N=256, SUB_N=1, WS_MODE=0)),
    # I = 192: gate and up rows share a scale block (per-row scales), quantized apart; ragged K = 200 and K = 192
    ((192, 200, 16, 128, 128), dict(OUT_N=64, SUB_N=1, WS_MODE=0), dict(OUT_N=128, SUB_N=1, WS_MODE=1)),
]


@pytest.mark.parametrize("shape,gate_up_geo,down_geo", TILE_VARIANTS,
                         ids=["I{}-H{}-M{}-gate_up{}-down{}".format(*v[0]) for v in TILE_VARIANTS])
def test_fused_moe_fp8_tile_variants(shape, gate_up_geo, down_geo):
    """Every way a config can tile the two GEMMs, against the same FP8 recipe in fp64."""
    inter, hidden, block_m, gate_up_n, down_n = shape
    gen = torch.Generator().manual_seed(inter + hidden + gate_up_n)
    w13, w2 = _experts(8, hidden, inter, gen)
    (w13q, s13), (w2q, s2) = block_quant(w13), block_quant(w2)
    x = torch.randn(6, hidden, generator=gen)
    ids = _random_ids(6, 3, 8, gen)
    weights = torch.rand(6, 3, generator=gen)
    cfg = {"BLOCK_M": block_m, "gate_up": dict(BLOCK_N=gate_up_n, BLOCK_K=128, GROUP_M=2, num_warps=4, num_stages=2),
           "down": dict(BLOCK_N=down_n, BLOCK_K=128, GROUP_M=2, num_warps=4, num_stages=2)}
    fused = triton_moe_kernels.gate_up_fuses_quant(cfg["gate_up"], inter)
    assert triton_moe_kernels.gemm_geometry(cfg["gate_up"], inter, True, True, fused) == gate_up_geo
    assert triton_moe_kernels.gemm_geometry(cfg["down"], hidden, False, True, False) == down_geo
    out = triton_moe_kernels.fused_experts(x, weights, ids, w13q, w2q, s13, s2, config=cfg)
    assert rel_err(out, fp8_moe_reference(x, weights, ids, w13q, s13, w2q, s2)) < 2e-3


def test_fused_moe_gemm_refuses_a_layout_padded_for_another_block_m():
    gen = torch.Generator().manual_seed(4)
    w13, _ = _experts(8, 128, 128, gen)
    aligned = moe_align.align_tokens_layout(_random_ids(5, 2, 8, gen), 8, 16)
    gemm = dict(BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=2)
    with pytest.raises(AssertionError, match="BLOCK_M"):
        triton_moe_kernels.invoke_fused_moe_gemm(torch.randn(5, 128), None, w13, None, torch.empty(10, 128), None,
                                                 None, aligned, 2, True, 32, gemm)


def test_fused_moe_gemms_write_every_pair_row():
    """Outputs poisoned with NaN before the run: every (pair, column) is written, padding rows never are."""
    gen = torch.Generator().manual_seed(9)
    w13, w2 = _experts(8, 200, 128, gen)
    x = torch.randn(11, 200, generator=gen)
    ids = _random_ids(11, 3, 8, gen, skew=False)
    aligned = moe_align.align_tokens_layout(ids, 8, 16)
    gemm = dict(BLOCK_N=64, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=2)
    act = torch.full((33, 128), float("nan"))
    triton_moe_kernels.invoke_fused_moe_gemm(x, None, w13, None, act, None, None, aligned, 3, True, 16, gemm)
    out = torch.full((33, 200), float("nan"))
    weights = torch.rand(33, generator=gen)
    triton_moe_kernels.invoke_fused_moe_gemm(act, None, w2, None, out, None, weights, aligned, 1, False, 16, gemm)
    assert not act.isnan().any() and not out.isnan().any()
    pair = 3 * 4 + 1  # token 4, slot 1
    e = int(ids[4, 1])
    gate_up = x[4].double() @ w13[e].double().T
    h = torch.nn.functional.silu(gate_up[:128]) * gate_up[128:]
    torch.testing.assert_close(act[pair].double(), h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[pair].double(), weights[pair].double() * (act[pair].double() @ w2[e].double().T),
                               rtol=1e-5, atol=1e-6)


def test_silu_mul_quant_matches_reference():
    gen = torch.Generator().manual_seed(8)
    gate_up = torch.randn(19, 2 * 256, generator=gen).bfloat16()
    q, s = triton_moe_kernels.silu_mul_quant(gate_up)
    g, u = gate_up.float().chunk(2, dim=1)
    ref_q, ref_s = per_token_group_quant(F.silu(g) * u)
    torch.testing.assert_close(s, ref_s, rtol=1e-6, atol=0)
    assert (q.float() != ref_q.float()).float().mean() < 0.01  # only sigmoid-ulp ties may round differently


def test_moe_config_lookup(tmp_path, monkeypatch):
    from pdserve.kernels import moe_configs

    cfg = moe_configs.get_config(3, 8, 128, 128, 2, FP8_DTYPE, device="no-such-device")
    assert cfg["BLOCK_M"] == 16 and cfg["gate_up"]["BLOCK_K"] == 128
    entry = {"BLOCK_M": 32, "gate_up": dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)}
    entry["down"] = dict(entry["gate_up"])
    import json

    monkeypatch.setattr(moe_configs, "CONFIG_DIR", tmp_path)
    moe_configs.load_configs.cache_clear()
    name = moe_configs.config_file_name(8, 128, 256, "fp8_w8a8", "dev")
    (tmp_path / name).write_text(json.dumps({"1": dict(entry, BLOCK_M=16), "64": entry}))
    try:
        assert moe_configs.get_config(1, 8, 128, 256, 2, FP8_DTYPE, "dev")["BLOCK_M"] == 16
        assert moe_configs.get_config(50, 8, 128, 256, 2, FP8_DTYPE, "dev")["BLOCK_M"] == 32
        (tmp_path / name).write_text(json.dumps({"1": {"BLOCK_M": 16}}))
        moe_configs.load_configs.cache_clear()
        with pytest.raises(ValueError, match="tune_moe"):
            moe_configs.get_config(1, 8, 128, 256, 2, FP8_DTYPE, "dev")
        (tmp_path / name).write_text(json.dumps({"1": dict(entry, down=dict(entry["down"], LAYOUT="masked"))}))
        moe_configs.load_configs.cache_clear()
        with pytest.raises(ValueError, match="LAYOUT"):
            moe_configs.get_config(1, 8, 128, 256, 2, FP8_DTYPE, "dev")
        gluon = dict(LAYOUT="contiguous", KERNEL="gluon", GROUP_M=8, num_warps=8, STAGES=4, UNROLL=2)
        (tmp_path / name).write_text(json.dumps({"1": dict(entry, gate_up=gluon, down=gluon)}))
        moe_configs.load_configs.cache_clear()
        assert moe_configs.get_config(1, 8, 128, 256, 2, FP8_DTYPE, "dev")["gate_up"]["KERNEL"] == "gluon"
        (tmp_path / name).write_text(json.dumps({"1": dict(entry, gate_up=gluon)}))  # down on the fused layout
        moe_configs.load_configs.cache_clear()
        with pytest.raises(ValueError, match="contiguous gate_up needs a contiguous down"):
            moe_configs.get_config(1, 8, 128, 256, 2, FP8_DTYPE, "dev")
        (tmp_path / name).write_text(json.dumps({"1": dict(entry, down=gluon)}))  # fused gate-up, Gluon down
        moe_configs.load_configs.cache_clear()
        assert moe_configs.get_config(1, 8, 128, 256, 2, FP8_DTYPE, "dev")["down"]["KERNEL"] == "gluon"
        bad = {k: v for k, v in gluon.items() if k != "UNROLL"}
        (tmp_path / name).write_text(json.dumps({"1": dict(entry, down=bad)}))
        moe_configs.load_configs.cache_clear()
        with pytest.raises(ValueError, match="UNROLL"):
            moe_configs.get_config(1, 8, 128, 256, 2, FP8_DTYPE, "dev")
    finally:
        moe_configs.load_configs.cache_clear()


# ---- DeepGEMM layouts ----------------------------------------------------------------------------------------

def _fp8_problem(tokens, top_k, num_experts=8, hidden=128, inter=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = _experts(num_experts, hidden, inter, gen)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    ids = _random_ids(tokens, top_k, num_experts, gen)
    return x, torch.rand(tokens, top_k, generator=gen), ids, block_quant(w13), block_quant(w2)


def test_contiguous_layout_follows_deep_gemm_contract():
    x, _, ids, _, _ = _fp8_problem(17, 3)
    xq, xs = per_token_group_quant(x)
    aligned = moe_align.align_tokens_layout(ids, 8, 128)
    a, sa, m_indices = deep_gemm_moe.contiguous_layout(xq, xs, aligned, 3)
    assert a.shape[0] % 128 == 0 and m_indices.dtype == torch.int32
    sid = aligned.sorted_token_ids.long()
    pad = sid == ids.numel()
    assert torch.equal(m_indices == -1, pad), "-1 exactly on padding rows"
    assert (m_indices.view(-1, 128)[~pad.view(-1, 128).all(1)] >= 0).any(1).all()
    assert torch.equal(m_indices[~pad].long(), ids.reshape(-1)[sid[~pad]])
    assert torch.equal(a[~pad].view(torch.uint8), xq[sid[~pad] // 3].view(torch.uint8))
    assert torch.equal(sa[~pad], xs[sid[~pad] // 3])


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("hidden", [384, 208])  # K/128 = 3, and a ragged K (TMA zero-fills past it)
def test_triton_contiguous_grouped_gemm_follows_deep_gemm_contract(block_m, hidden):
    """triton_grouped_gemm's m_grouped_fp8_gemm_nt_contiguous against the contract's torch reference, on the
    layout contiguous_layout builds: rows of every group computed, padding rows (poisoned) left untouched."""
    from pdserve.kernels import triton_grouped_gemm

    x, _, ids, _, _ = _fp8_problem(17, 3, hidden=hidden)
    gen = torch.Generator().manual_seed(hidden + block_m)
    n = 256
    wq, ws = block_quant(torch.randn(8, n, hidden, generator=gen) * hidden ** -0.5)
    xq, xs = per_token_group_quant(x)
    aligned = moe_align.align_tokens_layout(ids, 8, block_m)
    a, sa, m_indices = deep_gemm_moe.contiguous_layout(xq, xs, aligned, 3, align=block_m)
    d = torch.full((a.shape[0], n), float("nan"), dtype=torch.bfloat16)
    triton_grouped_gemm.m_grouped_fp8_gemm_nt_contiguous((a, sa), (wq, ws), d, m_indices, block_m)
    ref = torch.full((a.shape[0], n), float("nan"))
    deep_gemm_moe.contiguous_grouped_reference((a, sa), (wq, ws), ref, m_indices, block_m)
    pad = m_indices < 0
    assert pad.any() and d[pad].isnan().all(), "padding rows untouched"
    assert rel_err(d[~pad], ref[~pad]) < 8e-3  # bf16 output


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # SiLU of the never-written padding rows
@pytest.mark.parametrize("block_m", [64, 128])
def test_fused_moe_with_contiguous_down_gemm(block_m):
    """A config whose down GEMM runs on the contiguous layout (gate-up writes its fp8 activation by layout row, the
    TMA grouped GEMM, then the gathered combine) gives the same FP8 recipe as the fused path."""
    gen = torch.Generator().manual_seed(block_m)
    inter, hidden = 256, 256
    w13, w2 = _experts(8, hidden, inter, gen)
    (w13q, s13), (w2q, s2) = block_quant(w13), block_quant(w2)
    x = torch.randn(9, hidden, generator=gen)
    ids = _random_ids(9, 3, 8, gen)
    weights = torch.rand(9, 3, generator=gen)
    gate_up = dict(BLOCK_N=256, BLOCK_K=128, GROUP_M=2, num_warps=4, num_stages=2)
    cfg = {"BLOCK_M": block_m, "gate_up": gate_up, "down": dict(gate_up, BLOCK_N=128, LAYOUT="contiguous")}
    out = triton_moe_kernels.fused_experts(x, weights, ids, w13q, w2q, s13, s2, config=cfg)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, fp8_moe_reference(x, weights, ids, w13q, s13, w2q, s2)) < 2e-3
    with pytest.raises(ValueError, match="contiguous down GEMM"):  # the activation must come out quantized
        triton_moe_kernels.fused_experts(x, weights, ids, w13q, w2q, s13, s2,
                                         config=dict(cfg, gate_up=dict(gate_up, BLOCK_N=64)))
    # Both GEMMs on the contiguous layout (token rows gathered first, SiLU-and-mul quantized apart): DeepGEMM's
    # recipe, bf16 between the GEMMs, so it matches the deep_gemm backend (torch contract) closely and the fp32
    # recipe within that backend's bound (test_deep_gemm_backend_with_torch_contract_matches_reference).
    both = dict(cfg, gate_up=dict(gate_up, BLOCK_N=128, LAYOUT="contiguous"))
    out = triton_moe_kernels.fused_experts(x, weights, ids, w13q, w2q, s13, s2, config=both)
    deep_gemm_recipe = deep_gemm_moe.DeepGemmMoE(ops=deep_gemm_moe.TorchDeepGemmOps(), masked_max_tokens=0).experts(
        x, weights, ids, w13q, w2q, s13, s2, (128, 128))
    assert rel_err(out, deep_gemm_recipe) < 5e-3
    assert rel_err(out, fp8_moe_reference(x, weights, ids, w13q, s13, w2q, s2)) < 4e-2
    with pytest.raises(ValueError, match="contiguous down GEMM"):
        triton_moe_kernels.fused_experts(x, weights, ids, w13q, w2q, s13, s2,
                                         config=dict(both, down=dict(gate_up, BLOCK_N=128)))


def test_triton_contiguous_grouped_gemm_refuses_bad_layouts():
    from pdserve.kernels import triton_grouped_gemm

    a = torch.zeros(100, 256, dtype=FP8_DTYPE)  # 100 rows: not a multiple of 64
    b = torch.zeros(2, 256, 256, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="contiguous layout"):
        triton_grouped_gemm.m_grouped_fp8_gemm_nt_contiguous((a, torch.ones(100, 2)), (b, torch.ones(2, 2, 2)),
                                                             torch.empty(100, 256), torch.zeros(100).int(), 64)


def test_masked_layout_follows_deep_gemm_contract():
    x, _, ids, _, _ = _fp8_problem(9, 3)
    xq, xs = per_token_group_quant(x)
    aligned = moe_align.align_tokens_layout(ids, 8, 1)
    a, sa, masked_m, row_of_pair = deep_gemm_moe.masked_layout(xq, xs, aligned, 3, 8, 16)
    assert a.shape == (8, 16, 128) and torch.equal(masked_m.long(), torch.bincount(ids.reshape(-1), minlength=8))
    flat_a = a.view(8 * 16, 128).view(torch.uint8)
    for p, e in enumerate(ids.reshape(-1).tolist()):
        row = int(row_of_pair[p])
        assert row // 16 == e and row % 16 < int(masked_m[e]), "a pair sits in its expert's slab, below masked_m"
        assert torch.equal(flat_a[row], xq[p // 3].view(torch.uint8))
        assert torch.equal(sa.view(8 * 16, -1)[row], xs[p // 3])
    assert len(set(row_of_pair.tolist())) == ids.numel()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # SiLU of the never-written padding rows
@pytest.mark.parametrize("tokens,top_k,path", [(1, 2, "masked"), (17, 3, "masked"), (5, 3, "contiguous"),
                                               (17, 2, "contiguous")])
def test_deep_gemm_backend_with_torch_contract_matches_reference(tokens, top_k, path):
    x, weights, ids, (w13q, s13), (w2q, s2) = _fp8_problem(tokens, top_k, seed=tokens + top_k)
    backend = deep_gemm_moe.DeepGemmMoE(ops=deep_gemm_moe.TorchDeepGemmOps(),
                                        masked_max_tokens=128 if path == "masked" else 0)
    out = backend.experts(x, weights, ids, w13q, w2q, s13, s2, (128, 128))
    assert out.dtype == x.dtype and out.shape == x.shape
    # DeepGEMM writes bf16 between the GEMMs (the Triton path keeps fp32 up to the fused quantization): about
    # 1 in 16 activation codes moves by one fp8 step, ~1.5% of the output; a layout error would be ~100%.
    assert rel_err(out, fp8_moe_reference(x, weights, ids, w13q, s13, w2q, s2)) < 4e-2
    triton_out = triton_moe.TritonMoE().experts(x, weights, ids, w13q, w2q, s13, s2, (128, 128))
    assert rel_err(out, triton_out) < 4e-2


# ---- expert parallelism: pairs of another rank's experts (the absent id E) ----------------------------------

@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("block_m", [1, 16])
def test_absent_experts_take_no_rows(impl, block_m):
    """A pair whose id is E holds no row of the aligned layout (its expert computes nothing here) and has row -1."""
    gen = torch.Generator().manual_seed(block_m)
    num_experts = 4  # this rank's; ids 4..7 are the other rank's, all given the absent id 4
    ids = _random_ids(13, 3, 2 * num_experts, gen)
    here = ids < num_experts
    local = torch.where(here, ids, num_experts)
    align = moe_align.align_tokens_layout if impl == "triton" else moe_align.align_tokens_torch
    a = align(local, num_experts, block_m)
    ref = moe_align.align_tokens_torch(ids[here][:, None], num_experts, block_m)  # the local pairs alone
    assert torch.equal(a.expert_counts, ref.expert_counts) and torch.equal(a.num_tokens_post_padded,
                                                                           ref.num_tokens_post_padded)
    inv = moe_align.inverse_rows(a)
    assert torch.equal(inv < 0, ~here.reshape(-1))
    assert torch.equal(a.sorted_token_ids[inv[here.reshape(-1)]].long(), torch.nonzero(here.reshape(-1))[:, 0])


@pytest.mark.parametrize("path", ["torch", "fused", "fp8", "fp8-contiguous-down", "deep_gemm-masked",
                                  "deep_gemm-contiguous"])
def test_absent_experts_add_nothing(path):
    """Another rank's pairs, given weights that are NOT zero, contribute nothing: the backend skips them (it does
    not compute them at weight 0), so the output is the local pairs' alone."""
    gen = torch.Generator().manual_seed(7)
    num_experts, inter, hidden, tokens, top_k = 4, 128, 128, 9, 3
    w13, w2 = _experts(num_experts, hidden, inter, gen)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = _random_ids(tokens, top_k, 2 * num_experts, gen)
    here = ids < num_experts
    local = torch.where(here, ids, num_experts)
    weights = torch.rand(tokens, top_k, generator=gen) + 0.5
    only_here = (weights * here, torch.where(here, ids, 0))  # the same sum through valid ids at weight 0
    if path in ("torch", "fused"):
        backend = TorchMoE() if path == "torch" else triton_moe.TritonMoE()
        out = backend.experts(x, weights, local, w13, w2, None, None, None, absent=True)
        want = moe_reference(x, *only_here, w13, w2)
        assert rel_err(out, want) < 1e-5
        return
    (w13q, s13), (w2q, s2) = block_quant(w13), block_quant(w2)
    if path.startswith("deep_gemm"):
        backend = deep_gemm_moe.DeepGemmMoE(ops=deep_gemm_moe.TorchDeepGemmOps(),
                                            masked_max_tokens=128 if path.endswith("masked") else 0)
        out = backend.experts(x, weights, local, w13q, w2q, s13, s2, (128, 128), absent=True)
        want = backend.experts(x, *only_here, w13q, w2q, s13, s2, (128, 128))
        assert rel_err(out, want) < 1e-6
        return
    cfg = None
    if path == "fp8-contiguous-down":
        gate_up = dict(BLOCK_N=256, BLOCK_K=128, GROUP_M=2, num_warps=4, num_stages=2)
        cfg = {"BLOCK_M": 64, "gate_up": gate_up, "down": dict(gate_up, BLOCK_N=128, LAYOUT="contiguous")}
    out = triton_moe_kernels.fused_experts(x, weights, local, w13q, w2q, s13, s2, config=cfg, absent=True)
    assert rel_err(out, fp8_moe_reference(x, *only_here, w13q, s13, w2q, s2)) < 2e-3
