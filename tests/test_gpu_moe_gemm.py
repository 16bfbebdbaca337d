"""The Triton FP8 GEMM / MoE kernels (and torch's blockwise scaled_mm) against torch
references at DeepSeek-V3 shapes, on a GPU: H=7168, I=2048, E=256 experts, top-8 grouped routing; the dense
projections q_a_proj 7168->1536, kv_b_proj 512->32768, o_proj 16384->7168, plus K/128 = 5 and a ragged N.
bf16 outputs against fp32/fp64 references computed from the same quantized activations; then a CUDA-graph
capture and replay of routing + fused MoE at T=16. DeepGEMM's backends: test_gpu_deep_gemm.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if not torch.cuda.is_available():
    # NOTE: skip before anything imports triton, so the CPU interpreter tests can still turn the interpreter on.
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from moe_checks import check_aligned_layout, moe_reference, rel_err  # noqa: E402
from pdserve.kernels import GEMM_BACKENDS, MOE_BACKENDS  # noqa: E402
from pdserve.kernels import moe_align, triton_fp8, triton_moe_kernels, triton_routing  # noqa: E402
from pdserve.kernels.gemm import FP8_DTYPE, block_dequant, block_quant, per_token_group_quant  # noqa: E402
from pdserve.kernels.moe import RoutingConfig, select_experts  # noqa: E402
from pdserve.kernels.triton_gemm import TritonGemm, scaled_mm_blockwise_available  # noqa: E402
from pdserve.kernels.triton_moe import TritonMoE  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"
H, I, E, TOP_K = 7168, 2048, 256, 8
V3_ROUTING = RoutingConfig(TOP_K, "sigmoid", "noaux_tc", 8, 4, True, 2.5)
DENSE = {"q_a_proj": (1536, 7168), "kv_b_proj": (32768, 512), "o_proj": (7168, 16384), "k640": (2048, 640),
         "ragged_n": (1000, 7168)}
GEMM_PATHS = ["triton"] + (["scaled_mm"] if scaled_mm_blockwise_available() else [])


@pytest.mark.parametrize("m,k", [(1, 7168), (16, 7168), (33, 640), (4096, 7168), (128, 200)])
def test_per_token_group_quant_bit_exact(m, k):
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16) * 4
    q, s = triton_fp8.per_token_group_quant(x)
    ref_q, ref_s = per_token_group_quant(x)
    assert torch.equal(s, ref_s)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


@pytest.fixture(scope="module")
def dense_weights():
    gen = torch.Generator(DEV).manual_seed(0)
    return {name: block_quant(torch.randn(n, k, device=DEV, generator=gen) * k ** -0.5)
            for name, (n, k) in DENSE.items()}


@pytest.mark.parametrize("path", GEMM_PATHS)
@pytest.mark.parametrize("name", list(DENSE))
@pytest.mark.parametrize("m", [1, 16, 128, 4096])
def test_dense_block_fp8_gemm(dense_weights, path, name, m):
    wq, ws = dense_weights[name]
    x = torch.randn(m, wq.shape[1], device=DEV, dtype=torch.bfloat16)
    y = TritonGemm(use_scaled_mm=path == "scaled_mm").linear(x, wq, ws, (128, 128))
    # The reference takes the SAME quantized activations, in fp32 (TF32 off: torch's default).
    xq, xs = per_token_group_quant(x)
    ref = block_dequant(xq, xs, (1, 128)) @ block_dequant(wq, ws, (128, 128)).T
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    err = rel_err(y, ref)
    mean_err = ((y.float() - ref).abs().mean() / ref.abs().mean()).item()
    print(f"{path} {name} M={m}: max err {err:.2e} of max|ref|, mean err {mean_err:.2e}")
    assert err < 1e-2 and mean_err < 5e-3


@pytest.mark.parametrize("m", [1, 16])
def test_dense_split_k_equals_unsplit(dense_weights, m):
    wq, ws = dense_weights["q_a_proj"]
    xq, xs = triton_fp8.per_token_group_quant(torch.randn(m, wq.shape[1], device=DEV, dtype=torch.bfloat16))
    cfg = triton_fp8.dense_config(m, *wq.shape)
    assert cfg["SPLIT_K"] > 1
    split = triton_fp8.block_fp8_matmul(xq, xs, wq, ws, torch.float32, cfg)
    whole = triton_fp8.block_fp8_matmul(xq, xs, wq, ws, torch.float32, dict(cfg, SPLIT_K=1))
    assert rel_err(split, whole) < 1e-5


# ---- routing and alignment at V3 sizes -----------------------------------------------------------------------

def _selection_ties(logits: torch.Tensor, bias: torch.Tensor, cfg: RoutingConfig, eps: float = 1e-5) -> bool:
    """Whether one token's V3 selection is a tie (in fp64): the last chosen group's score (sum of its top 2) and the
    next group's, or the last chosen expert's and the next one's within the best groups, closer than eps. There fp32
    sums taken in another order may pick either."""
    choice = logits.double().sigmoid() + bias.double()  # (E,)
    grouped = choice.view(cfg.n_group, -1)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1).sort(descending=True)  # (G,)
    if group_scores.values[cfg.topk_group - 1] - group_scores.values[cfg.topk_group] < eps:
        return True
    allowed = grouped[group_scores.indices[:cfg.topk_group]].flatten().sort(descending=True).values
    return bool(allowed[cfg.top_k - 1] - allowed[cfg.top_k] < eps)


@pytest.mark.parametrize("tokens", [1, 16, 128, 4096])
def test_fused_routing_v3(tokens):
    gen = torch.Generator(DEV).manual_seed(tokens)
    logits = torch.randn(tokens, E, device=DEV, generator=gen) * 2
    bias = torch.randn(E, device=DEV, generator=gen) * 0.1
    w, ids = triton_routing.fused_select_experts(logits, bias, V3_ROUTING)
    ref_w, ref_ids = select_experts(logits, bias, V3_ROUTING)
    ids_sorted, order = ids.sort(dim=1)
    ref_sorted, ref_order = ref_ids.sort(dim=1)
    # A token whose selection is a tie may go either way (a random 4096 x 256 draw met one once): only those.
    same = (ids_sorted == ref_sorted).all(dim=1)
    differ = (~same).nonzero().flatten().tolist()
    assert len(differ) <= max(1, tokens // 1000) and all(_selection_ties(logits[t], bias, V3_ROUTING) for t in differ)
    torch.testing.assert_close(w.gather(1, order)[same], ref_w.gather(1, ref_order)[same], rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 16, 4096])
@pytest.mark.parametrize("block_m", [1, 16, 64, 128])
def test_align_tokens_v3(tokens, block_m):
    ids = torch.rand(tokens, E, device=DEV).topk(TOP_K, dim=1).indices
    a = moe_align.align_tokens_layout(ids, E, block_m)
    check_aligned_layout(a, ids, E, block_m, moe_align.max_aligned_rows(ids.numel(), E, block_m))
    ref = moe_align.align_tokens_torch(ids, E, block_m)
    for name in ("expert_ids", "num_tokens_post_padded", "expert_offsets", "expert_counts"):
        assert torch.equal(getattr(a, name), getattr(ref, name)), name


# ---- fused MoE at V3 sizes ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_experts():
    """Random V3-sized expert weights quantized expert by expert (11 GB of fp8; no fp32 copy of the whole)."""
    gen = torch.Generator(DEV).manual_seed(1)
    w13 = torch.empty(E, 2 * I, H, dtype=FP8_DTYPE, device=DEV)
    w2 = torch.empty(E, H, I, dtype=FP8_DTYPE, device=DEV)
    s13 = torch.empty(E, 2 * I // 128, H // 128, device=DEV)
    s2 = torch.empty(E, H // 128, I // 128, device=DEV)
    for e in range(E):
        w13[e], s13[e] = block_quant(torch.randn(2 * I, H, device=DEV, generator=gen) * H ** -0.5)
        w2[e], s2[e] = block_quant(torch.randn(H, I, device=DEV, generator=gen) * I ** -0.5)
    return w13, w2, s13, s2


def v3_routing(tokens: int, seed: int):
    gen = torch.Generator(DEV).manual_seed(seed)
    logits = torch.randn(tokens, E, device=DEV, generator=gen)
    bias = torch.randn(E, device=DEV, generator=gen) * 0.1
    return select_experts(logits, bias, V3_ROUTING)


@pytest.mark.parametrize("tokens", [1, 16, 128, 4096])
def test_fused_moe_fp8_v3(fp8_experts, tokens):
    w13, w2, s13, s2 = fp8_experts
    weights, ids = v3_routing(tokens, tokens)
    x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16)
    out = TritonMoE().experts(x, weights, ids, w13, w2, s13, s2, (128, 128))
    same_recipe = moe_reference(x, weights, ids, w13, w2, s13, s2, quantize_activations=True)
    unquantized = moe_reference(x, weights, ids, w13, w2, s13, s2, quantize_activations=False)
    err, loose = rel_err(out, same_recipe), rel_err(out, unquantized)
    print(f"fp8 MoE T={tokens}: {err:.2e} vs the same FP8 recipe, {loose:.2e} vs unquantized activations")
    assert out.dtype == torch.bfloat16 and err < 1e-2 and loose < 8e-2


@pytest.mark.parametrize("tokens", [1, 128, 4096])
@pytest.mark.parametrize("down", [None, "contiguous"], ids=["fused", "contiguous-down"])
def test_fused_moe_fp8_v3_absent_experts(fp8_experts, tokens, down):
    """Expert parallelism's half: this rank holds experts 0..127, the other rank's pairs come as the absent id 128
    with NON-zero weights, and add nothing (skipped, not computed at weight 0): the local pairs' sum alone."""
    w13, w2, s13, s2 = (w[:E // 2] for w in fp8_experts)
    weights, ids = v3_routing(tokens, tokens + 1)
    here = ids < E // 2
    x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16)
    cfg = None
    if down:
        gate_up = _gemm(128, 8, 4)
        cfg = {"BLOCK_M": 64, "gate_up": gate_up, "down": _gemm(128, 8, 4, "contiguous")}
    out = triton_moe_kernels.fused_experts(x, weights, torch.where(here, ids, E // 2), w13, w2, s13, s2, config=cfg,
                                           absent=True)
    want = moe_reference(x, weights * here, torch.where(here, ids, 0), w13, w2, s13, s2, quantize_activations=True)
    err = rel_err(out, want)
    print(f"fp8 MoE, half the experts here, T={tokens}, {down or 'fused'}: {err:.2e} vs the local pairs' sum")
    assert err < 1e-2


def _gemm(block_n, warps, stages, layout=None):
    cfg = dict(BLOCK_N=block_n, BLOCK_K=128, GROUP_M=16, num_warps=warps, num_stages=stages)
    return dict(cfg, LAYOUT=layout) if layout else cfg


# Every kernel variant the prefill sweep (benchmarks/tune_moe.py --space prefill) can pick, compiled for this GPU:
# gate-up tiles of 128 weight rows (two 64-column blocks per program) or 256 (128 columns at once); down tiles with
# one (128) or two (256) weight scales per K step; BLOCK_M 64 and 128; 64-row gate-up tiles (quantized apart); and
# the down GEMM on the contiguous layout (TMA grouped GEMM, activation written by layout row), at 512 and 4096
# tokens.
@pytest.mark.parametrize("tokens", [512, 4096])
@pytest.mark.parametrize("block_m,gate_up,down", [
    (64, _gemm(128, 4, 3), _gemm(128, 4, 4)),
    (64, _gemm(256, 8, 4), _gemm(256, 8, 3)),
    (128, _gemm(128, 8, 4), _gemm(128, 8, 3)),
    (64, _gemm(64, 4, 3), _gemm(64, 4, 4)),
    (64, _gemm(256, 8, 4), _gemm(128, 4, 4, "contiguous")),
    (128, _gemm(128, 8, 4), _gemm(128, 8, 4, "contiguous")),
], ids=["m64-n128", "m64-n256", "m128-n128", "m64-n64", "m64-n256-contiguous-down", "m128-n128-contiguous-down"])
def test_fused_moe_fp8_v3_tile_variants(fp8_experts, block_m, gate_up, down, tokens):
    w13, w2, s13, s2 = fp8_experts
    weights, ids = v3_routing(tokens, 11)
    x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16)
    cfg = {"BLOCK_M": block_m, "gate_up": gate_up, "down": down}
    out = triton_moe_kernels.fused_experts(x, weights, ids, w13, w2, s13, s2, config=cfg)
    ref = moe_reference(x, weights, ids, w13, w2, s13, s2, quantize_activations=True)
    err = rel_err(out, ref)
    print(f"fp8 MoE T={tokens} {cfg}: {err:.2e} vs the same FP8 recipe")
    assert out.dtype == torch.bfloat16 and err < 1e-2


def _hopper_gluon() -> str | None:
    """Why the Gluon kernel cannot run here, or None."""
    if torch.cuda.get_device_capability()[0] != 9:
        return "the Gluon grouped GEMM uses Hopper's wgmma"
    if importlib.util.find_spec("triton.experimental.gluon") is None:
        return "this Triton has no Gluon"
    return None


def _gluon(block_m, stages, unroll):
    return dict(KERNEL="gluon", GROUP_M=8, num_warps=4 * block_m // 64, STAGES=stages, UNROLL=unroll)


GLUON_ONLY = pytest.mark.skipif(not torch.cuda.is_available() or _hopper_gluon() is not None,
                                reason="needs Hopper and a Triton with Gluon")


@pytest.mark.parametrize("tokens", [512, 4096])
@pytest.mark.parametrize("block_m,cfg", [
    (128, dict(BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=4)),
    (64, dict(BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=4)),
    (64, dict(BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3)),
    pytest.param(128, _gluon(128, 4, 2), marks=GLUON_ONLY), pytest.param(128, _gluon(128, 3, 1), marks=GLUON_ONLY),
    pytest.param(64, _gluon(64, 4, 2), marks=GLUON_ONLY), pytest.param(64, _gluon(64, 5, 1), marks=GLUON_ONLY),
], ids=["triton-m128-w8", "triton-m64-w4", "triton-m64-w8-s3", "gluon-m128-s4-u2", "gluon-m128-s3-u1",
        "gluon-m64-s4-u2", "gluon-m64-s5-u1"])
def test_contiguous_grouped_gemm_v3(fp8_experts, tokens, block_m, cfg):
    """triton_grouped_gemm (TMA loads) and gluon_grouped_gemm (promotion under the next wgmma) against DeepGEMM's
    contract in torch, both V3 GEMMs, padding rows untouched."""
    from pdserve.kernels import grouped_contract, triton_grouped_gemm

    w13, w2, s13, s2 = fp8_experts
    _, ids = v3_routing(tokens, 5)
    xq, xs = triton_fp8.per_token_group_quant(torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16))
    aligned = moe_align.align_tokens_layout(ids, E, block_m)
    a, sa, m_indices = grouped_contract.contiguous_layout(xq, xs, aligned, TOP_K, align=block_m)
    pad = m_indices < 0
    for w, ws in ((w13, s13), (w2, s2)):
        k = w.shape[2]
        lhs = (a, sa) if k == H else triton_fp8.per_token_group_quant(torch.randn(a.shape[0], k, device=DEV))
        d = torch.full((a.shape[0], w.shape[1]), float("nan"), device=DEV, dtype=torch.bfloat16)
        triton_grouped_gemm.m_grouped_fp8_gemm_nt_contiguous(lhs, (w, ws), d, m_indices, block_m, cfg)
        ref = torch.zeros(d.shape, device=DEV)
        grouped_contract.contiguous_grouped_reference(lhs, (w, ws), ref, m_indices, block_m)
        err = rel_err(d[~pad], ref[~pad])
        print(f"contiguous T={tokens} block_m={block_m} {cfg} N={w.shape[1]} K={k}: {err:.2e}")
        assert d[pad].isnan().all() and err < 1e-2


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("tokens", [512, 4096])
@pytest.mark.parametrize("block_m,gemm", [
    (128, dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4)),
    pytest.param(128, _gluon(128, 4, 2), marks=GLUON_ONLY), pytest.param(64, _gluon(64, 4, 2), marks=GLUON_ONLY),
], ids=["triton-m128", "gluon-m128", "gluon-m64"])
def test_fused_moe_fp8_v3_both_gemms_contiguous(fp8_experts, tokens, block_m, gemm):
    """A config with both GEMMs on the contiguous layout runs DeepGEMM's recipe (bf16 between the GEMMs): equal to
    the deep_gemm backend on the contract's torch reference, and near the fp32 recipe."""
    from pdserve.kernels import deep_gemm_moe

    w13, w2, s13, s2 = fp8_experts
    weights, ids = v3_routing(tokens, 12)
    x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16)
    contiguous = dict(gemm, LAYOUT="contiguous")
    cfg = {"BLOCK_M": block_m, "gate_up": contiguous, "down": contiguous}
    out = triton_moe_kernels.fused_experts(x, weights, ids, w13, w2, s13, s2, config=cfg)
    recipe = deep_gemm_moe.DeepGemmMoE(ops=deep_gemm_moe.TorchDeepGemmOps(), masked_max_tokens=0).experts(
        x, weights, ids, w13, w2, s13, s2, (128, 128))
    fp32_recipe = moe_reference(x, weights, ids, w13, w2, s13, s2, quantize_activations=True)
    err, loose = rel_err(out, recipe), rel_err(out, fp32_recipe)
    print(f"both contiguous T={tokens} {cfg}: {err:.2e} vs DeepGEMM's recipe, {loose:.2e} vs the fp32 recipe")
    assert out.dtype == torch.bfloat16 and err < 1e-2 and loose < 4e-2


