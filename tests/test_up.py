"""`pdserve up` runs the whole stack locally; `pdserve generate --target` talks to it, its OpenAI HTTP front answers
as its gRPC one does; Ctrl-C stops every process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from pdserve.engine import EngineConfig, LLMEngine
from pdserve.kv_cache import CacheConfig
from pdserve.sampling import SamplingParams

from stack import REPO, Proc, free_port, generate, wait_serving

pytestmark = pytest.mark.slow


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return 0


def test_up_serves_and_stops_cleanly(tiny_v3_dir, tmp_path):
    model = tmp_path / "model-for-up"
    subprocess.run(["cp", "-r", str(tiny_v3_dir), str(model)], check=True)
    port, http_port = free_port(), free_port()
    log = tmp_path / "up.log"
    up = subprocess.Popen([sys.executable, "-m", "pdserve", "up", "--model", str(model), "--port", str(port),
                           "--page-size", "4", "--prefill", "1", "--decode", "2", "--http-port", str(http_port),
                           "--metrics-port", "0"], cwd=REPO,
                          stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_serving(Proc("router", f"127.0.0.1:{port}", up, 0, log), timeout_s=90)
        assert len(processes_mentioning(str(model))) == 4  # up itself + 1 prefill + 2 decode
        out = subprocess.run([sys.executable, "-m", "pdserve", "generate", "--target", f"127.0.0.1:{port}",
                              "--input-ids", "5,6,7,8", "--max-new-tokens", "6", "--ignore-eos", "--json"],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        engine = LLMEngine(EngineConfig(str(model), cache=CacheConfig(page_size=4, num_pages=64)))
        want = engine.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
        assert got["output_ids"] == want.output_ids and got["finish_reason"] == "length"
        assert "pdserve generate --target" in log.read_text()  # it tells the user how to send a request
        # Its OpenAI HTTP front gives the tokens its gRPC front gives, and `up` says where it listens.
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="x", max_retries=0, timeout=30)
        got = client.completions.create(model=model.name, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        via_grpc = generate(f"127.0.0.1:{port}", [5, 6, 7, 8], SamplingParams(max_new_tokens=6, ignore_eos=True))
        assert (got.choices[0].model_extra or {})["token_ids"] == via_grpc.output_ids
        assert f"OpenAI HTTP on :{http_port}" in log.read_text()
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(30)
    deadline = time.monotonic() + 10
    while processes_mentioning(str(model)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(str(model)) == [], "worker processes outlived `pdserve up`"


def test_default_model_is_the_committed_trained_model(trained_model_dir):
    """`pdserve up` without --model serves models/tiny-trained from the checkout (whatever the working directory),
    and that checkpoint has the MTP layer NextN drafts with."""
    from pdserve.cli import up as serve_cli
    from pdserve.config import ModelConfig

    assert Path(serve_cli.DEFAULT_MODEL_DIR).resolve() == trained_model_dir.resolve()
    cfg = ModelConfig.from_model_dir(serve_cli.DEFAULT_MODEL_DIR)
    assert cfg.num_nextn_predict_layers == 1 and cfg.model_type == "deepseek_v3"


def test_cpu_workers_share_the_cores_unless_omp_num_threads_is_set(monkeypatch):
    import argparse

    from pdserve.cli.up import worker_env

    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    args = argparse.Namespace(device="cpu", prefill=1, decode=3)
    assert worker_env(args, {"PATH": "/bin"}) == {"PATH": "/bin", "OMP_NUM_THREADS": "2"}
    assert worker_env(args, {"OMP_NUM_THREADS": "5"})["OMP_NUM_THREADS"] == "5"  # the user's choice wins
    assert worker_env(argparse.Namespace(device="cpu", prefill=8, decode=8), {})["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in worker_env(argparse.Namespace(device="cuda", prefill=1, decode=1), {})


def test_up_with_the_internal_token_in_its_environment_serves_and_guards_the_router(tiny_v3_dir, tmp_path):
    """`PDSERVE_INTERNAL_TOKEN=tok pdserve up --api-key k`: the workers require the token and the router inside
    `up` sends it (it did not: every request got UNAVAILABLE), never on a command line; clients need the key."""
    import grpc

    from pdserve.v1 import generate_pb2 as gen_pb
    from pdserve.v1 import generate_pb2_grpc as gen_grpc

    port = free_port()
    log = tmp_path / "up.log"
    up = subprocess.Popen([sys.executable, "-m", "pdserve", "up", "--model", str(tiny_v3_dir), "--port", str(port),
                           "--page-size", "4", "--http-port", "0", "--metrics-port", "0", "--api-key", "k"],
                          cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "PDSERVE_INTERNAL_TOKEN": "tok"})
    try:
        wait_serving(Proc("router", f"127.0.0.1:{port}", up, 0, log), timeout_s=90)
        # (its own: other stacks of the session may serve the same model directory)
        workers = [pid for pid in processes_mentioning(str(tiny_v3_dir)) if parent(pid) == up.pid]
        assert workers and not any("tok" in open(f"/proc/{pid}/cmdline").read().split("\0") for pid in workers)
        req = gen_pb.GenerateRequest(sampling_params=gen_pb.SamplingParams(max_new_tokens=3))
        req.tokenized.input_ids.extend([5, 6, 7])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = gen_grpc.GenerationStub(ch)
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(req, timeout=30))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            got = list(stub.Generate(req, timeout=60, metadata=[("authorization", "Bearer k")]))
        assert got and got[-1].HasField("complete"), got
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(30)



def test_up_hands_its_tensor_parallel_flags_to_its_workers():
    from pdserve.cli import build_parser
    from pdserve.cli.up import engine_flags, role_flags

    flags = engine_flags(build_parser().parse_args(["up", "--tp", "2", "--ep", "2", "--collective-timeout", "7"]))
    assert [flags[flags.index(f) + 1] for f in ("--tp", "--ep", "--collective-timeout")] == ["2", "2", "7.0"]
    # DP attention is the decode tier's (its pools hold the requests' KV); a prefill worker refuses it
    dp = build_parser().parse_args(["up", "--tp", "2", "--dp-attention"])
    assert "--dp-attention" in role_flags(dp, "decode") and "--dp-attention" not in role_flags(dp, "prefill")
    assert "--dp-attention" not in engine_flags(dp)


# ---- how `up` learns its workers' ports ----------------------------------------------------------------------------
# A worker binds a free port itself once it is ready and writes it to a pipe (--port 0 --ready-fd): a port `up` chose
# and the worker bound after its model load and warm-up could be taken meanwhile (by another program, or as the local
# end of any outgoing connection), and the stack would then fail to start.

FAKE_WORKER = """
import os, sys, time
fd = int(sys.argv[sys.argv.index("--ready-fd") + 1])
assert sys.argv[sys.argv.index("--port") + 1] == "0"
mode = os.environ["FAKE_WORKER"]
if mode == "exit":
    sys.exit(3)
