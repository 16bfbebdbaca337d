"""Speculative decoding through the real stack: router + prefill worker + decode worker processes, KV (the MTP layer's
included) and the last hidden state shipped over TCP, both tiers started with the speculation flags (`pdserve up`
passes them to both: the prefill worker computes the MTP layer's KV only then). A decode worker that speculates
behind a prefill worker that does not gets FAILED_PRECONDITION naming the flag.

Greedy outputs must equal the single-process engine's without speculation, token for token; the decode worker's
pdserve_spec_* metrics must show drafts being accepted, and its pool must return to idle.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine import EngineConfig, LLMEngine
from pdserve.kv_cache import CacheConfig
from pdserve.sampling import SamplingParams

from stack import generate, scrape, start_stack, wait_idle
from test_spec_decode import PROMPTS, make_mtp_friendly_model

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_new_tokens=14, ignore_eos=True)


@pytest.fixture(scope="module", params=["mtp-friendly", "trained"])
def friendly_dir(request, tiny_v3_dir, trained_model_dir, tmp_path_factory):
    """The random tiny model with an MTP layer that copies the target's head, and the committed trained model."""
    if request.param == "trained":
        return trained_model_dir
    return make_mtp_friendly_model(tiny_v3_dir, tmp_path_factory.mktemp("pd-friendly") / "model")


@pytest.fixture(scope="module")
def spec_stack(friendly_dir, tmp_path_factory):
    # Both tiers get the speculation flags, as `pdserve up` passes them: the prefill worker then computes the MTP
    # layer's KV.
    stack = start_stack(friendly_dir, tmp_path_factory.mktemp("logs-spec"),
                        engine_args=["--dtype", "float32", "--speculative-algorithm", "NEXTN",
                                     "--speculative-num-steps", "3"])
    yield stack
    stack.stop()


def metric(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                return s.value
    raise AssertionError(f"{name} not exported")


def test_pd_speculative_greedy_equals_single_process(friendly_dir, spec_stack):
    engine = LLMEngine(EngineConfig(str(friendly_dir), dtype="float32", cache=CacheConfig(page_size=4, num_pages=512)))
    want = [o.output_ids for o in engine.generate(PROMPTS, GREEDY)]
    address = spec_stack.router.address
    for prompt, ids in zip(PROMPTS, want):
        got = generate(address, prompt, GREEDY)
        assert got.output_ids == ids
        assert got.streamed_ids == got.output_ids and got.finish_reason == "length"
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # batched on the decode worker
        got = list(pool.map(lambda p: generate(address, p, GREEDY).output_ids, PROMPTS))
    assert got == want

    text = scrape(spec_stack.decode[0])
    rows = metric(text, "pdserve_spec_accept_length_count")
    mean = metric(text, "pdserve_spec_accept_length_sum") / rows
    print(f"decode worker: {rows:.0f} speculative rows, mean accept length {mean:.2f}")
    assert rows > 0 and mean > 1.3  # the first round drafted from the shipped hidden state, and drafts hit
    assert metric(text, "pdserve_spec_verify_seconds_count") > 0 and metric(text, "pdserve_spec_draft_seconds_count") > 0
    load = wait_idle(spec_stack.decode[0])
    assert load.num_free_pages == load.num_total_pages


def test_pd_speculative_seeded_sampling_reproduces(spec_stack):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=40, seed=11, ignore_eos=True)
    a = generate(spec_stack.router.address, PROMPTS[0], params).output_ids
    b = generate(spec_stack.router.address, PROMPTS[0], params).output_ids
    assert a == b and len(a) == 10
    load = wait_idle(spec_stack.decode[0])
    assert load.num_free_pages == load.num_total_pages


def test_a_speculating_decode_behind_a_plain_prefill_fails_naming_the_flag(tiny_v3_dir, tmp_path):
    import grpc

    stack = start_stack(tiny_v3_dir, tmp_path, decode_args=["--speculative-algorithm", "NEXTN"])
    try:
        with pytest.raises(grpc.RpcError) as err:
            generate(stack.router.address, [5, 6, 7, 8], GREEDY)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--speculative-algorithm" in err.value.details()
    finally:
        stack.stop()