@GLUON_ONLY
@pytest.mark.parametrize("k", [128, 208, 384, 1040])  # 1, 2 (ragged), 3 and 9 (ragged) K steps
@pytest.mark.parametrize("unroll", [1, 2, 3])
def test_gluon_contiguous_grouped_gemm_ragged(k, unroll):
    """Short and ragged K (TMA zero-fills past K), K steps not a multiple of the unroll, empty groups, padding."""
    from pdserve.kernels import grouped_contract, triton_grouped_gemm

    gen = torch.Generator(DEV).manual_seed(k + unroll)
    groups, n, block_m = 5, 256, 64
    counts = [70, 0, 5, 128, 1]  # rows per group; group 1 has none
    m_indices = torch.cat([torch.tensor([g] * c + [-1] * (-c % block_m), dtype=torch.int32)
                           for g, c in enumerate(counts)]).to(DEV)
    rows = m_indices.numel()
    a, sa = per_token_group_quant(torch.randn(rows, k, device=DEV, generator=gen))
    b = torch.empty(groups, n, k, dtype=FP8_DTYPE, device=DEV)
    sb = torch.empty(groups, n // 128, -(-k // 128), device=DEV)
    for g in range(groups):
        b[g], sb[g] = block_quant(torch.randn(n, k, device=DEV, generator=gen))
    cfg = dict(KERNEL="gluon", GROUP_M=8, num_warps=4, STAGES=3, UNROLL=unroll)
    d = torch.full((rows, n), float("nan"), device=DEV, dtype=torch.bfloat16)
    triton_grouped_gemm.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), d, m_indices, block_m, cfg)
    ref = torch.zeros(d.shape, device=DEV)
    grouped_contract.contiguous_grouped_reference((a, sa), (b, sb), ref, m_indices, block_m)
    pad = m_indices < 0
    err = rel_err(d[~pad], ref[~pad])
    print(f"gluon ragged K={k} unroll={unroll}: {err:.2e}")
    assert d[pad].isnan().all() and err < 1e-2


