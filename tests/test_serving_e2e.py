"""The disaggregated path with real processes: router + prefill + decode workers on free ports, KV over TCP.

Greedy outputs must equal the single-process engine's token for token.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.sampling import SamplingParams
from pdserve.serving.rpc_convert import sampling_to_proto
from pdserve.v1 import generate_pb2 as gen_pb
from pdserve.v1 import generate_pb2_grpc as gen_grpc

from golden import GREEDY, PROMPTS, check_against_reference
from stack import generate, load, scrape, start, start_all, start_stack, stop_all, wait_idle

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack_1p1d(shared_stack):
    return shared_stack  # (conftest.py: one stack of the defaults for the modules that only send requests)


@pytest.fixture(scope="module")
def stack_2p2d(tiny_v3_dir, tmp_path_factory):
    # max_num_batched_tokens 8: prompts run in several prefill chunks on the prefill tier.
    stack = start_stack(tiny_v3_dir, tmp_path_factory.mktemp("logs-2p2d"), n_prefill=2, n_decode=2,
                        engine_args=["--max-num-batched-tokens", "8"], router_args=["--balance-threshold", "1"])
    yield stack
    stack.stop()


def test_1p1d_matches_single_process_engine(stack_1p1d, reference):
    check_against_reference(stack_1p1d.router.address, reference)


def test_2p2d_matches_and_spreads_load(stack_2p2d, reference):
    check_against_reference(stack_2p2d.router.address, reference)
    # Unrelated prompts are spread over both prefill workers (load balancing with balance threshold 1).
    served = [float(_sample(scrape(p), "pdserve_requests_total", outcome="finished")) for p in stack_2p2d.prefill]
    assert all(n > 0 for n in served), f"prefill requests per worker: {served}"


def test_shared_prefix_goes_to_its_owner(stack_2p2d, reference):
    _, engine = reference
    base = "pdserve splits inference into a prefill tier and a decode tier. " * 3
    first = generate(stack_2p2d.router.address, base + "First question?", GREEDY)
    before = _decisions(stack_2p2d.router)
    second = generate(stack_2p2d.router.address, base + "Second one!", GREEDY)
    after = _decisions(stack_2p2d.router)
    assert first.cached_tokens == 0
    assert second.cached_tokens >= 4 * (len(engine.encode(base)) // 4) - 4, "the prefix was not reused"
    assert after.get("prefix_hit", 0) == before.get("prefix_hit", 0) + 1
    assert second.output_ids == engine.generate([base + "Second one!"], GREEDY)[0].output_ids


def test_32_concurrent_requests_and_pools_return_to_idle(stack_2p2d, reference):
    outputs, _ = reference
    jobs = [(i % len(PROMPTS)) for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda i: generate(stack_2p2d.router.address, PROMPTS[i], GREEDY, timeout=120),
                                jobs))
    assert [r.output_ids for r in results] == [outputs[i].output_ids for i in jobs]
    for proc in stack_2p2d.prefill + stack_2p2d.decode:
        idle = wait_idle(proc)
        assert idle.num_free_pages == idle.num_total_pages, f"{proc.role} {proc.address} holds pages: {idle}"


def test_cancel_mid_stream_frees_pages_on_both_tiers(stack_1p1d):
    import grpc as _grpc

    from pdserve.serving.rpc_convert import sampling_to_proto
    from pdserve.v1 import generate_pb2 as gen_pb
    from pdserve.v1 import generate_pb2_grpc as gen_grpc

    req = gen_pb.GenerateRequest(text=PROMPTS[2], sampling_params=sampling_to_proto(
        SamplingParams(max_new_tokens=400, ignore_eos=True)))
    aborted = float(_sample(scrape(stack_1p1d.decode[0]), "pdserve_requests_total", outcome="aborted"))
    with _grpc.insecure_channel(stack_1p1d.router.address) as ch:
        call = gen_grpc.GenerationStub(ch).Generate(req)
        for n, _ in enumerate(call):
            if n == 3:
                assert load(stack_1p1d.decode[0]).num_free_pages < load(stack_1p1d.decode[0]).num_total_pages
                call.cancel()
                break
    for proc in stack_1p1d.prefill + stack_1p1d.decode:
        idle = wait_idle(proc)
        assert idle.num_free_pages == idle.num_total_pages and idle.num_running_requests == 0, proc.role
    decode_metrics = scrape(stack_1p1d.decode[0])
    assert float(_sample(decode_metrics, "pdserve_requests_total", outcome="aborted")) >= aborted + 1


@pytest.mark.parametrize("decode_model, decode_args, named", [
    ("v3", ["--page-size", "8"], "page_size"),
    ("v2", ["--page-size", "4"], "model_fingerprint"),
])
def test_incompatible_workers_refuse_to_pair(tiny_v3_dir, tiny_v2_dir, tmp_path, decode_model, decode_args, named):
    """Different page sizes or models: a clear FAILED_PRECONDITION naming the difference, promptly, not a hang."""
    other = tiny_v3_dir if decode_model == "v3" else tiny_v2_dir
    prefill, decode = start_all([("prefill", ["--model", str(tiny_v3_dir), "--page-size", "4"], "p"),
                                 ("decode", ["--model", str(other), *decode_args], "d")], tmp_path)
    router = None
    try:
        router = start("router", ["--model", str(tiny_v3_dir), "--prefill", prefill.address, "--decode",
                                  decode.address], tmp_path, "r")
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            generate(router.address, [5, 6, 7], GREEDY, timeout=30)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert named in info.value.details()
        assert time.monotonic() - t0 < 5
        assert wait_idle(decode).num_free_pages == load(decode).num_total_pages
    finally:
        stop_all([p for p in (router, prefill, decode) if p is not None])


def _observations(proc, name: str) -> float:
    """A histogram's observations summed over its series (a labelled histogram has one per transport, those not used
    at 0)."""
    families = {f.name: f for f in text_string_to_metric_families(scrape(proc))}
    return sum(s.value for s in families[name].samples if s.name == name + "_count")


def test_metrics_parse_and_count(stack_1p1d, reference):
    procs = [stack_1p1d.router] + stack_1p1d.prefill + stack_1p1d.decode
    expected = {
        "router": ["pdserve_time_to_first_token_seconds", "pdserve_inter_token_latency_seconds",
                   "pdserve_e2e_request_latency_seconds"],
        "prefill": ["pdserve_time_to_first_token_seconds", "pdserve_kv_transfer_seconds"],
        "decode": ["pdserve_inter_token_latency_seconds", "pdserve_e2e_request_latency_seconds"],
    }
    # (differences: the stack is shared, earlier requests are counted already)
    before = {(proc.role, name): _observations(proc, name) for proc in procs for name in expected[proc.role]}
    sent = float(_sample(scrape(stack_1p1d.prefill[0]), "pdserve_kv_transfer_bytes_total", transport="tcp"))
    generate(stack_1p1d.router.address, PROMPTS[0], GREEDY)
    deadline = time.monotonic() + 5  # (a worker may record its observation just after the reply went out)
    for (role, name), was in before.items():
        proc = next(p for p in procs if p.role == role)
        while _observations(proc, name) <= was:
            assert time.monotonic() < deadline, f"{role}: {name} observed nothing new"
            time.sleep(0.05)
    for proc in procs:
        families = {f.name: f for f in text_string_to_metric_families(scrape(proc))}
        for gauge in ("pdserve_num_running_reqs", "pdserve_kv_pool_usage_ratio"):
            assert gauge in families or proc.role == "router"
    assert float(_sample(scrape(stack_1p1d.prefill[0]), "pdserve_kv_transfer_bytes_total", transport="tcp")) > sent


def _sample(text: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def _decisions(router) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(scrape(router)):
        for s in family.samples:
            if s.name == "pdserve_router_decisions_total":
                out[s.labels["reason"]] = s.value
    return out


def test_stream_interval_sends_the_first_token_then_n_at_a_time(stack_1p1d, reference, tiny_v3_dir, tmp_path):
    """A second router with --stream-interval 5 on the same workers: the same tokens and text as the engine, the
    first token alone, then messages of at least 5 tokens but the last (12 tokens: 1 + 5 + 5 + 1 at least)."""
    outputs, _ = reference
    router = start("router", ["--model", str(tiny_v3_dir), "--prefill", stack_1p1d.prefill[0].address,
                              "--decode", stack_1p1d.decode[0].address, "--stream-interval", "5"], tmp_path, "r5")
    try:
        req = gen_pb.GenerateRequest(text=PROMPTS[0], sampling_params=sampling_to_proto(GREEDY))
        with grpc.insecure_channel(router.address) as ch:
            msgs = list(gen_grpc.GenerationStub(ch).Generate(req, timeout=60))
    finally:
        stop_all([router])
    sizes = [len(m.chunk.token_ids) for m in msgs if m.HasField("chunk")]
    streamed = [t for m in msgs if m.HasField("chunk") for t in m.chunk.token_ids]
    assert streamed == list(msgs[-1].complete.output_ids) == outputs[0].output_ids
    assert "".join(m.chunk.text for m in msgs if m.HasField("chunk")) == outputs[0].new_text
    assert sizes[0] == 1 and all(n >= 5 for n in sizes[1:-1]) and sum(sizes) == 12, sizes
