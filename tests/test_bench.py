"""`pdserve bench` against a 1P1D CPU stack: exit 0, a table, and JSON whose numbers are consistent."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stack import REPO, wait_idle

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(shared_stack):
    return shared_stack  # (conftest.py: one stack of the defaults for the modules that only send requests)


def bench(stack, tmp_path, *args) -> tuple[dict, str, str]:
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "pdserve", "bench", "--target", stack.router.address,
                          "--json", str(out), *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(out.read_text()), run.stdout, run.stderr


def test_bench_poisson_with_shared_prefixes(stack, tmp_path):
    r, table, progress = bench(stack, tmp_path, "--num-prompts", "16", "--input-len", "32", "--output-len", "8",
                               "--range-ratio", "0.5", "--shared-prefix-groups", "2", "--shared-prefix-len", "8",
                               "--request-rate", "20")
    assert r["completed"] == 16 and r["failed"] == 0 and r["errors_by_status"] == {} and r["no_final_status"] == 0
    assert 16 * 4 <= r["total_output_tokens"] <= 16 * 8  # output lengths drawn from [8 * 0.5, 8]
    assert 16 * (8 + 16) <= r["total_input_tokens"] <= 16 * (8 + 32)
    assert 0 < r["ttft"]["mean_ms"] <= r["e2e"]["mean_ms"] and r["ttft"]["median_ms"] <= r["ttft"]["p99_ms"]
    assert r["itl"]["mean_ms"] > 0 and r["tpot"]["mean_ms"] > 0
    assert r["request_throughput"] > 0 and r["output_token_throughput"] > 0 and r["duration_s"] > 0.5  # ~16/20 s
    assert "Request throughput" in table and "TTFT p99 (ms)" in table
    assert "16/16 done" in progress
    for proc in stack.prefill + stack.decode:
        assert wait_idle(proc).num_free_pages == wait_idle(proc).num_total_pages


def test_bench_all_at_once_with_a_concurrency_cap_reports_errors_by_status(stack, tmp_path):
    r, _, _ = bench(stack, tmp_path, "--num-prompts", "6", "--input-len", "16", "--output-len", "4",
                    "--max-concurrency", "2", "--no-progress")
    assert r["completed"] == 6 and r["max_concurrency"] == 2
    # Prompts too long for the model's context (2048) are refused; the report counts them by status.
    r, table, _ = bench(stack, tmp_path, "--num-prompts", "3", "--input-len", "3000", "--output-len", "4",
                        "--no-progress")
    assert r["completed"] == 0 and r["errors_by_status"] == {"INVALID_ARGUMENT": 3}
    assert "context" in r["error_examples"]["INVALID_ARGUMENT"] and "Errors INVALID_ARGUMENT" in table


def test_stage_times_reads_the_ports_up_printed_and_means_over_an_interval(tmp_path):
    from benchmarks.stage_times import interval_means, metrics_ports

    log = tmp_path / "up.log"
    log.write_text("[pdserve] prefill worker p serving on 127.0.0.1:1, metrics on :9101 (ready in 1 s)\n"
                   "  router metrics                     http://127.0.0.1:9100/metrics\n")
    assert metrics_ports(str(log)) == [9100, 9101]
    before = {'pdserve_kv_transfer_seconds_sum{role="prefill"}': 1.0,
              'pdserve_kv_transfer_seconds_count{role="prefill"}': 4.0}
    after = {'pdserve_kv_transfer_seconds_sum{role="prefill"}': 1.5,
             'pdserve_kv_transfer_seconds_count{role="prefill"}': 9.0,
             'pdserve_time_to_first_token_seconds_sum{role="router"}': 0.0,
             'pdserve_time_to_first_token_seconds_count{role="router"}': 0.0}
    assert interval_means(before, after) == {'pdserve_kv_transfer_seconds{role="prefill"}': (0.1, 5)}


def test_bench_prefill_stages_runs_on_the_cpu(tmp_path, trained_model_dir):
    import json

    from benchmarks.bench_prefill_stages import main

    assert main(["--out", str(tmp_path), "--device", "cpu", "--model", str(trained_model_dir), "--lengths", "16",
                 "--iters", "1"]) == 0
    (row,) = json.loads((tmp_path / "prefill_stages.json").read_text())["rows"]
    assert row["prompt_tokens"] == 16 and all(row[k] > 0 for k in ("engine_ms", "mtp_kv_ms", "worker_ms"))


def test_itl_counts_every_token_of_a_message_that_carries_several():
    """A message of n tokens (--stream-interval, a router catching up) is n gaps of 1/n of its wait each."""
    import asyncio

    from pdserve.cli.bench import one_request
    from pdserve.v1 import generate_pb2 as gen_pb

    class Stub:
        def Generate(self, req, timeout, metadata):
            async def stream():
                for sizes in ([1], [2, 3, 4], [5, 6]):
                    await asyncio.sleep(0.02)
                    yield gen_pb.GenerateResponse(chunk=gen_pb.GenerateChunk(token_ids=sizes))
                yield gen_pb.GenerateResponse(complete=gen_pb.GenerateComplete(output_ids=[1, 2, 3, 4, 5, 6]))
            return stream()

    out = asyncio.run(one_request(Stub(), [7, 8], 6, 10.0, ()))
    assert out.status == "OK" and out.output_len == 6
    assert len(out.itls) == 5  # one per token after the first
    assert out.itls[0] == out.itls[1] == out.itls[2] and out.itls[3] == out.itls[4]
    assert sum(out.itls) >= 0.035  # the two waits after the first token, whole
