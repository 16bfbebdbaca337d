"""The OpenAI-compatible HTTP API on the router, driven by the official `openai` client against real processes:
greedy (and seeded) outputs equal the gRPC path's token for token, chat prompts are the model's chat template,
errors have OpenAI's shape and status, and the router's limits, API keys, drain and client disconnects behave as on
gRPC."""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import ssl
import subprocess
import sys
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.sampling import SamplingParams

from stack import REPO, Proc, free_port, generate, load, router_over, scrape, start, stop_all, wait_idle

pytestmark = pytest.mark.slow
PROMPTS = ["The router sends each request to a prefill worker", "Hello", "Naïve café 東京 🚀",
           [5, 6, 7, 8, 9, 10]]
MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What does the decode worker do?"},
            {"role": "assistant", "content": "It streams tokens."},
            {"role": "user", "content": [{"type": "text", "text": "And the "}, {"type": "text", "text": "router?"}]}]


@pytest.fixture(scope="module")
def stack(shared_stack, tiny_v3_dir, tmp_path_factory):
    """A router with OpenAI HTTP over the session's shared workers (the tests read their counters as differences)."""
    http_port = free_port()
    s = router_over(shared_stack, tiny_v3_dir, tmp_path_factory.mktemp("logs-openai"), ["--http-port", str(http_port)])
    s.http_port = http_port
    yield s
    stop_all([s.router])


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def model(tiny_v3_dir):
    return tiny_v3_dir.name  # the router serves the model directory's name


def extra(choice) -> dict:
    return choice.model_extra or {}


def test_models_lists_the_served_model(client, model):
    models = client.models.list().data
    assert [m.id for m in models] == [model] and models[0].owned_by == "pdserve"
    assert extra(models[0])["max_model_len"] > 0


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_equal_the_grpc_path_under_greedy_decoding(stack, client, model, prompt):
    want = generate(stack.router.address, prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    got = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = got.choices[0]
    assert choice.text == want.text
    assert extra(choice)["token_ids"] == want.output_ids
    assert choice.finish_reason == want.finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == \
        (want.prompt_tokens, 12, want.prompt_tokens + 12)
    assert got.object == "text_completion" and got.model == model and got.id.startswith("cmpl-")


def test_streamed_completion_equals_the_grpc_path(stack, client, model):
    prompt = PROMPTS[0]
    want = generate(stack.router.address, prompt, SamplingParams(max_new_tokens=16))  # eos may end it early
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [want.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.output_ids)


def test_streamed_chat_equals_the_grpc_path_on_the_chat_template(stack, client, model, tiny_v3_dir):
    from transformers import AutoTokenizer

    # The reference rendering is transformers' own apply_chat_template on the model's tokenizer_config.json.
    flat = [{**m, "content": "".join(p["text"] for p in m["content"]) if isinstance(m["content"], list)
             else m["content"]} for m in MESSAGES]
    rendered = AutoTokenizer.from_pretrained(tiny_v3_dir).apply_chat_template(flat, tokenize=False,
                                                                              add_generation_prompt=True)
    want = generate(stack.router.address, rendered, SamplingParams(max_new_tokens=20, ignore_eos=True))
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    token_ids = [t for c in chunks if c.choices for t in extra(c.choices[0]).get("token_ids", [])]
    assert token_ids == want.output_ids
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.prompt_tokens == want.prompt_tokens and chunks[-1].object == "chat.completion.chunk"
    whole = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=20, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.content == want.text and whole.choices[0].message.role == "assistant"


def test_sampling_parameters_reach_the_workers(stack, client, model):
    """Seeded sampling and stop strings: the same parameters over HTTP and gRPC give the same tokens."""
    prompt = "The router sends each request to"
    sampled = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, top_k=40, seed=1234, ignore_eos=True)
    want = generate(stack.router.address, prompt, sampled)
    got = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0.9, top_p=0.95, seed=1234,
                                    extra_body={"top_k": 40, "ignore_eos": True, "return_token_ids": True})
    assert extra(got.choices[0])["token_ids"] == want.output_ids
    stop = generate(stack.router.address, prompt, SamplingParams(max_new_tokens=16, ignore_eos=True)).text[4:7]
    want = generate(stack.router.address, prompt, SamplingParams(max_new_tokens=16, stop=(stop,), ignore_eos=True))
    got = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert (got.choices[0].text, got.choices[0].finish_reason) == (want.text, "stop")