@pytest.mark.parametrize("tokens", [16, 128])
def test_fused_moe_bf16_v3(tokens):
    gen = torch.Generator(DEV).manual_seed(2)
    w13 = torch.randn(E, 2 * I, H, device=DEV, dtype=torch.bfloat16, generator=gen) * H ** -0.5
    w2 = torch.randn(E, H, I, device=DEV, dtype=torch.bfloat16, generator=gen) * I ** -0.5
    weights, ids = v3_routing(tokens, 100 + tokens)
    x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16, generator=gen)
    out = TritonMoE().experts(x, weights, ids, w13, w2, None, None, None)
    ref = moe_reference(x, weights, ids, w13, w2, dtype=torch.float32)
    err = rel_err(out, ref)
    print(f"bf16 MoE T={tokens}: {err:.2e}")
    assert err < 1e-2


def test_cuda_graph_replay_of_routing_and_fused_moe(fp8_experts):
    """Routing + fused MoE captured once at T=16, replayed on new inputs: equal to eager on those inputs."""
    w13, w2, s13, s2 = fp8_experts
    moe = TritonMoE()
    tokens = 16
    x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16)
    logits = torch.randn(tokens, E, device=DEV)
    bias = torch.randn(E, device=DEV) * 0.1

    def step():
        weights, ids = moe.select_experts(logits, bias, V3_ROUTING)
        return moe.experts(x, weights, ids, w13, w2, s13, s2, (128, 128))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile every kernel before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in range(3):
        gen = torch.Generator(DEV).manual_seed(seed)
        x.copy_(torch.randn(tokens, H, device=DEV, generator=gen))
        logits.copy_(torch.randn(tokens, E, device=DEV, generator=gen) * 2)
        captured.fill_(float("nan"))
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        # Rows land in their expert's segment in atomic order, which may differ between runs; each row is
        # computed on its own, so this is expected to be exact, but only stale inputs (~100%) must fail it.
        assert rel_err(captured, eager) < 1e-3, f"replay {seed} differs from eager"


def test_registry_names():
    assert "triton" in GEMM_BACKENDS and "triton" in MOE_BACKENDS
    assert ("scaled_mm" in GEMM_BACKENDS) == scaled_mm_blockwise_available()
