"""The disaggregated path with the KV rows moving over torch.distributed process groups (`--kv-transport gloo`, the
CPU twin of nccl): router + 2 prefill workers + 1 decode worker as real processes, so the decode worker holds two
process groups at once; one prefill worker streams layer by layer, the other sends after the whole forward
(`--no-kv-layerwise`). Greedy outputs must equal the single-process engine's token for token."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from stack import Stack, generate, start, start_all, wait_idle
from test_faults import kill_prefill_under_load, requests_finished
from golden import GREEDY, PROMPTS, check_against_reference

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gloo_stack(tiny_v3_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs-gloo")
    # Small prefill steps: prompts are chunked, and the last chunk's layers go over the process group.
    common = ["--model", str(tiny_v3_dir), "--page-size", "4", "--num-pages", "512", "--kv-transport", "gloo",
              "--max-num-batched-tokens", "16"]
    prefill_0, prefill_1, decode = start_all([
        ("prefill", [*common, "--worker-id", "prefill-0", "--no-kv-layerwise"], "prefill-0"),
        ("prefill", [*common, "--worker-id", "prefill-1"], "prefill-1"),
        ("decode", [*common, "--worker-id", "decode-0"], "decode-0"),
    ], log_dir)
    router = start("router", ["--model", str(tiny_v3_dir), "--prefill", prefill_0.address, "--prefill",
                              prefill_1.address, "--decode", decode.address, "--balance-threshold", "1"],
                   log_dir, "router")
    stack = Stack([prefill_0, prefill_1], [decode], router)
    yield stack
    stack.stop()


def test_outputs_match_the_single_process_engine(gloo_stack, reference):
    check_against_reference(gloo_stack.router.address, reference)


def test_concurrent_requests_use_both_process_groups_and_pools_return_to_idle(gloo_stack, reference):
    outputs, _ = reference
    jobs = [i % len(PROMPTS) for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: generate(gloo_stack.router.address, PROMPTS[i], GREEDY, timeout=120), jobs))
    assert [r.output_ids for r in results] == [outputs[i].output_ids for i in jobs]
    served = [requests_finished(p) for p in gloo_stack.prefill]
    assert all(n > 0 for n in served), f"both prefill workers (layer-wise and not) must have sent KV: {served}"
    for proc in gloo_stack.prefill + gloo_stack.decode:
        idle = wait_idle(proc)
        assert idle.num_free_pages == idle.num_total_pages, f"{proc.role} {proc.address} holds pages: {idle}"


def test_prefill_killed_mid_transfer(gloo_stack):
    """Last in the module: it kills prefill-0. Its rooms fail on the decode side at once (UNAVAILABLE, not the
    transfer timeout), the decode pool returns to idle, and new requests go through prefill-1's group."""
    prompts = [[10 + (i * 7 + j) % 400 for j in range(120)] for i in range(8)]
    kill_prefill_under_load(gloo_stack, prompts, max_new=8, kill_after=(0.3, 0.8))
