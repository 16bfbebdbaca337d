"""What a new user and their tools meet first (issue 22), with real processes on real ports: `pdserve up`'s defaults
(OpenAI HTTP and metrics on, one endpoints table), ports checked before any worker starts and never shared, workers
that die with `up` however it dies, a Ctrl-C that exits 0, and the OpenAI surface evaluation harnesses and best-of
clients use (logprobs, echo with prompt logprobs, n with seeds, models.retrieve, /health, /metrics), whose logprobs
equal the single-process engine's."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import openai
import pytest

from pdserve.engine import EngineConfig, LLMEngine
from pdserve.kv_cache import CacheConfig
from pdserve.sampling import SamplingParams
from pdserve.serving.rpc_convert import sampling_to_proto
from pdserve.v1 import generate_pb2 as gen_pb
from pdserve.v1 import generate_pb2_grpc as gen_grpc

from stack import REPO, free_port, metric

pytestmark = pytest.mark.slow
PROMPT_IDS = [0, 5, 6, 7, 8, 9, 10, 11, 12]
TOL = 1e-4


class Up:
    """A `pdserve up` process and its ports."""

    def __init__(self, tmp: Path, *flags: str, name: str = "up"):
        # gRPC, HTTP, router metrics, then the workers' metrics at metrics_port + 1 + k
        base = free_port_run(5)
        self.port, self.http_port, self.metrics_port = base, base + 1, base + 2
        self.log = tmp / f"{name}.log"
        port_flags = ["--port", str(self.port), "--http-port", str(self.http_port), "--metrics-port",
                      str(self.metrics_port)]
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve", "up", *port_flags, *flags], cwd=REPO,
                                     stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_up(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while "pdserve is up" not in self.text():
            assert self.proc.poll() is None, self.text()[-3000:]
            assert time.monotonic() < deadline, self.text()[-3000:]
            time.sleep(0.1)

    def workers(self) -> list[int]:
        return children(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def free_port_run(n: int) -> int:
    """A port p with p .. p+n-1 all free now, below the kernel's ephemeral range, so that no port picked by the
    kernel for another process (a worker's gRPC or KV port, a client) lands on it before it is bound."""
    import random
    import socket

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        base = random.randrange(max(1024, low - 12000), low - n)
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise AssertionError("no run of free ports")


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def up(demo_up):
    return demo_up.get()  # (conftest.py: shared with test_batched_prompts; test_sigkill_of_up_... ends it)


@pytest.fixture(scope="module")
def client(up):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{up.http_port}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine(trained_model_dir):
    """The single-process engine on the same checkpoint, fp32, as the stack runs it."""
    return LLMEngine(EngineConfig(str(trained_model_dir), dtype="float32", cache=CacheConfig(page_size=4,
                                                                                              num_pages=512)))


# ---- ports, defaults, endpoints ---------------------------------------------------------------------------------
def test_up_lists_every_endpoint_and_serves_metrics_by_default(up):
    text = up.text()
    for line in (f"127.0.0.1:{up.port}", f"http://127.0.0.1:{up.http_port}/v1",
                 f"http://127.0.0.1:{up.metrics_port}/metrics", f"http://127.0.0.1:{up.metrics_port + 1}/metrics",
                 f"http://127.0.0.1:{up.metrics_port + 2}/metrics"):
        assert line in text, text[-2000:]
    # predictable worker ports: prefill 0 at +1, decode 0 at +2
    assert metric(up.metrics_port + 1, "pdserve_num_running_reqs", role="prefill") == 0
    assert metric(up.metrics_port + 2, "pdserve_num_running_reqs", role="decode") == 0
    # metrics listen where gRPC does (--host 127.0.0.1), not on every interface
    for port in (up.metrics_port, up.metrics_port + 1, up.metrics_port + 2, up.http_port, up.port):
        assert listening_addresses(port) == {"127.0.0.1"}, port
    # `up` starts the workers and runs the router: torch never loads in its process (its import there would hold back
    # every worker's start by seconds, and the router's memory)
    assert "libtorch" not in Path(f"/proc/{up.proc.pid}/maps").read_text()


def listening_addresses(port: int) -> set[str]:
    """The local addresses of the IPv4/IPv6 sockets listening on `port` (from /proc/net/tcp*)."""
    import ipaddress

    found = set()
    for name in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                raw = bytes.fromhex(address)
                if len(raw) == 4:
                    found.add(str(ipaddress.IPv4Address(raw[::-1])))
                else:  # /proc writes IPv6 as four little-endian words
                    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                    v6 = ipaddress.IPv6Address(words)
                    found.add(str(v6.ipv4_mapped or v6))
    return found


def test_a_second_up_on_a_taken_port_exits_2_naming_it_and_the_first_keeps_serving(up, client, tmp_path):
    cases = [(["--port", str(up.port)], f"--port: cannot listen on 127.0.0.1:{up.port}"),
             (["--port", str(free_port()), "--http-port", str(up.http_port)], f"--http-port: cannot listen on "
                                                                              f"127.0.0.1:{up.http_port}"),
             (["--port", str(free_port()), "--http-port", str(free_port()), "--metrics-port",  # its first worker's
               str(up.port - 1)], f"--metrics-port: cannot listen on 127.0.0.1:{up.port} (worker metrics"),
             (["--port", "7777", "--http-port", "7777"], "--port and --http-port are both 7777"),
             (["--model", "/nonexistent", "--port", str(free_port())], "--model /nonexistent: the directory does "
                                                                       "not exist")]
    for flags, message in cases:
        start = time.monotonic()
        second = subprocess.run([sys.executable, "-m", "pdserve", "up", "--http-port", str(free_port()),
                                 "--metrics-port", "0", *flags], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert second.returncode == 2, (flags, second.stderr)
        assert message in second.stderr and "Traceback" not in second.stderr, second.stderr
        assert "starting" not in second.stderr, "checked before any worker starts"
        assert time.monotonic() - start < 15
    # A lone router (gRPC's own bind, which shared ports through SO_REUSEPORT) refuses the port too.
    router = subprocess.run([sys.executable, "-m", "pdserve", "router", "--port", str(up.port), "--prefill",
                             f"127.0.0.1:{free_port()}", "--decode", f"127.0.0.1:{free_port()}"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert router.returncode == 2 and f"--port: cannot listen on 127.0.0.1:{up.port}" in router.stderr, router.stderr
    assert "Traceback" not in router.stderr
    # The first stack still answers, every connection on it (no port shared with a second server).
    for _ in range(5):
        with grpc.insecure_channel(f"127.0.0.1:{up.port}") as ch:
            info = gen_grpc.GenerationStub(ch).GetModelInfo(gen_pb.GetModelInfoRequest(), timeout=10)
        assert info.model_name == "tiny-trained"


def test_readme_openai_snippet_and_endpoints(up, client):
    """models.retrieve, /health and /metrics on the HTTP port; response_format refused, not ignored."""
    model = client.models.list().data[0].id
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{up.http_port}/health", timeout=5).read())
    assert health["status"] == "ok"
    assert metric(up.http_port, "pdserve_requests_total", role="router") >= 0  # the router's registry, scraped
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       response_format={"type": "json_object"})
    assert info.value.body["param"] == "response_format"


def test_http_requests_are_counted_finished(up, client):
    def counts():
        return {o: metric(up.metrics_port, "pdserve_requests_total", role="router", outcome=o)
                for o in ("finished", "aborted")}

    before = counts()
    client.completions.create(model="tiny-trained", prompt="def f(", max_tokens=4)
    list(client.chat.completions.create(model="tiny-trained", messages=[{"role": "user", "content": "Hi"}],
                                        max_tokens=4, stream=True))
    after = counts()
    assert after["finished"] - before["finished"] == 2 and after["aborted"] == before["aborted"], (before, after)


def test_a_disconnect_returns_the_decode_gauges_to_idle_within_a_second(up):
    decode_metrics = up.metrics_port + 2
    conn = http.client.HTTPConnection("127.0.0.1", up.http_port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": "tiny-trained", "prompt": "import os", "max_tokens": 2000, "ignore_eos": True, "stream": True}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    for _ in range(5):
        resp.readline()
    assert metric(decode_metrics, "pdserve_num_running_reqs", role="decode") == 1
    assert metric(decode_metrics, "pdserve_kv_pool_usage_ratio", role="decode") > 0
    resp.close()
    conn.close()
    gone = time.monotonic()
    while (metric(decode_metrics, "pdserve_num_running_reqs", role="decode") != 0
           or metric(decode_metrics, "pdserve_kv_pool_usage_ratio", role="decode") != 0):
        assert time.monotonic() - gone < 1.0, "gauges still show the disconnected request after 1 s"
        time.sleep(0.05)


def test_grpc_reflection_v1_and_v1alpha(up):
    from grpc_reflection.v1alpha import reflection_pb2 as r

    with grpc.insecure_channel(f"127.0.0.1:{up.port}") as ch:
        for version in ("v1", "v1alpha"):
            call = ch.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                    request_serializer=r.ServerReflectionRequest.SerializeToString,
                                    response_deserializer=r.ServerReflectionResponse.FromString)
            answers = list(call(iter([r.ServerReflectionRequest(list_services=""),
                                      r.ServerReflectionRequest(file_containing_symbol="pdserve.v1.Generation")]),
                                timeout=10))
            assert "pdserve.v1.Generation" in {s.name for s in answers[0].list_services_response.service}, version
            assert answers[1].WhichOneof("message_response") == "file_descriptor_response", version


# ---- logprobs, echo, n ------------------------------------------------------------------------------------------
def _close(got: float, want: float) -> bool:
    return abs(got - want) <= TOL


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.7, 3)])
def test_completion_logprobs_equal_the_engines(up, client, engine, temperature, seed):
    want = engine.generate([PROMPT_IDS], SamplingParams(max_new_tokens=6, temperature=temperature, seed=seed,
                                                        ignore_eos=True, logprobs=5))[0]
    got = client.completions.create(model="tiny-trained", prompt=PROMPT_IDS, max_tokens=6, temperature=temperature,
                                    seed=seed, logprobs=5, extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = got.choices[0]
    assert choice.model_extra["token_ids"] == want.output_ids
    lp = choice.logprobs
    diffs = [abs(g - w.logprob) for g, w in zip(lp.token_logprobs, want.logprobs)]
    print(f"max |logprob difference| vs the engine: {max(diffs):.2e}")
    assert len(lp.token_logprobs) == 6 and max(diffs) <= TOL
    for top, w in zip(lp.top_logprobs, want.logprobs):
        assert len(top) == len({t for t, _ in w.top})  # token texts may coincide; at most 5
        assert sorted(top.values(), reverse=True)[0] == pytest.approx(w.top[0][1], abs=TOL)
    if temperature == 0:  # greedy: the chosen token is the most likely one
        for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
            assert _close(chosen, max(top.values()))


def test_grpc_logprobs_and_chat_top_logprobs(up, client, engine):
    want = engine.generate([PROMPT_IDS], SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=3))[0]
    req = gen_pb.GenerateRequest(sampling_params=sampling_to_proto(
        SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=3)))
    req.tokenized.input_ids.extend(PROMPT_IDS)
    streamed = []
    with grpc.insecure_channel(f"127.0.0.1:{up.port}") as ch:
        for msg in gen_grpc.GenerationStub(ch).Generate(req, timeout=60):
            if msg.HasField("chunk"):
                assert len(msg.chunk.logprobs) == len(msg.chunk.token_ids)
                streamed += msg.chunk.logprobs
            else:
                complete = msg.complete
    assert [e.token_id for e in complete.logprobs] == want.output_ids
    for entries in (streamed, list(complete.logprobs)):
        for e, w in zip(entries, want.logprobs, strict=True):
            assert _close(e.logprob, w.logprob)
            assert [t.token_id for t in e.top] == [t for t, _ in w.top]
            assert all(_close(t.logprob, v) for t, (_, v) in zip(e.top, w.top))
    bad = gen_pb.GenerateRequest(sampling_params=gen_pb.SamplingParams(max_new_tokens=2, logprobs=21))
    bad.tokenized.input_ids.extend(PROMPT_IDS)
    with grpc.insecure_channel(f"127.0.0.1:{up.port}") as ch, pytest.raises(grpc.RpcError) as info:
        list(gen_grpc.GenerationStub(ch).Generate(bad, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprobs" in info.value.details()
    chat = client.chat.completions.create(model="tiny-trained", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=4)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 4 and _close(item.logprob, item.top_logprobs[0].logprob)
        assert item.token == item.top_logprobs[0].token


def test_echo_returns_the_engines_prompt_logprobs(up, client, engine):
    """What lm-eval's completions model sends to score a continuation: echo + logprobs=1, one new token."""
    want = engine.generate([PROMPT_IDS], SamplingParams(max_new_tokens=1, logprobs=1, prompt_logprobs=1))[0]
    got = client.completions.create(model="tiny-trained", prompt=PROMPT_IDS, max_tokens=1, temperature=0,
                                    logprobs=1, echo=True)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(PROMPT_IDS) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    prompt_want = [w.logprob for w in want.prompt_logprobs[1:]]
    diffs = [abs(g - w) for g, w in zip(lp.token_logprobs[1:len(PROMPT_IDS)], prompt_want, strict=True)]
    print(f"max |prompt logprob difference| vs the engine: {max(diffs):.2e}")
    assert max(diffs) <= TOL
    assert _close(lp.token_logprobs[-1], want.logprobs[0].logprob)
    text = "def parse(x):"
    echoed = client.completions.create(model="tiny-trained", prompt=text, max_tokens=2, echo=True)
    assert echoed.choices[0].text.startswith(text)


def test_n_choices_with_a_seed_are_distinct_and_reproducible(up, client):
    def ask():
        r = client.completions.create(model="tiny-trained", prompt="def ", max_tokens=8, temperature=1.0, n=3,
                                      seed=11, extra_body={"ignore_eos": True})
        assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 24
        return [c.text for c in r.choices]

    first = ask()
    assert ask() == first
    assert len(set(first)) > 1, first
    stream = client.completions.create(model="tiny-trained", prompt="def ", max_tokens=8, temperature=1.0, n=3,
                                       seed=11, stream=True, extra_body={"ignore_eos": True})
    texts = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == first


def test_generate_cli_prints_logprobs_locally_and_through_the_stack(up, engine):
    want = engine.generate([PROMPT_IDS], SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=2))[0]
    ids = ",".join(map(str, PROMPT_IDS))
    for where in (["--target", f"127.0.0.1:{up.port}"], ["--dtype", "float32"]):
        out = subprocess.run([sys.executable, "-m", "pdserve", "generate", *where, "--input-ids", ids,
                              "--max-new-tokens", "3", "--ignore-eos", "--json", "--logprobs", "2"], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)["logprobs"]
        assert [e["token_id"] for e in got] == want.output_ids
        for e, w in zip(got, want.logprobs, strict=True):
            assert _close(e["logprob"], w.logprob) and [t for t, _ in e["top"]] == [t for t, _ in w.top]


@pytest.mark.parametrize("path, payload", [
    ("/v1/completions", {"prompt": "def f(x):", "best_of": 1, "max_tokens": 12, "stream": True,
                         "temperature": 0.0, "ignore_eos": True, "logprobs": 5}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "def f(x):"}], "max_completion_tokens": 12,
                              "stream": True, "temperature": 0.0, "ignore_eos": True})])
