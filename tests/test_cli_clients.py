"""The clients of a running stack, against one real `PDSERVE_API_KEY=... pdserve up` on the demo model: the key
from up's environment guards both fronts; `pdserve generate --target` is a thin client (no torch, no engine);
`pdserve bench` drives gRPC and the OpenAI HTTP API, sweeps a load setting and plots it; a target that is not there
(or speaks the other protocol) is one line and exit 2; up on the CPU says nothing of GPUs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest

from pdserve.v1 import generate_pb2 as gen_pb
from pdserve.v1 import generate_pb2_grpc as gen_grpc

from stack import REPO, free_port

pytestmark = pytest.mark.slow

KEY = "abc"


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without PDSERVE_* (a developer's own settings), plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}, "PYTHONUNBUFFERED": "1", **extra}


@pytest.fixture(scope="module")
def stack(trained_model_dir, tmp_path_factory):
    """`PDSERVE_API_KEY=abc pdserve up` on the demo model: gRPC and HTTP ports, as a user starts it."""
    log = tmp_path_factory.mktemp("clients") / "up.log"
    grpc_port, http_port = free_port(), free_port()
    up = subprocess.Popen([sys.executable, "-m", "pdserve", "up", "--model", str(trained_model_dir), "--port",
                           str(grpc_port), "--http-port", str(http_port), "--metrics-port", "0"], cwd=REPO,
                          stdout=open(log, "w"), stderr=subprocess.STDOUT, env=clean_env(PDSERVE_API_KEY=KEY))
    try:
        deadline = time.monotonic() + 120
        while "pdserve is up" not in log.read_text():
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        yield {"grpc": f"127.0.0.1:{grpc_port}", "http": f"http://127.0.0.1:{http_port}", "log": log}
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(30)


def post(url: str, body: dict, key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def pdserve(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=180, env=clean_env(**env))


# ---- the API key in up's environment ---------------------------------------------------------------------------
def test_the_api_key_in_ups_environment_guards_both_fronts(stack):
    body = {"model": "tiny-trained", "prompt": [5, 6, 7], "max_tokens": 3}
    status, answer = post(stack["http"] + "/v1/completions", body)
    assert status == 401, answer
    status, answer = post(stack["http"] + "/v1/completions", body, key="wrong")
    assert status == 401, answer
    status, answer = post(stack["http"] + "/v1/completions", body, key=KEY)
    assert status == 200 and answer["usage"]["completion_tokens"] == 3, answer
    req = gen_pb.GenerateRequest(sampling_params=gen_pb.SamplingParams(max_new_tokens=2))
    req.tokenized.input_ids.extend([5, 6, 7])
    with grpc.insecure_channel(stack["grpc"]) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            list(gen_grpc.GenerationStub(channel).Generate(req, timeout=30))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


# ---- generate --target -----------------------------------------------------------------------------------------
THIN_CLIENT = """
import sys
from pdserve.cli import main
code = main(sys.argv[1:])
heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.") or m in ("pdserve.engine",
               "pdserve.model", "pdserve.kernels", "pdserve.scheduler"))
