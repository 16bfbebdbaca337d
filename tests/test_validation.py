"""Bad input at the router: every kind gets the right status naming the field, and none reaches a worker; plus a
property-based fuzz of GenerateRequest messages against the running stack."""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from pdserve.v1 import generate_pb2 as gen_pb
from pdserve.v1 import generate_pb2_grpc as gen_grpc

from stack import router_over, scrape, stop_all, wait_idle

pytestmark = pytest.mark.slow
VOCAB, CONTEXT, LIMIT = 512, 2048, 64  # the tiny model's vocabulary and context; the router's --max-new-tokens-limit
INVALID, EXHAUSTED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.fixture(scope="module")
def stack(shared_stack, tiny_v3_dir, tmp_path_factory):
    """A router with the limit over the session's shared workers (the tests count worker requests as differences)."""
    s = router_over(shared_stack, tiny_v3_dir, tmp_path_factory.mktemp("logs-validation"),
                    ["--max-new-tokens-limit", str(LIMIT)])
    yield s
    stop_all([s.router])


def ids(*tokens):
    return {"tokenized": gen_pb.TokenizedInput(input_ids=list(tokens))}


def sp(**kw):
    return {"sampling_params": gen_pb.SamplingParams(**kw)}


OK_PROMPT = ids(5, 6, 7)
# (kind, GenerateRequest fields, status, text the message must contain). Printed by test_bad_input_table.
BAD_INPUTS = [
    ("no prompt", {}, INVALID, "prompt"),
    ("empty text", {"text": ""}, INVALID, "text"),
    ("empty token ids", ids(), INVALID, "tokenized"),
    ("token id = vocab size", ids(1, VOCAB), INVALID, "input_ids"),
    ("token id = 2**32-1", ids(2**32 - 1), INVALID, "input_ids"),
    ("prompt fills the context", ids(*[5] * CONTEXT), INVALID, "input_ids"),
    ("text longer than the context", {"text": "hello " * 3000}, INVALID, "text"),
    ("prompt + max_new_tokens > context", {**ids(*[5] * (CONTEXT - 8)), **sp(max_new_tokens=20)}, INVALID,
     "max_new_tokens"),
    ("max_new_tokens = 0", {**OK_PROMPT, **sp(max_new_tokens=0)}, INVALID, "max_new_tokens"),
    ("max_new_tokens > --max-new-tokens-limit", {**OK_PROMPT, **sp(max_new_tokens=LIMIT + 1)}, INVALID,
     "max-new-tokens-limit"),
    ("max_new_tokens = 2**32-1", {**OK_PROMPT, **sp(max_new_tokens=2**32 - 1)}, INVALID, "max_new_tokens"),
    ("temperature < 0", {**OK_PROMPT, **sp(temperature=-0.5)}, INVALID, "temperature"),
    ("temperature NaN", {**OK_PROMPT, **sp(temperature=math.nan)}, INVALID, "temperature"),
    ("temperature inf", {**OK_PROMPT, **sp(temperature=math.inf)}, INVALID, "temperature"),
    ("top_p = 0", {**OK_PROMPT, **sp(top_p=0.0)}, INVALID, "top_p"),
    ("top_p > 1", {**OK_PROMPT, **sp(top_p=1.5)}, INVALID, "top_p"),
    ("top_p < 0", {**OK_PROMPT, **sp(top_p=-0.1)}, INVALID, "top_p"),
    ("top_p NaN", {**OK_PROMPT, **sp(top_p=math.nan)}, INVALID, "top_p"),
    ("top_k = -2", {**OK_PROMPT, **sp(top_k=-2)}, INVALID, "top_k"),
    ("stop token id out of vocab", {**OK_PROMPT, **sp(stop_token_ids=[VOCAB])}, INVALID, "stop_token_ids"),
    ("empty stop string", {**OK_PROMPT, **sp(stop=[""])}, INVALID, "stop"),
    ("17 stop strings", {**OK_PROMPT, **sp(stop=[f"s{i}" for i in range(17)])}, INVALID, "stop"),
    ("stop string of 300 chars", {**OK_PROMPT, **sp(stop=["x" * 300])}, INVALID, "stop"),
    ("request_id of 300 chars", {**OK_PROMPT, "request_id": "r" * 300}, INVALID, "request_id"),
    ("request_id with a NUL", {**OK_PROMPT, "request_id": "a\x00b"}, INVALID, "request_id"),
    ("message > 16 MiB", {"text": "a" * (17 << 20)}, EXHAUSTED, ""),
    # Its size is checked before the message is parsed (millions of ids held every client's event loop), and the
    # length of one that passes before anything reads the ids: the answer names its size or its length, not the
    # out-of-vocabulary id at its start.
    ("100k token ids, the first out of vocab", ids(VOCAB, *[5] * 100_000), INVALID,
     "bytes of token ids are more than the model's context"),
    ("3000 token ids, the first out of vocab", ids(VOCAB, *[5] * 3000), INVALID, "the prompt has 3001 tokens"),
]


