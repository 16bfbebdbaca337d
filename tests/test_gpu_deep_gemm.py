"""DeepGEMM (the installed build, deep_gemm_ops.py) against the torch contract on a GPU, with RANDOM scales: unit
or near-uniform scales would hide a transposed or misaligned scale layout.

1. each op alone (dense `fp8_gemm_nt`, contiguous and masked grouped GEMMs) on fp8 operands and scales drawn at
   random over three orders of magnitude, at DeepSeek-V3 widths, K with (K/128) % 4 != 0, ragged and empty groups;
2. the "deep_gemm" backends (dense linear, MoE) at V3 sizes (E=256, top-8, H=7168, I=2048) against the FP8 recipe
   in torch, both MoE layouts, and a CUDA-graph replay of each.
Skipped where DeepGEMM does not run (the reason is the skip message).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from pdserve.kernels import deep_gemm_ops  # noqa: E402

_WHY_NOT = deep_gemm_ops.unusable_reason()
if _WHY_NOT is not None:
    pytest.skip(f"deep_gemm does not run here: {_WHY_NOT}", allow_module_level=True)

import deep_gemm  # noqa: E402

from moe_checks import moe_reference, rel_err  # noqa: E402
from pdserve.kernels import grouped_contract as contract  # noqa: E402
from pdserve.kernels.deep_gemm_dense import DeepGemmGemm  # noqa: E402
from pdserve.kernels.deep_gemm_moe import DeepGemmMoE  # noqa: E402
from pdserve.kernels.gemm import FP8_DTYPE, block_dequant, per_token_group_quant  # noqa: E402
from pdserve.kernels.moe import RoutingConfig, select_experts  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"
H, I, E, TOP_K = 7168, 2048, 256, 8
V3_ROUTING = RoutingConfig(TOP_K, "sigmoid", "noaux_tc", 8, 4, True, 2.5)
GEMM = deep_gemm_ops.find_op(deep_gemm, "gemm")
CONTIGUOUS = deep_gemm_ops.find_op(deep_gemm, "contiguous")
MASKED = deep_gemm_ops.find_op(deep_gemm, "masked")


def random_fp8(*shape, gen):
    """Random fp8 codes over most of e4m3's range (values, not a quantization of anything)."""
    return (torch.randn(*shape, device=DEV, generator=gen) * 64).clamp(-448, 448).to(FP8_DTYPE)


def random_scales(*shape, gen):
    """fp32 scales log-uniform over [1e-3, 1]: every block weighs differently, so a misread scale shows."""
    return torch.exp(torch.rand(*shape, device=DEV, generator=gen) * -6.9)


def dequant_rows(a, sa):
    return block_dequant(a, sa, (1, 128))


# ---- each op alone -------------------------------------------------------------------------------------------

# V3's dense projections (N, K): q_a 1536x7168, kv_a 576x7168 (N % 128 = 64), q_b 24576x1536, kv_b 32768x512,
# o_proj 7168x16384, dense MLP down 7168x18432, shared-expert gate-up 4096x7168; K = 640 and 1152 have
# (K/128) % 4 != 0 (5 and 9 scale columns), where older torch's blockwise scaled_mm misread scales.
DENSE = {"q_a": (1536, 7168), "kv_a": (576, 7168), "q_b": (24576, 1536), "kv_b": (32768, 512),
         "o_proj": (7168, 16384), "mlp_down": (7168, 18432), "shared_gate_up": (4096, 7168), "k640": (2048, 640),
         "k1152": (1024, 1152), "ragged_n": (1000, 7168)}