def test_sglang_bench_serving_request_shapes(up, path, payload):
    """The bodies sglang.bench_serving sends (backends sglang-oai / vllm and sglang-oai-chat, random-ids dataset,
    --return-logprob --top-logprobs-num 5), read as it reads them: SSE lines until [DONE]."""
    conn = http.client.HTTPConnection("127.0.0.1", up.http_port, timeout=60)
    conn.request("POST", path, json.dumps({"model": "tiny-trained", **payload}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    conn.close()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or "" for c in chunks]
    assert "".join(texts) and chunks[-1]["choices"][0]["finish_reason"] == "length"
    if "logprobs" in payload:
        tokens = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"][0]["logprobs"])
        assert tokens == 12


# ---- signals: last, the first one kills the module's stack ------------------------------------------------------
def test_ctrl_c_at_any_moment_exits_0_without_a_traceback(tmp_path):
    """Ctrl-C while the workers start and right at "is up"; SIGHUP (the terminal closed) stops it the same way."""
    def case(when: str, flags: tuple, sig: signal.Signals) -> None:
        u = Up(tmp_path, "--skip-warmup", "--page-size", "4", *flags, name=when.replace(" ", "-") + sig.name)
        try:
            deadline = time.monotonic() + 120
            while when not in u.text():
                assert u.proc.poll() is None and time.monotonic() < deadline, u.text()[-2000:]
                time.sleep(0.02)
            workers = u.workers()
            u.proc.send_signal(sig)
            assert u.proc.wait(30) == 0, u.text()[-2000:]
        finally:
            u.stop()
        assert not any(alive(w) for w in workers), "workers outlived `pdserve up`"
        assert "Traceback" not in u.text() and "Event loop is closed" not in u.text(), u.text()[-3000:]
        if flags:  # nothing listens on the ports those flags turned off
            assert "OpenAI HTTP API" not in u.text() and "metrics" not in u.text().split("pdserve is up")[1]

    # The three `pdserve up`s side by side (each on ports of its own): their start-ups overlap.
    with ThreadPoolExecutor(3) as pool:
        for f in [pool.submit(case, *c) for c in (("starting", (), signal.SIGINT),
                                                  ("pdserve is up", ("--no-http", "--no-metrics"), signal.SIGINT),
                                                  ("pdserve is up", (), signal.SIGHUP))]:
            f.result()


def test_sigkill_of_up_leaves_no_worker_alive(up):
    workers = up.workers()
    assert len(workers) == 2
    up.proc.kill()
    up.proc.wait(5)
    deadline = time.monotonic() + 5
    while any(alive(w) for w in workers):
        assert time.monotonic() < deadline, "workers outlived a SIGKILLed `pdserve up`"
        time.sleep(0.1)


# ---- the README, as written, against the README's main job ------------------------------------------------------
def _readme_blocks(lang: str) -> list[str]:
    text = (REPO / "README.md").read_text()
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def test_readme_examples_run_as_written_against_demo_sh(tmp_path):
    """`scripts/demo.sh` (default ports, no flags), then the README's first `pdserve generate --target` lines and its
    OpenAI Python snippet, verbatim."""
    from pdserve.cli.up import _port_taken

    busy = [p for p in (50051, 8000, 9100, 9101, 9102) if _port_taken("127.0.0.1", p)]
    if busy:
        pytest.skip(f"the default ports {busy} are in use on this machine")
    log = tmp_path / "demo.log"
    demo = subprocess.Popen(["bash", "scripts/demo.sh"], cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while "pdserve is up" not in log.read_text():
            assert demo.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        commands = [line for block in _readme_blocks("bash") for line in block.splitlines()
                    if line.startswith("pdserve generate --target localhost:50051")]
        assert len(commands) == 2
        snippet = next(b for b in _readme_blocks("python") if "base_url=\"http://localhost:8000/v1\"" in b)
        with ThreadPoolExecutor(3) as pool:  # the three clients side by side, as three users would
            runs = [pool.submit(subprocess.run, line.split("#")[0], shell=True, cwd=tmp_path, capture_output=True,
                                text=True, timeout=60) for line in commands]
            python = pool.submit(subprocess.run, [sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True,
                                 text=True, timeout=120)
            for line, run in zip(commands, runs, strict=True):
                out = run.result()
                assert out.returncode == 0 and out.stdout.strip(), (line, out.stderr)
            out = python.result()
        assert out.returncode == 0, out.stderr
        assert len(out.stdout.strip().splitlines()) >= 2, out.stdout
    finally:
        demo.send_signal(signal.SIGINT)
        assert demo.wait(30) == 0, log.read_text()[-3000:]
    assert "Traceback" not in log.read_text()


def test_generate_defaults_to_the_demo_model_and_finds_relative_paths_from_anywhere(tmp_path):
    def generate(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pdserve", "generate", *flags], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)

    ids = ("--input-ids", "5,6,7", "--max-new-tokens", "3", "--json")
    with ThreadPoolExecutor(3) as pool:  # side by side: each loads torch and the model on its own
        default, relative, missing = pool.map(lambda flags: generate(*flags), [
            ids, ("--model", "models/tiny-trained", *ids), ("--model", "models/nope", "--input-ids", "5")])
    outputs = []
    for out in (default, relative):
        assert out.returncode == 0, out.stderr
        outputs.append(json.loads(out.stdout)["output_ids"])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 3
    assert missing.returncode == 2 and "--model models/nope: the directory does not exist" in missing.stderr


TAKEN_PORT_CASES = [("prefill", "--metrics-port"), ("decode", "--metrics-port"), ("prefill", "--port"),
                    ("router", "--metrics-port"), ("router", "--http-port")]


@pytest.fixture(scope="module")
def taken_port_runs(tmp_path_factory) -> dict[tuple[str, str], tuple[int, subprocess.CompletedProcess]]:
    """Each lone process of the test below started on a port a socket here listens on, all side by side (the
    workers import torch and load the model before they refuse): (role, flag) -> (the port, the finished run)."""
    import socket

    def run(role: str, flag: str) -> tuple[int, subprocess.CompletedProcess]:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            extra = (["--skip-warmup"] if role != "router" else
                     ["--prefill", f"127.0.0.1:{free_port()}", "--decode", f"127.0.0.1:{free_port()}", "--port",
                      str(free_port())])
            return port, subprocess.run([sys.executable, "-m", "pdserve", role, *extra, flag, str(port)],
                                        cwd=tmp_path_factory.mktemp(f"taken-{role}"), capture_output=True, text=True,
                                        timeout=120)

    with ThreadPoolExecutor(len(TAKEN_PORT_CASES)) as pool:
        futures = {case: pool.submit(run, *case) for case in TAKEN_PORT_CASES}
        return {case: f.result() for case, f in futures.items()}


@pytest.mark.parametrize("role, flag", TAKEN_PORT_CASES)
def test_lone_processes_name_the_taken_port_without_a_traceback(role, flag, taken_port_runs):
    port, out = taken_port_runs[role, flag]
    assert out.returncode == 2, out.stderr
    assert f"pdserve {role}: error: {flag}: cannot listen on 127.0.0.1:{port}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "Event loop is closed" not in out.stderr, out.stderr


def test_setup_sh_says_what_it_installs_and_can_skip_apt(tmp_path):
    """scripts/setup.sh against stand-in python3 and apt-get that log their calls: --runtime installs pdserve
    without the test extras or Debian packages (what demo.sh runs); the default announces apt-get before running it;
    --no-apt never runs it."""
    import shutil

    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    for name in ("python3", "apt-get"):
        (bin_dir / name).write_text(f'#!/bin/bash\necho "{name} $*" >> {calls}\n')
        (bin_dir / name).chmod(0o755)
    for tool in ("dirname", "id", "sed"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    is_root = os.getuid() == 0

    def setup(*flags):
        calls.write_text("")
        out = subprocess.run([shutil.which("bash"), str(REPO / "scripts" / "setup.sh"), *flags], cwd=tmp_path,
                             env={"PATH": str(bin_dir)}, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stderr, calls.read_text()

    said, ran = setup("--runtime")
    assert "pip install -q -e .\n" in ran and "[test]" not in ran and "apt-get" not in ran, ran
    assert "installing pdserve and its runtime dependencies" in said
    said, ran = setup("--no-apt")
    assert "pip install -q -e .[test]" in ran and "apt-get" not in ran
    assert "not installing redis-server prometheus (--no-apt)" in said
    said, ran = setup()
    if is_root:
        assert "apt-get install" in ran
        assert "installing the Debian packages redis-server prometheus with apt-get, as root (skip with --no-apt)" \
            in said
    else:
        assert "apt-get" not in ran and "sudo apt-get install" in said