def call(address: str, request: gen_pb.GenerateRequest, timeout: float = 30.0):
    """(status name, details, output ids or None)."""
    with grpc.insecure_channel(address) as ch:
        try:
            for msg in gen_grpc.GenerationStub(ch).Generate(request, timeout=timeout):
                if msg.HasField("complete"):
                    return "OK", "", list(msg.complete.output_ids)
            return "NO_FINAL_STATUS", "", None
        except grpc.RpcError as e:
            return e.code().name, e.details() or "", None


def worker_requests(stack) -> float:
    """Requests the workers have seen, whatever their outcome (each counts exactly once per worker), once every
    worker is idle: a prefill worker counts a request when its KV transfer is confirmed, which may come after the
    client's last token."""
    for proc in stack.prefill + stack.decode:
        wait_idle(proc)
    total = 0.0
    for proc in stack.prefill + stack.decode:
        for family in text_string_to_metric_families(scrape(proc)):
            total += sum(s.value for s in family.samples if s.name == "pdserve_requests_total")
    return total


def test_bad_input_table(stack):
    before = worker_requests(stack)
    rows = []
    for kind, fields, code, needle in BAD_INPUTS:
        status, details, _ = call(stack.router.address, gen_pb.GenerateRequest(**fields))
        rows.append((kind, status, details[:90]))
        assert status == code.name, f"{kind}: {status} {details}"
        assert needle in details, f"{kind}: the message does not name {needle!r}: {details}"
    print("\n".join(f"| {k} | {s} | {d} |" for k, s, d in rows))
    assert worker_requests(stack) == before, "an invalid request reached a worker"
    # The edges of what is allowed still work: top_k=-1 (off), top_p=1, max_new_tokens at the limit.
    status, details, out = call(stack.router.address, gen_pb.GenerateRequest(
        **OK_PROMPT, **sp(top_k=-1, top_p=1.0, max_new_tokens=LIMIT, ignore_eos=True)))
    assert status == "OK" and len(out) == LIMIT, details
    for proc in stack.prefill + stack.decode:
        idle = wait_idle(proc)
        assert idle.num_free_pages == idle.num_total_pages


def test_duplicate_in_flight_request_id_is_already_exists(stack):
    first = {}
    long = gen_pb.GenerateRequest(**OK_PROMPT, request_id="dup-1", **sp(max_new_tokens=LIMIT, ignore_eos=True))
    with grpc.insecure_channel(stack.router.address) as ch:
        stream = gen_grpc.GenerationStub(ch).Generate(long, timeout=30)
        next(stream)  # the first request is in flight (it has streamed a token)
        status, details, _ = call(stack.router.address, gen_pb.GenerateRequest(**OK_PROMPT, request_id="dup-1"))
        assert status == "ALREADY_EXISTS" and "request_id" in details
        first["rest"] = list(stream)
    assert first["rest"][-1].HasField("complete") and first["rest"][-1].request_id == "dup-1"
    status, _, _ = call(stack.router.address, gen_pb.GenerateRequest(**OK_PROMPT, request_id="dup-1",
                                                                     **sp(max_new_tokens=2)))
    assert status == "OK", "an id is free again once its request finished"


# ---- fuzz ---------------------------------------------------------------------------------------------------------
def mostly(valid, anything):
    """Valid 9 times in 10, so that whole requests are often valid and the worker path is fuzzed too."""
    return st.integers(0, 9).flatmap(lambda i: anything if i == 0 else valid)