@pytest.mark.parametrize("name", list(DENSE))
@pytest.mark.parametrize("m", [1, 7, 128, 4096])
def test_fp8_gemm_nt_random_scales(name, m):
    n, k = DENSE[name]
    gen = torch.Generator(DEV).manual_seed(m * 7 + n)
    a, sa = random_fp8(m, k, gen=gen), random_scales(m, k // 128, gen=gen)
    b, sb = random_fp8(n, k, gen=gen), random_scales(-(-n // 128), k // 128, gen=gen)
    d = torch.full((m, n), float("nan"), device=DEV, dtype=torch.bfloat16)
    GEMM((a, sa), (b, sb), d)
    ref = torch.empty(m, n, device=DEV)
    contract.dense_reference((a, sa), (b, sb), ref)
    err = rel_err(d, ref)
    print(f"fp8_gemm_nt {name} M={m} N={n} K={k}: {err:.2e}")
    assert err < 1e-2


@pytest.mark.parametrize("n,k", [(2 * I, H), (H, I), (256, 640)])
def test_contiguous_grouped_random_scales(n, k):
    """Ragged groups (one empty, one exactly 128 rows, one of 1 row), padding rows, random scales per row/block."""
    gen = torch.Generator(DEV).manual_seed(n + k)
    counts = [300, 0, 1, 128, 77, 0, 513]
    groups, align = len(counts), contract.CONTIGUOUS_ALIGN
    m_indices = torch.cat([torch.tensor([g] * c + [-1] * (-c % align), dtype=torch.int32)
                           for g, c in enumerate(counts)]).to(DEV)
    rows = m_indices.numel()
    a, sa = random_fp8(rows, k, gen=gen), random_scales(rows, k // 128, gen=gen)
    b, sb = random_fp8(groups, n, k, gen=gen), random_scales(groups, n // 128, k // 128, gen=gen)
    d = torch.full((rows, n), float("nan"), device=DEV, dtype=torch.bfloat16)
    CONTIGUOUS((a, sa), (b, sb), d, m_indices)
    ref = torch.zeros(rows, n, device=DEV)
    contract.contiguous_grouped_reference((a, sa), (b, sb), ref, m_indices)
    valid = m_indices >= 0
    err = rel_err(d[valid], ref[valid])
    print(f"contiguous N={n} K={k}: {err:.2e}; padding rows written: {not d[~valid].isnan().all().item()}")
    assert err < 1e-2


@pytest.mark.parametrize("m_max", [128, 256])
@pytest.mark.parametrize("n,k", [(2 * I, H), (H, I)])
def test_masked_grouped_random_scales(m_max, n, k):
    """masked_m from 0 to m_max (empty and full groups), random scales; rows past masked_m are never compared.
    Slabs hold whole 128-row tiles (deep_gemm_moe.MASKED_M_ALIGN: 16-row slabs were overwritten)."""
    gen = torch.Generator(DEV).manual_seed(m_max + n)
    groups = 6
    masked_m = torch.tensor([m_max, 0, 1, m_max // 2 + 3, 5, m_max - 1], dtype=torch.int32, device=DEV)
    a, sa = random_fp8(groups, m_max, k, gen=gen), random_scales(groups, m_max, k // 128, gen=gen)
    b, sb = random_fp8(groups, n, k, gen=gen), random_scales(groups, n // 128, k // 128, gen=gen)
    d = torch.full((groups, m_max, n), float("nan"), device=DEV, dtype=torch.bfloat16)
    expected_m = max(1, int(masked_m.float().mean()))
    MASKED((a, sa), (b, sb), d, masked_m, expected_m)
    ref = torch.zeros(groups, m_max, n, device=DEV)
    contract.masked_grouped_reference((a, sa), (b, sb), ref, masked_m, expected_m)
    rows = torch.arange(m_max, device=DEV)[None, :] < masked_m[:, None]  # (G, m_max)
    err = rel_err(d[rows], ref[rows])
    print(f"masked m_max={m_max} N={n} K={k}: {err:.2e}")
    assert err < 1e-2


# ---- the backends at V3 sizes ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def v3_experts():
    """V3-sized random block-FP8 experts (11 GB of fp8) with random scales."""
    gen = torch.Generator(DEV).manual_seed(3)
    w13 = torch.empty(E, 2 * I, H, dtype=FP8_DTYPE, device=DEV)
    w2 = torch.empty(E, H, I, dtype=FP8_DTYPE, device=DEV)
    for lo in range(0, E, 32):
        w13[lo:lo + 32] = random_fp8(32, 2 * I, H, gen=gen)
        w2[lo:lo + 32] = random_fp8(32, H, I, gen=gen)
    # Scales so that outputs stay O(1): fp8 codes ~64, sums over K terms.
    s13 = random_scales(E, 2 * I // 128, H // 128, gen=gen) * (0.5 / 64 / H ** 0.5)
    s2 = random_scales(E, H // 128, I // 128, gen=gen) * (0.5 / 64 / I ** 0.5) * 10
    return w13, w2, s13, s2


def v3_batch(tokens: int, seed: int):
    gen = torch.Generator(DEV).manual_seed(seed)
    # Activations whose per-(token, 128-channel) magnitudes span 3 orders: random activation scales.
    group_scale = torch.exp(torch.rand(tokens, H // 128, 1, device=DEV, generator=gen) * 6.9 - 3.5)
    x = (torch.randn(tokens, H // 128, 128, device=DEV, generator=gen) * group_scale).reshape(tokens, H)
    logits = torch.randn(tokens, E, device=DEV, generator=gen)
    bias = torch.randn(E, device=DEV, generator=gen) * 0.1
    weights, ids = select_experts(logits, bias, V3_ROUTING)
    return x.to(torch.bfloat16), weights, ids


@pytest.mark.parametrize("tokens,layout", [(1, "masked"), (16, "masked"), (128, "masked"), (16, "contiguous"),
                                           (129, "contiguous"), (4096, "contiguous")])
def test_deep_gemm_moe_backend_v3(v3_experts, tokens, layout):
    w13, w2, s13, s2 = v3_experts
    x, weights, ids = v3_batch(tokens, tokens)
    moe = DeepGemmMoE(masked_max_tokens=128 if layout == "masked" else 0, triton_max_tokens=0)
    out = moe.experts(x, weights, ids, w13, w2, s13, s2, (128, 128))
    ref = moe_reference(x, weights, ids, w13, w2, s13, s2, quantize_activations=True, dtype=torch.float32)
    err = rel_err(out, ref)
    print(f"deep_gemm MoE T={tokens} {layout}: {err:.2e} vs the FP8 recipe "
          f"({int(torch.unique(ids).numel())} of {E} experts hit)")
    # bf16 between the GEMMs (the reference keeps fp32) moves ~1 in 16 activation codes by one fp8 step.
    assert out.dtype == torch.bfloat16 and err < 4e-2


@pytest.mark.parametrize("tokens", [16, 256])
def test_deep_gemm_moe_cuda_graph_replay(v3_experts, tokens):
    """Captured once (masked at 16, contiguous at 256), replayed on new inputs: equal to eager on those inputs."""
    w13, w2, s13, s2 = v3_experts
    moe = DeepGemmMoE(triton_max_tokens=0)
    x, weights, ids = v3_batch(tokens, 1)

    def step():
        return moe.experts(x, weights, ids, w13, w2, s13, s2, (128, 128))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # JIT-compile every kernel before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in range(2, 4):
        x2, w_2, ids2 = v3_batch(tokens, seed)
        x.copy_(x2)
        weights.copy_(w_2)
        ids.copy_(ids2)
        captured.fill_(float("nan"))
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        assert rel_err(captured, eager) < 1e-3, f"replay {seed} differs from eager"


def test_deep_gemm_moe_hands_small_batches_to_triton(v3_experts):
    """The default backend: T <= TRITON_MAX_TOKENS on the Triton fused MoE, exactly its output; above, DeepGEMM."""
    from pdserve.kernels import deep_gemm_moe
    from pdserve.kernels.triton_moe import TritonMoE

    w13, w2, s13, s2 = v3_experts
    moe = DeepGemmMoE()
    assert moe.triton_max_tokens == deep_gemm_moe.TRITON_MAX_TOKENS
    x, weights, ids = v3_batch(8, 5)
    out = moe.experts(x, weights, ids, w13, w2, s13, s2, (128, 128))
    assert torch.equal(out, TritonMoE().experts(x, weights, ids, w13, w2, s13, s2, (128, 128)))


@pytest.mark.parametrize("name", ["q_a", "kv_a", "kv_b", "k640", "ragged_n"])
@pytest.mark.parametrize("m", [1, 16, 4096])
def test_deep_gemm_dense_backend(name, m):
    n, k = DENSE[name]
    gen = torch.Generator(DEV).manual_seed(m + n)
    w, ws = random_fp8(n, k, gen=gen), random_scales(-(-n // 128), k // 128, gen=gen) / 64 / k ** 0.5
    x = torch.randn(m, k, device=DEV, generator=gen).to(torch.bfloat16)
    backend = DeepGemmGemm(min_rows=1)
    assert backend.takes(x, w, (128, 128)) and DeepGemmGemm().takes(x, w, (128, 128)) == (m >= 4096)
    y = backend.linear(x, w, ws, (128, 128))
    xq, xs = per_token_group_quant(x)
    ref = dequant_rows(xq, xs) @ block_dequant(w, ws, (128, 128)).T
    err = rel_err(y, ref)
    print(f"deep_gemm linear {name} M={m}: {err:.2e}")
    assert y.dtype == torch.bfloat16 and y.shape == (m, n) and err < 1e-2


def test_deep_gemm_dense_falls_back_where_it_cannot():
    """K not a multiple of 128: the scaled_mm / Triton path, same numbers as the reference."""
    gen = torch.Generator(DEV).manual_seed(9)
    w, ws = random_fp8(256, 200, gen=gen), random_scales(2, 2, gen=gen) / 64 / 200 ** 0.5
    x = torch.randn(33, 200, device=DEV, generator=gen).to(torch.bfloat16)
    backend = DeepGemmGemm()
    assert not backend.takes(x, w, (128, 128))
    xq, xs = per_token_group_quant(x)
    ref = dequant_rows(xq, xs) @ block_dequant(w, ws, (128, 128)).T
    assert rel_err(backend.linear(x, w, ws, (128, 128)), ref) < 1e-2


def test_deep_gemm_dense_cuda_graph_replay():
    n, k = DENSE["q_a"]
    gen = torch.Generator(DEV).manual_seed(4)
    w, ws = random_fp8(n, k, gen=gen), random_scales(n // 128, k // 128, gen=gen) / 64 / k ** 0.5
    x = torch.randn(16, k, device=DEV, generator=gen).to(torch.bfloat16)
    backend = DeepGemmGemm(min_rows=1)
    backend.linear(x, w, ws, (128, 128))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = backend.linear(x, w, ws, (128, 128))
    x.copy_(torch.randn(16, k, device=DEV, generator=gen))
    graph.replay()
    eager = backend.linear(x, w, ws, (128, 128))
    torch.cuda.synchronize()
    assert rel_err(captured, eager) == 0.0