print("HEAVY", heavy, file=sys.stderr)
sys.exit(code)
"""


def test_generate_target_is_a_thin_client_that_imports_no_torch(stack):
    args = ["generate", "--target", stack["grpc"], "--input-ids", "5,6,7,8", "--max-new-tokens", "6",
            "--ignore-eos", "--json"]
    out = subprocess.run([sys.executable, "-c", THIN_CLIENT, *args], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env=clean_env(PDSERVE_API_KEY=KEY))  # the key a client takes from its env too
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stderr, out.stderr
    got = json.loads(out.stdout)
    assert len(got["output_ids"]) == 6 and got["finish_reason"] == "length" and got["prompt_tokens"] == 4
    refused = pdserve(*args)  # no key
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "UNAUTHENTICATED" in refused.stderr


# ---- bench -------------------------------------------------------------------------------------------------------
SMALL = ["--num-prompts", "4", "--input-len", "12", "--output-len", "5", "--no-progress"]


def bench(tmp_path, *args: str) -> tuple[dict, str]:
    out = pdserve("bench", *SMALL, "--json", str(tmp_path / "bench.json"), "--plot", str(tmp_path / "sweep.png"),
                  *args, PDSERVE_API_KEY=KEY)
    assert out.returncode == 0, out.stderr[-3000:]
    png = (tmp_path / "sweep.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000  # three panels drawn, not an empty canvas
    return json.loads((tmp_path / "bench.json").read_text()), out.stdout


def check_run(run: dict, backend: str) -> None:
    assert run["backend"] == backend and run["completed"] == 4 and run["failed"] == 0, run
    assert run["total_output_tokens"] == 4 * 5 and run["total_input_tokens"] == 4 * 12  # ignore_eos: every token
    assert 0 < run["ttft"]["mean_ms"] <= run["e2e"]["mean_ms"]
    assert run["itl"]["mean_ms"] > 0 and run["tpot"]["mean_ms"] > 0 and run["output_token_throughput"] > 0


def test_bench_sweeps_concurrency_over_grpc_and_plots_it(stack, tmp_path):
    result, table = bench(tmp_path, "--target", stack["grpc"], "--max-concurrency", "1", "2")
    assert result["sweep"] == "max_concurrency" and [r["max_concurrency"] for r in result["runs"]] == [1, 2]
    for run in result["runs"]:
        check_run(run, "grpc")
    assert "pdserve bench sweep" in table and "max concurrency" in table


def test_bench_drives_the_openai_http_api_and_sweeps_the_rate(stack, tmp_path):
    result, table = bench(tmp_path, "--target", stack["http"], "--request-rate", "50", "inf")
    assert result["sweep"] == "request_rate" and [r["request_rate"] for r in result["runs"]] == [50, float("inf")]
    for run in result["runs"]:
        check_run(run, "openai")
    assert "request rate" in table


def test_bench_without_the_key_is_one_line(stack, tmp_path):
    out = pdserve("bench", *SMALL, "--target", stack["http"], "--json", str(tmp_path / "r.json"))
    # GET /v1/models is guarded like everything but /health: a missing key is the user's error, one line
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "HTTP 401" in out.stderr, out.stderr


@pytest.mark.parametrize("how", ["nothing listens", "grpc at the http port", "http at the grpc port"])
def test_bench_at_a_target_that_is_not_there_is_one_line(stack, how):
    target = {"nothing listens": f"127.0.0.1:{free_port()}", "grpc at the http port": stack["http"][len("http://"):],
              "http at the grpc port": "http://" + stack["grpc"]}[how]
    out = pdserve("bench", *SMALL, "--target", target, PDSERVE_API_KEY=KEY)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"pdserve bench: error: --target {target}: no "), line
    if how == "grpc at the http port":
        assert "--target http://HOST:PORT" in line
    if how == "http at the grpc port":
        assert "--backend grpc" in line


def test_bench_plot_without_matplotlib_says_so_before_running(stack, tmp_path):
    """A folder first on the path whose matplotlib fails to import, as where it is not installed."""
    fake = tmp_path / "site"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    out = pdserve("bench", *SMALL, "--target", f"127.0.0.1:{free_port()}", "--plot", str(tmp_path / "p.png"),
                  PYTHONPATH=str(fake))
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "--plot" in out.stderr and "pip install matplotlib" in out.stderr and not (tmp_path / "p.png").exists()


# ---- up on the CPU ----------------------------------------------------------------------------------------------
def test_up_on_the_cpu_says_nothing_of_gpus(stack):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU machine")
    text = stack["log"].read_text()
    assert "prefill worker 0 on cpu, decode worker 0 on cpu" in text, text[:2000]
    for gpu_talk in ("GPU's time", "CUDA graph", "on auto"):
        assert gpu_talk not in text, gpu_talk