any_float = st.floats(allow_nan=True, allow_infinity=True, width=32)
token = mostly(st.integers(10, VOCAB - 1), st.integers(0, 2**32 - 1))
prompt = mostly(st.text(min_size=1, max_size=40) | st.lists(token, min_size=1, max_size=40),
                st.none() | st.just("") | st.lists(token, max_size=3000))
sampling = st.builds(
    lambda n, t, p, k, seed, stop, stop_ids, eos: gen_pb.SamplingParams(
        **{k_: v for k_, v in (("max_new_tokens", n), ("temperature", t), ("top_p", p), ("top_k", k),
                               ("seed", seed)) if v is not None}, stop=stop, stop_token_ids=stop_ids, ignore_eos=eos),
    mostly(st.none() | st.integers(1, 12), st.integers(0, 2**32 - 1)),
    mostly(st.none() | st.floats(0, 2, width=32), any_float),
    mostly(st.none() | st.floats(0.25, 1, width=32), any_float),
    mostly(st.none() | st.integers(-1, 50), st.integers(-2**31, 2**31 - 1)),
    st.none() | st.integers(0, 2**64 - 1),
    mostly(st.lists(st.text(min_size=1, max_size=20), max_size=3), st.lists(st.text(max_size=300), max_size=20)),
    st.lists(token, max_size=3), st.booleans())
requests = st.builds(lambda rid, p, s: _request(rid, p, s),
                     mostly(st.just("") | st.text(st.characters(codec="ascii", categories=["L", "N"]), max_size=40),
                            st.text(max_size=300)), prompt, sampling)


def _request(rid, p, s) -> gen_pb.GenerateRequest:
    req = gen_pb.GenerateRequest(request_id=rid, sampling_params=s)
    if isinstance(p, str):
        req.text = p
    elif isinstance(p, list):
        req.tokenized.input_ids.extend(p)
    return req


def test_fuzzed_requests_end_with_tokens_or_a_clear_status(stack):
    outcomes: list[str] = []
    before = worker_requests(stack)

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(requests)
    def check(req):
        status, details, out = call(stack.router.address, req)
        assert status not in ("INTERNAL", "UNKNOWN", "NO_FINAL_STATUS"), f"{status}: {details} for {req}"
        assert status != "OK" or out, "a request that succeeded produced no tokens"
        outcomes.append(status)

    check()
    print({status: outcomes.count(status) for status in sorted(set(outcomes))})
    assert "OK" in outcomes and "INVALID_ARGUMENT" in outcomes, outcomes
    assert all(p.popen.poll() is None for p in stack.all()), "a process died during the fuzz"
    # Every request a worker saw succeeded: the router refused all the others itself.
    assert worker_requests(stack) - before == 2 * outcomes.count("OK")
    for proc in stack.prefill + stack.decode:
        idle = wait_idle(proc)
        assert idle.num_free_pages == idle.num_total_pages, f"{proc.role} holds pages after the fuzz: {idle}"


def test_no_pickle_in_pdserve():
    """Nothing deserializes untrusted bytes with pickle (torch.load included: its default unpickles)."""
    import pathlib

    repo = pathlib.Path(__file__).resolve().parents[1]
    dirs = ["pdserve", "kernels", "router", "prefill_service", "decode_service", "kv_transfer"]
    # A tensor-parallel worker's rank 0 pickles each step's call to its own child ranks through a socket pair the
    # child inherits (multiprocessing's Pipe, its fd passed at spawn): no other process can reach it. Those two
    # files may pickle only over that pipe, never a socket anyone can connect to.
    rank_pipe = {"pdserve/parallel/ranks.py", "pdserve/parallel/worker.py"}
    for name in rank_pipe:
        text = (repo / name).read_text()
        assert not any(net in text for net in ("Listener(", "Client(", "socket.socket(", "create_connection")), name
    assert "connection.Pipe()" in (repo / "pdserve/parallel/ranks.py").read_text()
    offenders = [str(p.relative_to(repo)) for d in dirs for p in (repo / d).rglob("*.py")
                 if str(p.relative_to(repo)) not in rank_pipe
                 and any(bad in p.read_text() for bad in ("import pickle", "pickle.loads", "torch.load(",
                                                          "import dill", "cloudpickle"))]
    assert offenders == []