@pytest.mark.parametrize("endpoint, kwargs, param", [
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "n": 17}, "n"),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "hi", "extra_body": {"response_format": {"type": "json_object"}}}, "response_format"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("completions", {"prompt": [1, 10_000_000]}, "prompt"),
    ("completions", {"prompt": ["one", [5, 6]]}, "prompt"),  # a batch mixes strings and token ids
    ("completions", {"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
    ("completions", {"prompt": "hi", "top_p": 1e-50}, "top_p"),  # 0 as the wire's float32
    ("completions", {"prompt": "hi", "extra_body": {"stop_token_ids": ["x"]}}, "stop_token_ids"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages"),
])
def test_invalid_requests_get_openai_style_400s(client, model, endpoint, kwargs, param):
    create = client.completions.create if endpoint == "completions" else client.chat.completions.create
    with pytest.raises(openai.BadRequestError) as info:
        create(model=model, **({"max_tokens": 4} | kwargs))
    assert info.value.status_code == 400
    body = info.value.body
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
    assert body["param"] == param and body["message"]


def test_error_bodies_for_bad_json_unknown_models_and_paths(stack, client, model):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=4)
    assert info.value.body["code"] == "model_not_found" and model in info.value.body["message"]
    for method, path, body, status in [("POST", "/v1/completions", b"{not json", 400),
                                       ("POST", "/v1/completions", b"[1, 2]", 400),
                                       ("GET", "/v1/nothing", None, 404), ("GET", "/v1/completions", None, 405)]:
        conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=10)
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        error = json.loads(resp.read())["error"]
        conn.close()
        assert resp.status == status and set(error) == {"message", "type", "param", "code"}, (path, error)


def test_requests_that_grow_with_their_size_are_refused_by_their_size_first(stack, model):
    """More chat messages than the context has tokens, thousands of stop token ids: refused by their count before
    anything reads them (the chat template over 400k messages held the router's loop for seconds), naming it."""
    many = {"model": model, "messages": [{"role": "user", "content": "hi"}] * 20_000}
    stops = {"model": model, "prompt": "hi", "stop_token_ids": ["x"] + [1] * 10_000}
    for path, body, param, needle in [("/v1/chat/completions", many, "messages", "20000 messages cannot fit"),
                                      ("/v1/completions", stops, "stop_token_ids", "at most 256 ids")]:
        conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=30)
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        error = json.loads(resp.read())["error"]
        conn.close()
        assert resp.status == 400 and error["param"] == param and needle in error["message"], (path, error)


def test_bad_client_input_the_red_team_sent_is_a_400_never_a_500(stack, model):
    """A text part whose text is not a string, an integer literal past Python's 4300 digits, and a body that is
    not gzip under `Content-Encoding: gzip` (each was a 500)."""
    chat = {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
    cases = [("/v1/chat/completions", json.dumps(chat).encode(), {}, "messages"),
             ("/v1/completions", b'{"model": "%s", "prompt": "hi", "max_tokens": %s}' % (model.encode(), b"7" * 5000),
              {}, None),
             ("/v1/completions", json.dumps({"model": model, "prompt": "hi"}).encode(), {"Content-Encoding": "gzip"},
              None)]
    for path, body, headers, param in cases:
        conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=10)
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        error = json.loads(resp.read())["error"]
        conn.close()
        assert resp.status == 400 and error["param"] == param and "internal" not in error["message"], (path, error)


# ---- a second router on the same workers: limits, API keys, client disconnects, drain ---------------------------
@pytest.fixture(scope="module")
def limited(stack, tiny_v3_dir, tmp_path_factory):
    """At most one request at a time, and an API key."""
    http_port = free_port()
    router = start("router", ["--model", str(tiny_v3_dir), "--prefill", stack.prefill[0].address, "--decode",
                              stack.decode[0].address, "--http-port", str(http_port), "--max-concurrent-requests",
                              "1", "--api-key", "sesame", "--drain-timeout", "20"],
                   tmp_path_factory.mktemp("logs-limited"), "router-limited")
    router.http_port = http_port
    yield router
    router.stop()


