"""Decode-step latency on a DeepSeek-V3 slice (real V3 widths and expert count, a few layers + NextN, FP8 dummy
weights), with and without CUDA graphs, next to the floor: the bytes one step must read (active weights + KV)
divided by the copy bandwidth measured in the same run. Optionally the same config and weights through
transformers' DeepseekV3 at batch 1 (bf16, fewer layers so both fit), for the tokens/s ratio.

    python benchmarks/bench_one_batch.py --out results.json [--layers 4] [--batch 1 8 32 128] [--ctx 1024 4096 8192]

--rank-of N builds rank 0 of a TP-N worker (its shards: heads, each expert's intermediate, or with --ep whole
experts) and runs it alone on this GPU, every collective skipped: the compute one rank of a TP-N step holds, a lower
bound of that step (no all-reduce, no waiting for the other ranks), so that one GPU can tell whether a TP step misses
its share of the single-GPU step in its kernels or in its collectives. --profile prints, per decode batch and
prompt length, the kernels that take the device's time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timing import copy_bandwidth, cuda_time  # noqa: E402
from pdserve.config import ModelConfig  # noqa: E402
from pdserve.cuda_graph import CudaGraphConfig, DecodeGraphRunner  # noqa: E402
from pdserve.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from pdserve.kernels import KernelBackends  # noqa: E402
from pdserve.kv_cache import CacheConfig, LatentKVPool  # noqa: E402
from pdserve.parallel.group import SINGLE, TPGroup  # noqa: E402
from pdserve.weights import load_model  # noqa: E402

V3 = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
          moe_intermediate_size=2048, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
          qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
          num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=1, norm_topk_prob=True,
          routed_scaling_factor=2.5, max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000.0,
          rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
          num_nextn_predict_layers=1, torch_dtype="bfloat16", eos_token_id=1, bos_token_id=0)
# tensors of the routed experts (stacked, one leading row per expert this rank holds), weights and block scales
EXPERT_TENSORS = (".mlp.w13", ".mlp.w2", ".mlp.w13_scale_inv", ".mlp.w2_scale_inv")
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def v3_slice(layers: int, fp8: bool, first_dense: int = 1) -> ModelConfig:
    raw = dict(V3, num_hidden_layers=layers, first_k_dense_replace=first_dense)
    if fp8:
        raw["quantization_config"] = FP8
    return ModelConfig.from_hf_dict(raw, name=f"deepseek-v3-slice-{layers}L")




class SkipCollectives:
    """Stands in for a rank's process group (--rank-of): every collective returns at once with its output as it
    was. The values a rank then computes are not the worker's, only its shapes and work are."""

    class _Done:
        def wait(self) -> bool:
            return True

    def allreduce(self, tensors):
        return self._Done()

    def broadcast(self, x, src):
        return self._Done()


def rank_group(size: int) -> TPGroup:
    """Rank 0 of `size` with no peers (SINGLE at size 1)."""
    return SINGLE if size == 1 else TPGroup(0, size, SkipCollectives())


