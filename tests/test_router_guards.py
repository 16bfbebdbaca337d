"""One stack (real processes: router with its HTTP front, a prefill and a decode worker) tried as an attacker would:
a 16 MB text prompt does not hold up other clients, requests with 1-20 ms deadlines leave no reservation behind, bad
input of every kind is a 400 / INVALID_ARGUMENT naming the field and carrying no Python text, a forged KV aux record
fails only its own request, metrics listen on --host only, and a draining idle worker never answers SERVING and
closes its port at once."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.kv_transfer import KVLayout, wire
from pdserve.v1 import generate_pb2 as gen_pb
from pdserve.v1 import generate_pb2_grpc as gen_grpc
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as pb_grpc

from stack import decode_updates, free_port, load, start_stack, wait_idle

pytestmark = pytest.mark.slow
# What a response must never carry: Python's own words for its errors.
PYTHON_TEXT = ("Traceback", "ValueError", "TypeError", "RecursionError", "UnicodeEncodeError", "DecodeError",
               "Error parsing", "Value out of range", "Exception")


@pytest.fixture(scope="module")
def stack(tiny_v3_dir, tmp_path_factory):
    http_port = free_port()
    s = start_stack(tiny_v3_dir, tmp_path_factory.mktemp("logs-guards"), router_args=["--http-port", str(http_port)])
    s.http_port = http_port
    yield s
    s.stop()


def no_python_text(message: str) -> None:
    assert not any(word in message for word in PYTHON_TEXT), message


# ---- 2: one large prompt does not freeze the router ---------------------------------------------------------------
def text_request(address: str, text: str, max_new: int = 4, timeout: float = 60) -> tuple[str, float, str]:
    req = gen_pb.GenerateRequest(text=text, sampling_params=gen_pb.SamplingParams(max_new_tokens=max_new,
                                                                                  ignore_eos=True))
    t0 = time.monotonic()
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 32 << 20)]) as ch:
        try:
            for _ in gen_grpc.GenerationStub(ch).Generate(req, timeout=timeout):
                pass
            return "OK", time.monotonic() - t0, ""
        except grpc.RpcError as e:
            return e.code().name, time.monotonic() - t0, e.details() or ""


def small_latencies(address: str, clients: int = 8, rounds: int = 4) -> list[float]:
    def client(i: int) -> list[float]:
        out = []
        for r in range(rounds):
            status, seconds, details = text_request(address, f"def f{i}_{r}(x): return x + {r}")
            assert status == "OK", details
            out.append(seconds)
        return out

    with ThreadPoolExecutor(clients) as pool:
        return [t for ts in pool.map(client, range(clients)) for t in ts]


def test_a_16mb_text_prompt_is_refused_quickly_and_holds_nobody_up(stack):
    address = stack.router.address
    small_latencies(address, rounds=1)  # warm both workers and the channels
    alone = small_latencies(address)
    big = gen_pb.GenerateRequest(text="x = 1\n" * (16_000_000 // 6)).SerializeToString()  # 16 MB < 16 MiB
    big_results: list[tuple[str, float, str]] = []
    stop = threading.Event()

    def keep_sending_big() -> None:  # one 16 MB prompt after another (each would have frozen the router for ~8 s)
        with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 32 << 20)]) as ch:
            call = ch.unary_stream("/pdserve.v1.Generation/Generate")  # bytes as they are: no client-side encode
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    list(call(big, timeout=60))
                    big_results.append(("OK", time.monotonic() - t0, ""))
                except grpc.RpcError as e:
                    big_results.append((e.code().name, time.monotonic() - t0, e.details()))
                stop.wait(0.2)

    sender = threading.Thread(target=keep_sending_big)
    sender.start()
    try:
        time.sleep(0.2)
        alongside = small_latencies(address)
    finally:
        stop.set()
        sender.join()
    assert big_results and all(status == "INVALID_ARGUMENT" for status, _, _ in big_results), big_results
    assert max(seconds for _, seconds, _ in big_results) < 2.0, big_results
    status, seconds, details = big_results[0]
    assert details.startswith("text: the prompt has 15999996 characters;"), details
    no_python_text(details)
    ratio = statistics.median(alongside) / statistics.median(alone)
    print(f"small requests: median {statistics.median(alone) * 1000:.0f} ms alone, "
          f"{statistics.median(alongside) * 1000:.0f} ms beside {len(big_results)} 16 MB prompts (x{ratio:.2f})")
    assert ratio < 2.0, (alone, alongside, big_results)


def test_a_long_text_under_the_bound_is_tokenized_off_the_loop(stack):
    """Longer than INLINE_TOKENIZE_CHARS, shorter than the character bound: tokenized on the tokenizer threads, then
    refused by its token count, while small requests go on."""
    status, seconds, details = text_request(stack.router.address, "print(1)\n" * 6000)
    assert status == "INVALID_ARGUMENT" and details.startswith("text: the prompt has") and "tokens" in details
    assert text_request(stack.router.address, "def g(): pass")[0] == "OK"


# ---- 4: reservations never outlive their request ------------------------------------------------------------------
def test_requests_with_1_to_20_ms_deadlines_leave_no_reservation(stack):
    address = stack.router.address

    def short(i: int) -> str:
        req = gen_pb.GenerateRequest(tokenized=gen_pb.TokenizedInput(input_ids=[5 + i % 50, 6, 7, 8, 9]),
                                     sampling_params=gen_pb.SamplingParams(max_new_tokens=8, ignore_eos=True))
        with grpc.insecure_channel(address) as ch:
            grpc.channel_ready_future(ch).result(timeout=10)
            try:
                list(gen_grpc.GenerationStub(ch).Generate(req, timeout=0.001 * (1 + i % 20)))
                return "OK"
            except grpc.RpcError as e:
                return e.code().name

    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(short, range(200)))
    assert set(statuses) <= {"OK", "DEADLINE_EXCEEDED"}, statuses
    assert statuses.count("DEADLINE_EXCEEDED") > 100, statuses
    ended = time.monotonic()
    for proc in stack.decode + stack.prefill:
        idle = wait_idle(proc, timeout_s=2.0)
        assert idle.num_transferring == 0 and idle.num_free_pages == idle.num_total_pages, \
            f"{proc.role} still holds reservations {time.monotonic() - ended:.1f} s after the last request: {idle}"


# ---- 5 and 6: every client error is a 400 / INVALID_ARGUMENT naming the field -------------------------------------
def http_post(stack, path: str, body: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def model_name(stack) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=30)
    conn.request("GET", "/v1/models")
    name = json.loads(conn.getresponse().read())["data"][0]["id"]
    conn.close()
    return name


CLIENT_ERRORS = [
    ("top_k of 2**40", "/v1/completions", '"prompt": "hi", "top_k": 1099511627776', "top_k"),
    ("max_tokens of 2**40", "/v1/completions", '"prompt": "hi", "max_tokens": 1099511627776', "max_tokens"),
    ("temperature beyond a float", "/v1/completions", '"prompt": "hi", "temperature": 1' + "0" * 400, "temperature"),
    ("a lone surrogate in the prompt", "/v1/completions", '"prompt": "\\udc80"', "prompt"),
    ("a lone surrogate in a message", "/v1/chat/completions",
     '"messages": [{"role": "user", "content": "a\\udc80b"}]', "messages"),
    ("a lone surrogate in a stop string", "/v1/completions", '"prompt": "hi", "stop": ["\\ud800"]', "stop"),
    ("204,600 stop_token_ids", "/v1/completions", '"prompt": "hi", "stop_token_ids": [' + ",".join(["1"] * 204600)
     + "]", "stop_token_ids"),
]


@pytest.mark.parametrize("case, path, fields, param", CLIENT_ERRORS, ids=[c[0] for c in CLIENT_ERRORS])
def test_http_client_errors_are_400_naming_the_field(stack, case, path, fields, param):
    status, body = http_post(stack, path, ('{"model": "%s", %s}' % (model_name(stack), fields)).encode())
    assert status == 400, (case, body)
    error = body["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", (case, error)
    no_python_text(error["message"])


def test_http_json_nested_100000_deep_is_a_400(stack):
    status, body = http_post(stack, "/v1/completions", b"[" * 100_000 + b"]" * 100_000)
    assert status == 400, body
    assert "nested too deeply" in body["error"]["message"]
    no_python_text(body["error"]["message"])


def raw_generate(address: str, raw: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_stream("/pdserve.v1.Generation/Generate")  # bytes in, bytes out: no serializer
        with pytest.raises(grpc.RpcError) as e:
            list(call(raw, timeout=10))
    return e.value


def test_grpc_bytes_that_are_not_a_valid_request_are_invalid_argument(stack):
    address = stack.router.address
    params = gen_pb.SamplingParams(max_new_tokens=2).SerializeToString()
    good = gen_pb.GenerateRequest(text="abc").SerializeToString() + b"\x22" + bytes([len(params)]) + params
    cases = {"invalid UTF-8 in text": good.replace(b"abc", b"\xff\xfe\xfd"),
             "corrupt bytes": b"\x12\xff\xff\xff\xff\x0f" + b"junk"}
    for case, raw in cases.items():
        error = raw_generate(address, raw)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, error)
        assert "pdserve.v1.GenerateRequest" in error.details(), (case, error.details())
        no_python_text(error.details())
    # Both members of the prompt oneof: protobuf would keep the last one silently.
    both = gen_pb.GenerateRequest(text="abc").SerializeToString() + gen_pb.GenerateRequest(
        tokenized=gen_pb.TokenizedInput(input_ids=[5, 6])).SerializeToString()
    error = raw_generate(address, both)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("prompt: give exactly "
                                                                                           "one of"), error
    assert list(generate_ids(address, [5, 6, 7])), "the router stopped serving"


def generate_ids(address: str, ids: list[int], **params):
    req = gen_pb.GenerateRequest(tokenized=gen_pb.TokenizedInput(input_ids=ids),
                                 sampling_params=gen_pb.SamplingParams(max_new_tokens=2, ignore_eos=True, **params))
    with grpc.insecure_channel(address) as ch:
        return list(gen_grpc.GenerationStub(ch).Generate(req, timeout=30))


def test_grpc_stop_token_ids_have_a_count_limit(stack):
    with pytest.raises(grpc.RpcError) as e:
        generate_ids(stack.router.address, [5, 6, 7], stop_token_ids=[1] * 204600)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("sampling_params.stop_token_ids: at most"), e.value.details()


# ---- 6: a forged KV aux record fails its own request only -------------------------------------------------------
def test_aux_first_token_outside_the_vocabulary_fails_only_its_request(stack):
    decode = stack.decode[0]
    prompt = [5, 6, 7, 8, 9, 10]
    with grpc.insecure_channel(decode.address) as ch:
        stub = pb_grpc.DecodeWorkerStub(ch)
        reserve = stub.Reserve(pb.ReserveRequest(request_id="forged-aux", input_ids=prompt,
                                                 sampling_params=gen_pb.SamplingParams(max_new_tokens=4)), timeout=10)
        updates = ThreadPoolExecutor(1).submit(decode_updates, stub, "forged-aux")
        lay = reserve.layout
        layout = KVLayout(lay.model_fingerprint, lay.page_size, lay.num_kv_layers, lay.kv_dim, lay.dtype)
        sock = socket.create_connection(wire.parse_endpoint(reserve.kv_endpoint), timeout=10)
        wire.send_frame(sock, {"kind": wire.HELLO, "version": wire.VERSION, "layout": layout.to_dict()})
        assert wire.recv_frame(sock)[0]["kind"] == wire.HELLO_OK
        rows = torch.zeros(len(prompt), layout.kv_dim, dtype=layout.torch_dtype)
        payload = wire.tensor_bytes(rows)
        # The room's layers: the pool's, less the MTP layer's for a decode worker that does not speculate.
        num_layers = layout.num_kv_layers - (1 if reserve.skip_mtp_kv else 0)
        for layer in range(num_layers):
            wire.send_frame(sock, {"kind": wire.LAYER, "room": reserve.room, "layer": layer,
                                   "num_tokens": len(prompt), "crc32": wire.payload_crc32(payload)}, payload)
        wire.send_frame(sock, {"kind": wire.AUX, "room": reserve.room,
                               "fields": {"first_token_id": 10**12, "cached_tokens": 0}, "hidden_dtype": None,
                               "hidden_shape": None, "hidden_nbytes": 0, "rng_nbytes": 0}, b"")
        failure = updates.result(30)[-1].failure
        sock.close()
    assert failure.code == grpc.StatusCode.UNAVAILABLE.value[0], failure
    assert "first_token_id 1000000000000 is outside the vocabulary" in failure.message, failure
    idle = wait_idle(decode, 5)
    assert idle.num_free_pages == idle.num_total_pages and idle.num_transferring == 0, idle
    assert generate_ids(stack.router.address, [5, 6, 7])[-1].HasField("complete")  # still serving


# ---- 6: metrics on --host only; a draining worker answers NOT_SERVING before closing its port ----------------------
def test_metrics_listen_on_the_process_host_only(stack):
    for proc in stack.all():
        with socket.create_connection(("127.0.0.1", proc.metrics_port), timeout=5):
            pass
        with pytest.raises(OSError):  # 127.0.0.2 is this machine too, but not the --host the process was given
            socket.create_connection(("127.0.0.2", proc.metrics_port), timeout=5).close()


def test_draining_idle_worker_never_answers_serving_and_closes_its_port(stack):
    """Last in this module: it stops the decode worker. Idle, it has nothing to drain: from SIGTERM on, a health
    check gets NOT_SERVING or a closed port (either takes it out of a router's rotation at once), never SERVING,
    and the port closes within a second (tests/test_drain.py: NOT_SERVING while requests in flight finish)."""
    decode = stack.decode[0]
    seen = []
    with grpc.insecure_channel(decode.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
        decode.popen.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:
            try:
                seen.append((time.monotonic() - t0, stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status))
            except grpc.RpcError:
                break
            time.sleep(0.01)
        closed = time.monotonic() - t0
    assert all(status == health_pb2.HealthCheckResponse.NOT_SERVING for _, status in seen), seen
    assert closed < 1.0, f"the port still answered {closed:.2f} s after SIGTERM: {seen}"
    assert decode.popen.wait(15) == 0