def open_stream(port: int, body: dict, key: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A raw streaming request whose socket the test closes itself (a client going away)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    return conn, resp


def read_events(resp: http.client.HTTPResponse, n: int) -> list[dict]:
    events = []
    while len(events) < n:
        raw = resp.readline()
        assert raw, f"the stream ended after {len(events)} of {n} events"
        line = raw.decode().strip()
        if line.startswith("data: {"):
            events.append(json.loads(line[len("data: "):]))
    return events


def outcomes(proc: Proc) -> dict[str, float]:
    return {s.labels["outcome"]: s.value for f in text_string_to_metric_families(scrape(proc))
            for s in f.samples if s.name == "pdserve_requests_total"}


def test_api_keys_limits_and_disconnects(stack, limited, model):
    url = f"http://127.0.0.1:{limited.http_port}/v1"
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    conn = http.client.HTTPConnection("127.0.0.1", limited.http_port, timeout=10)
    conn.request("POST", "/v1/completions", body=json.dumps({"model": model, "prompt": "hi"}))  # no key at all
    resp = conn.getresponse()
    assert resp.status == 401 and json.loads(resp.read())["error"]["code"] == "invalid_api_key"
    conn.close()
    client = openai.OpenAI(base_url=url, api_key="sesame", max_retries=0, timeout=30)
    assert client.models.list().data[0].id == model
    aborted_before = outcomes(stack.decode[0]).get("aborted", 0)

    conn, resp = open_stream(limited.http_port, {"model": model, "prompt": "Hello", "max_tokens": 1500,
                                                 "temperature": 0, "stream": True, "ignore_eos": True}, "sesame")
    assert read_events(resp, 3)[0]["object"] == "text_completion"
    # The one allowed request is running: the next one is refused with 429 (gRPC's RESOURCE_EXHAUSTED).
    with pytest.raises(openai.RateLimitError) as info:
        client.completions.create(model=model, prompt="Hi", max_tokens=4)
    assert info.value.status_code == 429 and info.value.body["code"] == "resource_exhausted"
    assert load(stack.decode[0]).num_free_pages < load(stack.decode[0]).num_total_pages

    resp.close()
    conn.close()  # the client goes away mid-stream: the generation stops and both workers free its pages
    for proc in stack.prefill + stack.decode:
        idle = wait_idle(proc)
        assert idle.num_free_pages == idle.num_total_pages and idle.num_running_requests == 0, proc.role
    deadline = time.monotonic() + 10
    while outcomes(limited).get("aborted", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert outcomes(limited).get("aborted", 0) == 1
    assert outcomes(stack.decode[0]).get("aborted", 0) == aborted_before + 1

    # Not streaming: nothing is written until the end, so only the closed connection tells; it cancels too.
    conn = http.client.HTTPConnection("127.0.0.1", limited.http_port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1500,
                                                            "ignore_eos": True}),
                 headers={"Content-Type": "application/json", "Authorization": "Bearer sesame"})
    deadline = time.monotonic() + 10
    while load(stack.decode[0]).num_running_requests == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    conn.close()
    for proc in stack.prefill + stack.decode:
        idle = wait_idle(proc)
        assert idle.num_free_pages == idle.num_total_pages and idle.num_running_requests == 0, proc.role
    assert outcomes(stack.decode[0]).get("aborted", 0) == aborted_before + 2
    assert client.completions.create(model=model, prompt="Hi", max_tokens=4).usage.completion_tokens >= 1


def test_sigterm_drains_http_too(stack, limited, model):
    """On SIGTERM new HTTP requests get 503 while the one in flight may finish; the router exits when it has."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{limited.http_port}/v1", api_key="sesame", max_retries=0,
                           timeout=30)
    conn, resp = open_stream(limited.http_port, {"model": model, "prompt": "Hello", "max_tokens": 1500,
                                                 "temperature": 0, "stream": True, "ignore_eos": True}, "sesame")
    read_events(resp, 2)
    limited.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while True:  # 429 (the limit) until the drain starts, then 503
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=model, prompt="Hi", max_tokens=4)
        if info.value.status_code == 503 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert info.value.status_code == 503 and "draining" in info.value.body["message"]
    time.sleep(3)  # longer than stopping the gRPC server and the HTTP site take once nothing holds them
    assert limited.popen.poll() is None, "the router must wait for the request in flight"
    events = read_events(resp, 5)  # still streaming during the drain
    assert all(e["choices"][0]["text"] is not None for e in events)
    resp.close()
    conn.close()
    limited.popen.wait(15)  # the drain ends when the last request does, well before --drain-timeout 20
    assert limited.popen.returncode == 0
    for proc in stack.prefill + stack.decode:
        assert wait_idle(proc).num_free_pages == wait_idle(proc).num_total_pages


def test_tls_and_no_workers(tiny_v3_dir, tmp_path):
    """With --tls-cert the HTTP port speaks TLS too, and a router whose workers are all unreachable answers 503."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    http_port = free_port()
    log = tmp_path / "router.log"
    router = subprocess.Popen([sys.executable, "-m", "pdserve", "router", "--model", str(tiny_v3_dir), "--port",
                               str(free_port()), "--prefill", f"127.0.0.1:{free_port()}", "--decode",
                               f"127.0.0.1:{free_port()}", "--http-port", str(http_port), "--tls-cert", str(cert),
                               "--tls-key", str(key)], cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        context = ssl.create_default_context(cafile=str(cert))
        deadline = time.monotonic() + 60
        while True:
            assert router.poll() is None, log.read_text()
            try:
                conn = http.client.HTTPSConnection("127.0.0.1", http_port, context=context, timeout=5)
                conn.request("GET", "/v1/models")
                resp = conn.getresponse()
                break
            except (ConnectionRefusedError, ssl.SSLError):
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        error = json.loads(resp.read())["error"]
        assert resp.status == 503 and error["code"] == "unavailable" and error["type"] == "server_error"
        plain = http.client.HTTPConnection("127.0.0.1", http_port, timeout=5)
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            plain.request("GET", "/v1/models")
            plain.getresponse()
    finally:
        router.terminate()
        router.wait(30)