def kernel_profile(fn, label: str, top: int = 12) -> list[tuple[str, float]]:
    """The device time per call of fn's busiest kernels (ms), printed under `label`."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    us = [(e.key, e.self_device_time_total / 3) for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(t for _, t in us)
    rows = [(key[:100], t / 1e3) for key, t in sorted(us, key=lambda kv: -kv[1])[:top]]
    print(f"[profile] {label}: {total / 1e3:.3f} ms of kernels per call; busiest (ms):", flush=True)
    for key, ms in rows:
        print(f"[profile]     {ms:8.4f}  {key}", flush=True)
    return [("total", total / 1e3)] + rows


def read_floor(model, cfg, batch: int, ctx: int, kv_bytes_per_value: int, dp_size: int = 1) -> dict:
    """Bytes the busiest GPU must read in one decode step of `batch` requests of `ctx` tokens, no speculation, from
    its rank's `model` (bench_v3_8gpu.rank_model, or --rank-of's): every weight it holds once, except the embedding
    (B rows gathered) and the NextN layer; of its routed experts the expected share a batch touches: each token
    routes to k of E experts, so an expert escapes all B tokens with probability (1 - k/E)^B (uniform routing),
    whichever rank holds it; under DP attention (dp_size ranks) the FFN sees every rank's tokens, its attention only
    ceil(B / dp_size) requests."""
    weights = experts = 0.0
    touched = 1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** batch if cfg.n_routed_experts else 0.0
    for name, p in model.named_parameters():
        if name.startswith("mtp.") or name == "embed_tokens.weight":
            continue
        size = p.numel() * p.element_size()
        if name.endswith(EXPERT_TENSORS):
            experts += size * touched  # (size / experts held) x (expected distinct experts held that are touched)
        else:
            weights += size
    requests = -(-batch // dp_size)
    kv = cfg.kv_cache_dim * kv_bytes_per_value * requests * ctx * cfg.num_hidden_layers
    return dict(weights=weights, experts=experts, kv=kv, total=weights + experts + kv)


def decode_batch(pool: LatentKVPool, batch: int, ctx: int, device) -> ForwardBatch:
    pages_per_seq = -(-ctx // pool.page_size)
    table = torch.arange(batch * pages_per_seq, device=device).view(batch, pages_per_seq)
    pos = torch.full((batch,), ctx - 1, dtype=torch.long, device=device)
    slots = table[:, -1] * pool.page_size + (ctx - 1) % pool.page_size
    return ForwardBatch(ForwardMode.DECODE, torch.randint(0, 1000, (batch,), device=device), pos, slots,
                        pool.page_size, page_table=table, seq_lens=torch.full((batch,), ctx, device=device))


def replan_host_us(graphs: DecodeGraphRunner, batch: ForwardBatch) -> float | None:
    """Host microseconds per re-plan of the batch's graph (FlashInfer attention; None for backends that plan
    nothing): part of every graphed step, since a graph cannot plan."""
    g = graphs.graphs[graphs.bucket_for(batch.num_tokens, batch.page_table.shape[1])]
    if g.plan is None or not g.plan.num_plans:
        return None
    table, lens = g.page_table[:, :g.table_width].cpu(), g.seq_lens.cpu()
    start = time.perf_counter()
    for _ in range(20):
        g.plan.replan(table, lens)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 20 * 1e6


def bench_pdserve(args, bw: float) -> list[dict]:
    cfg = v3_slice(args.layers, fp8=True, first_dense=args.first_dense)
    kernels = KernelBackends.create(args.attention_backend, args.moe_backend, args.gemm_backend)
    t0 = time.monotonic()
    model = load_model(None, cfg, torch.bfloat16, kernels, "dummy", "cuda", tp=rank_group(args.rank_of), ep=args.ep)
    shape = f"rank 0 of TP{args.rank_of}{' + EP' if args.ep else ''} alone, collectives skipped" \
        if args.rank_of > 1 else "one GPU"
    print(f"[bench] V3 slice ({args.layers} layers, the first {args.first_dense} dense, + NextN, FP8, {shape}) "
          f"built in {time.monotonic() - t0:.1f}s, {torch.cuda.memory_allocated() / 2**30:.1f} GiB", flush=True)
    rows = []
    max_tokens = max([b * c for b in args.batch for c in args.ctx] + list(args.prefill))
    page = 64
    pool = LatentKVPool(cfg.num_kv_layers, cfg.kv_cache_dim, CacheConfig(page, -(-max_tokens // page) + 8),
                        torch.bfloat16, "cuda")
    for ctx in args.ctx:
        max_pages = -(-ctx // page)
        graphs = None
        if not args.no_graph:
            t0 = time.monotonic()
            graphs = DecodeGraphRunner(model, pool, max_pages, CudaGraphConfig(batch_sizes=tuple(args.batch),
                                                                              max_bs=max(args.batch)))
            capture = time.monotonic() - t0
        for b in args.batch:
            batch = decode_batch(pool, b, ctx, "cuda")
            eager = cuda_time(lambda: model.logits(model(batch, pool.kv)), iters=5 if b * ctx > 2**20 else 10)
            graph = cuda_time(lambda: graphs.run(batch), iters=20) if graphs else None
            replan_us = replan_host_us(graphs, batch) if graphs else None
            # the copy's bytes read + written per second (bench_v3_8gpu.floors' NOTE: why not half of it)
            floor = read_floor(model, cfg, b, ctx, 2)["total"] / bw
            best = graph or eager
            row = dict(batch=b, ctx=ctx, eager_ms=eager * 1e3, graph_ms=graph * 1e3 if graph else None,
                       tok_s=b / best, floor_ms=floor * 1e3, ratio_to_floor=best / floor,
                       graph_speedup=eager / graph if graph else None,
                       capture_s=capture if graphs else None, replan_host_us=replan_us)
            if args.profile:
                row["profile"] = kernel_profile(lambda: model.logits(model(batch, pool.kv)),
                                                f"decode B={b} ctx={ctx} (eager)")
            rows.append(row)
            print(f"[bench] B={b:4d} ctx={ctx:5d}: eager {eager * 1e3:8.3f} ms, graph "
                  f"{(graph or float('nan')) * 1e3:8.3f} ms, floor {floor * 1e3:7.3f} ms "
                  f"({best / floor:.2f}x), {b / best:9.1f} tok/s"
                  + (f"; attention replan {replan_us:.0f} us of host time per step" if replan_us else ""), flush=True)
        graphs = None
        torch.cuda.empty_cache()
    prefill_rows = []
    for n in args.prefill:
        pages = list(range(-(-n // page)))
        if len(pages) > pool.config.num_pages:
            continue
        batch = ForwardBatch(ForwardMode.EXTEND, torch.randint(0, 1000, (n,), device="cuda"),
                             torch.arange(n, device="cuda"), pool.slots_for(pages, 0, n).cuda(), page,
                             qo_indptr=[0, n], prefix_lens=[0], page_tables=[pages])
        t = cuda_time(lambda: model.logits(model(batch, pool.kv)[-1:]), iters=3, warmup=1)
        prefill_rows.append(dict(prompt_tokens=n, ms=t * 1e3, tok_s=n / t))
        if args.profile:
            prefill_rows[-1]["profile"] = kernel_profile(lambda: model.logits(model(batch, pool.kv)[-1:]),
                                                         f"prefill {n} tokens")
        print(f"[bench] prefill {n:6d} tokens: {t * 1e3:9.2f} ms, {n / t:10.0f} tok/s", flush=True)
    rows.append({"prefill": prefill_rows})
    return rows  # the model and pool are freed with this frame


def bench_vs_transformers(args) -> dict:
    """Same config (bf16, 2 layers so both fit) and the same weights: decode tok/s at batch 1, ctx 512."""
    import transformers

    from pdserve.weights import _load_tensors

    layers = 2
    raw = dict(V3, num_hidden_layers=layers)
    hf_cfg = transformers.DeepseekV3Config(**{k: v for k, v in raw.items() if k not in (
        "model_type", "rope_scaling", "rope_theta", "torch_dtype")}, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, **{k: v for k, v in V3["rope_scaling"].items() if k != "type"}})
    with torch.device("cuda"):
        hf = transformers.DeepseekV3ForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    sd = hf.state_dict()
    cfg = v3_slice(layers, fp8=False)
    kernels = KernelBackends.create(args.attention_backend, args.moe_backend, "torch")
    from pdserve.weights import build_model

    ours = build_model(cfg, torch.bfloat16, kernels, "cuda")
    _load_tensors(ours, cfg, iter(sd.items()), set(sd))
    ours.post_load()
    ctx, steps = 512, 32
    ids = torch.randint(0, 1000, (1, ctx), device="cuda")
    with torch.no_grad():
        out = hf(ids, use_cache=True)
        cache = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)

        def hf_step():
            nonlocal cache, tok
            o = hf(tok, past_key_values=cache, use_cache=True)
            cache, tok = o.past_key_values, o.logits[:, -1:].argmax(-1)

        for _ in range(3):
            hf_step()
        torch.cuda.synchronize()
        t0 = time.monotonic()
        for _ in range(steps):
            hf_step()
        torch.cuda.synchronize()
        hf_s = (time.monotonic() - t0) / steps
    page = 64
    pool = LatentKVPool(cfg.num_kv_layers, cfg.kv_cache_dim, CacheConfig(page, 64), torch.bfloat16, "cuda")
    graphs = DecodeGraphRunner(ours, pool, -(-(ctx + steps + 8) // page), CudaGraphConfig(batch_sizes=(1,)))
    batch = decode_batch(pool, 1, ctx, "cuda")
    ours_s = cuda_time(lambda: graphs.run(batch), iters=steps)
    result = dict(layers=layers, ctx=ctx, transformers_ms=hf_s * 1e3, pdserve_ms=ours_s * 1e3,
                  speedup=hf_s / ours_s)
    print(f"[bench] vs transformers (bf16, {layers} layers, B=1, ctx {ctx}): transformers {hf_s * 1e3:.2f} ms/token, "
          f"pdserve {ours_s * 1e3:.3f} ms/token: {hf_s / ours_s:.1f}x", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=4, help="main layers of the V3 slice")
    p.add_argument("--first-dense", type=int, default=1, metavar="N",
                   help="how many of the first layers are dense (V3: 3; with --layers 61 --rank-of 8, one GPU of "
                        "DeepSeek-V3's full geometry at TP8)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    p.add_argument("--ctx", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--prefill", type=int, nargs="*", default=[1024, 4096, 16384], help="prompt lengths to prefill")
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--moe-backend", default="triton")
    p.add_argument("--gemm-backend", default="triton")
    p.add_argument("--no-graph", action="store_true")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--rank-of", type=int, default=1, metavar="N",
                   help="rank 0 of a TP-N worker alone, collectives skipped (see above)")
    p.add_argument("--ep", action="store_true", help="with --rank-of: the MoE split by experts (EP-N)")
    p.add_argument("--profile", action="store_true", help="print each shape's busiest kernels")
    args = p.parse_args()
    if args.ep and args.rank_of == 1:
        p.error("--ep needs --rank-of N (N > 1)")
    if not 0 <= args.first_dense <= args.layers:
        p.error(f"--first-dense {args.first_dense}: between 0 and --layers ({args.layers})")
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"[bench] {torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s (read+write)", flush=True)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw_tb_s=bw / 1e12,
                  date=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv), rank_of=args.rank_of, ep=args.ep,
                  decode=bench_pdserve(args, bw))
    gc.collect()
    torch.cuda.empty_cache()
    if not args.skip_transformers:
        try:
            result["vs_transformers"] = bench_vs_transformers(args)
        except Exception as e:  # report, keep the rest
            result["vs_transformers"] = {"error": f"{type(e).__name__}: {e}"}
            print(f"[bench] transformers comparison failed: {e}", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"[bench] wrote {args.out}")


if __name__ == "__main__":
    main()
