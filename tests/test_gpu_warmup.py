"""Ready means ready, on a GPU: once a worker's warm-up ran, no request compiles a Triton kernel, whatever its length.

Triton compiles a kernel variant per specialization of its integer arguments (== 1, a multiple of 16) and per
constexpr value. A length-dependent one that the warm-up's prompt lengths never hit compiles in a request: on an
H200 the demo model's first 512-token prompt waited 377 ms in the NextN hand-over's one-token forward (the MLA
decode kernel's page-table width was specialized). These tests count the variants compiled (or loaded from the disk
cache, which costs the same order of time) while real-shaped work runs.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)
triton = pytest.importorskip("triton")

from pdserve.kernels.triton_support import triton_compiles  # noqa: E402


def _kernel_counts(seen: list[str]) -> Counter:
    return Counter(entry.split("[", 1)[0] for entry in seen)


def test_the_mla_decode_kernel_compiles_two_variants_for_every_length_and_batch():
    """One variant with one split (stage 1 writes the output), one with several (and one merge kernel): the page
    table's width, the split count and the batch do not add any. A config no other test uses, so that this process
    has compiled none of its variants before."""
    from pdserve.kernels.triton_mla_decode import DecodeConfig, choose_num_splits, mla_decode
    from pdserve.kernels.triton_support import num_sms

    cfg = DecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=3)
    heads, rank, rope, page = 16, 512, 64, 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(600 * page, rank + rope, device="cuda", dtype=torch.bfloat16, generator=gen)
    splits_seen = set()
    with triton_compiles() as seen:
        for batch in (1, 3, 8):
            for pages in (1, 2, 3, 16, 17, 31, 32, 33, 64, 65, 100, 128, 130, 256, 300, 513):
                q_lat = torch.randn(batch, heads, rank, device="cuda", dtype=torch.bfloat16, generator=gen)
                q_pe = torch.randn(batch, heads, rope, device="cuda", dtype=torch.bfloat16, generator=gen)
                table = torch.randint(0, 600, (batch, pages), device="cuda", dtype=torch.int32, generator=gen)
                lens = torch.full((batch,), pages * page - 3, device="cuda", dtype=torch.int64).clamp(min=1)
                mla_decode(q_lat, q_pe, kv, table, lens, page, 0.1, config=cfg)
                splits_seen.add(choose_num_splits(batch, heads, pages, page, cfg.block_h, num_sms(kv.device),
                                                  programs_per_sm=cfg.programs_per_sm,
                                                  min_tokens_per_split=cfg.min_tokens_per_split) > 1)
    torch.cuda.synchronize()
    counts = _kernel_counts(seen)
    assert splits_seen == {False, True}, "the lengths should run both the one-split and the split kernels"
    assert counts["_split_kernel"] <= 2 and counts["_merge_kernel"] <= 1, \
        "length-dependent variants compiled:\n" + "\n".join(seen)


def _prefill_worker_engine(model_dir, speculate: bool):
    """A prefill worker's engine, from `pdserve prefill`'s own parser (prefill_only: no decode graphs)."""
    from pdserve.cli import build_parser
    from pdserve.cli.engine_args import engine_config_from_args
    from pdserve.engine import LLMEngine
    from pdserve.prefill_service.engine import PrefillEngine

    flags = ["prefill", "--model", str(model_dir), "--device", "cuda", "--page-size", "16", "--num-pages", "2048",
             "--max-num-batched-tokens", "2048", "--max-running-requests", "32"]
    if speculate:
        flags += ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3"]
    engine = LLMEngine(engine_config_from_args(build_parser().parse_args(flags), prefill_only=True))
    return engine, PrefillEngine(engine, sender=None)


@pytest.mark.parametrize("speculate", [True, False], ids=["nextn", "plain"])
def test_after_a_prefill_workers_warmup_no_prompt_length_compiles_a_kernel(trained_model_dir, speculate):
    """The demo model's prefill worker, warmed up as `pdserve up` does, then prompts of lengths the warm-up never
    ran (one at a time, several in one step, and prompts that reuse a cached prefix), computed as a real prompt is
    (with NextN: the MTP layer's one-token forward at the last position): no Triton compile."""
    from pdserve.sampling import SamplingParams
    from pdserve.serving.warmup import warm_up_worker

    engine, prefill = _prefill_worker_engine(trained_model_dir, speculate)
    warm_up_worker(engine, "prefill", say=lambda line: None)
    engine.hooks = prefill.compute_only()  # the hand-over's compute, nothing shipped (no decode worker here)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    longest = min(engine.scheduler.config.max_model_len - 2, 4500)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    def run(prompts: list[list[int]]) -> None:
        for ids in prompts:
            engine.add_request(ids, SamplingParams(max_new_tokens=1, ignore_eos=True))
        while engine.has_unfinished:
            engine.step()

    lengths = [n for n in (2, 5, 16, 31, 32, 33, 100, 256, 500, 512, 513, 777, 1000, 1024, 1500, 2047, 2100, 3000,
                           4096, 4500) if n <= longest]
    shared = prompt(600)
    with triton_compiles() as seen:
        for n in lengths:
            run([prompt(n)])
        run([prompt(n) for n in (40, 300, 700)])  # several prompts in one step
        run([shared])
        run([shared + prompt(n) for n in (1, 50, 600)])  # a cached prefix, then 1 / 50 / 600 new tokens
        torch.cuda.synchronize()
    assert engine.kv_pages_in_use_by_requests() == 0
    assert not seen, f"compiled after the warm-up ({len(seen)}):\n" + "\n".join(seen)
