"""`pdserve up --kv-transport nixl` on the demo model, as a user starts it (UCX over DRAM on the CPU): greedy outputs
equal to the single-process engine's token for token, one request at a time and many at once, the pools idle after,
and the UCX transport logged at pairing and exported with the transfer metrics; --nixl-backend reaches the workers'
agents, and a backend that cannot serve stops a worker at start."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

from golden import check_against_reference, check_concurrently, reference_outputs
from stack import REPO, Proc, free_port, metric, wait_idle
from test_cli_clients import clean_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nixl_up(trained_model_dir, tmp_path_factory):
    """The router's address and the workers (Proc: address, metrics port), read from up's own lines."""
    log = tmp_path_factory.mktemp("nixl-up") / "up.log"
    port = free_port()
    # fp32: batches of other sizes round alike; small prefill steps: prompts are chunked, and the last chunk's layers
    # stream as their forward writes them.
    up = subprocess.Popen([sys.executable, "-m", "pdserve", "up", "--model", str(trained_model_dir), "--port",
                           str(port), "--no-http", "--metrics-port", "0", "--kv-transport", "nixl", "--nixl-backend", "UCX", "--dtype",
                           "float32", "--page-size", "4", "--num-pages", "512", "--max-num-batched-tokens", "16",
                           "--skip-warmup"], cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                          env=clean_env())
    try:
        deadline = time.monotonic() + 120
        while "pdserve is up" not in log.read_text():
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        # (the two workers start side by side: either may log first)
        workers = sorted((Proc(role, address, up, int(metrics), log) for role, address, metrics in re.findall(
            r"(prefill|decode) worker \S+ serving on (\S+?),.* metrics on :(\d+)", log.read_text())),
            key=lambda w: w.role != "prefill")
        assert [w.role for w in workers] == ["prefill", "decode"], log.read_text()[-3000:]
        yield f"127.0.0.1:{port}", workers, log
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(30)


def test_outputs_match_the_single_process_engine_and_the_pools_idle_after(nixl_up, trained_model_dir):
    router, workers, _ = nixl_up
    reference = reference_outputs(trained_model_dir, dtype="float32")
    check_against_reference(router, reference)
    check_concurrently(router, reference, n=16)
    for proc in workers:
        idle = wait_idle(proc)
        assert idle.num_free_pages == idle.num_total_pages, f"{proc.role} {proc.address} holds pages: {idle}"


def test_the_ucx_transport_is_logged_at_pairing_and_labels_the_transfers(nixl_up):
    _, (prefill, _), log = nixl_up
    found = re.search(r"KV pair with decode \S+: over nixl \(UCX: ([^)]+)\)", log.read_text())
    assert found and found.group(1) != "unknown", log.read_text()[-3000:]
    assert metric(prefill.metrics_port, "pdserve_kv_transfer_bytes_total", transport="nixl") > 0
    assert metric(prefill.metrics_port, "pdserve_kv_transfer_links", transport="nixl", link=found.group(1)) == 1
    assert metric(prefill.metrics_port, "pdserve_kv_transfer_failures_total", transport="nixl") == 0


def test_a_backend_nixl_does_not_have_stops_the_worker_at_start_naming_those_it_has(trained_model_dir):
    run = subprocess.run([sys.executable, "-m", "pdserve", "prefill", "--model", str(trained_model_dir), "--device",
                          "cpu", "--kv-transport", "nixl", "--nixl-backend", "NOSUCH", "--skip-warmup"],
                         cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert re.search(r"pdserve prefill: error: NIXL has no NOSUCH backend here \(plugins: .*'UCX'", run.stderr), \
        run.stderr[-2000:]


def test_a_nixl_backend_without_the_nixl_transport_is_refused_before_any_worker_starts(trained_model_dir):
    run = subprocess.run([sys.executable, "-m", "pdserve", "up", "--model", str(trained_model_dir), "--no-http",
                          "--kv-transport", "tcp", "--nixl-backend", "UCX"],
                         cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1] == \
        "pdserve up: error: --nixl-backend UCX is for --kv-transport nixl (here: --kv-transport tcp)"
    assert "worker" not in run.stdout