if mode == "garbage":
    os.write(fd, b"ready!\\n")
if mode == "port":
    os.write(fd, b"123")
    time.sleep(0.3)  # the line in two writes
    os.write(fd, b"45\\n")
time.sleep(30)
"""


def fake_workers(modes: list[str]):
    from pdserve.cli.up import _start_worker

    return [(f"role{i}", *_start_worker([sys.executable, "-c", FAKE_WORKER], {**os.environ, "FAKE_WORKER": mode},
                                        os.getpid()))
            for i, mode in enumerate(modes)]


@pytest.mark.parametrize("modes, error", [
    (["port", "port"], None),
    (["port", "exit"], "role1 worker 0 exited with status 3 while starting"),
    (["garbage"], "role0 worker 0 (pid "),
    (["silent"], "role0 worker 0 not ready within 1 s (--start-timeout)"),
])
def test_up_reads_each_workers_port_from_its_pipe_and_says_which_failed(modes, error, capsys):
    from pdserve.cli.up import _stop_workers, _wait_workers

    starting = fake_workers(modes)
    try:
        if error is None:
            assert _wait_workers(starting, timeout_s=20) == [12345, 12345]
            assert capsys.readouterr().err.count("worker 127.0.0.1:12345 ready after") == 2
        else:
            with pytest.raises((RuntimeError, TimeoutError)) as err:
                _wait_workers(starting, timeout_s=1)
            assert str(err.value).startswith(error), err.value
            if modes == ["garbage"]:
                assert "wrote no port to its --ready-fd pipe (it wrote b'ready!\\n')" in str(err.value)
    finally:
        _stop_workers([proc for _, proc, _ in starting])
    for _, _, fd in starting:  # _wait_workers closed every pipe
        with pytest.raises(OSError):
            os.fstat(fd)


def test_a_worker_writes_the_port_it_bound_to_its_ready_fd(tiny_v3_dir, tmp_path):
    from pdserve.cli.up import _start_worker, _stop_workers, _wait_workers

    cmd = [sys.executable, "-m", "pdserve", "prefill", "--model", str(tiny_v3_dir), "--page-size", "4"]
    starting = [("prefill", *_start_worker(cmd, {**os.environ, "OMP_NUM_THREADS": "1"}, os.getpid()))]
    try:
        (port,) = _wait_workers(starting, timeout_s=60)
        wait_serving(Proc("prefill", f"127.0.0.1:{port}", starting[0][1], 0, tmp_path / "none.log"), timeout_s=5)
    finally:
        _stop_workers([starting[0][1]])


def test_a_ready_fd_that_is_not_open_is_refused_before_the_model_loads(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pdserve", "decode", "--model", str(tmp_path / "missing"),
                          "--ready-fd", "97"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == "pdserve decode: error: --ready-fd 97: not an open file descriptor (Bad file " \
                                 "descriptor)", out.stderr


def test_up_holds_the_routers_ports_while_its_workers_start_and_leaves_the_workers_metrics_ports_free():
    """While `up` holds them bound, the kernel gives no worker one of the router's ports as its free port."""
    from pdserve.cli import build_parser
    from pdserve.cli.up import _port_taken, check_up_ports

    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    args = build_parser().parse_args(["up", "--port", str(grpc_port), "--http-port", str(http_port),
                                      "--metrics-port", str(metrics_port), "--prefill", "1", "--decode", "1"])
    held = check_up_ports(args)
    try:
        assert sorted(s.getsockname()[1] for s in held) == sorted([grpc_port, http_port, metrics_port])
        assert [_port_taken("127.0.0.1", metrics_port + k) for k in (1, 2)] == [None, None]
    finally:
        for s in held:
            s.close()
    assert _port_taken("127.0.0.1", grpc_port) is None  # the router binds it once `up` lets go


def test_a_progress_line_is_one_write_so_workers_sharing_a_terminal_do_not_run_into_each_other(monkeypatch):
    from pdserve.common import progress

    class Recording:
        writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Recording())
    progress.say("decode worker decode-0 serving on 127.0.0.1:40127")
    progress.stderr_line("pdserve prefill: error: --port: cannot listen")
    assert Recording.writes == ["[pdserve] decode worker decode-0 serving on 127.0.0.1:40127\n",
                                "pdserve prefill: error: --port: cannot listen\n"]
