"""The disaggregated path with the KV rows WRITTEN over NIXL (`--kv-transport nixl`, UCX over DRAM on the CPU):
router + prefill + decode as real processes on the demo model, greedy outputs equal to the single-process engine's
token for token, one request at a time and many at once, the pools idle after, and the UCX transport logged at
pairing and exported with the transfer metrics."""

from __future__ import annotations

import re

import pytest

from golden import check_against_reference, check_concurrently, reference_outputs
from stack import metric, start_stack, wait_idle

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nixl_stack(trained_model_dir, tmp_path_factory):
    # Small prefill steps: prompts are chunked, and the last chunk's layers stream as their forward writes them.
    stack = start_stack(trained_model_dir, tmp_path_factory.mktemp("logs-nixl"),
                        engine_args=["--kv-transport", "nixl", "--dtype", "float32", "--max-num-batched-tokens", "16"])
    yield stack
    stack.stop()


def test_outputs_match_the_single_process_engine_and_the_pools_idle_after(nixl_stack, trained_model_dir):
    reference = reference_outputs(trained_model_dir, dtype="float32")  # batches of other sizes round alike
    check_against_reference(nixl_stack.router.address, reference)
    check_concurrently(nixl_stack.router.address, reference, n=16)
    for proc in nixl_stack.prefill + nixl_stack.decode:
        idle = wait_idle(proc)
        assert idle.num_free_pages == idle.num_total_pages, f"{proc.role} {proc.address} holds pages: {idle}"


def test_the_ucx_transport_is_logged_at_pairing_and_labels_the_transfers(nixl_stack):
    prefill = nixl_stack.prefill[0]
    found = re.search(r"KV pair with decode \S+: over nixl \(UCX: ([^)]+)\)", prefill.log_path.read_text())
    assert found and found.group(1) != "unknown", prefill.log_path.read_text()[-2000:]
    assert metric(prefill.metrics_port, "pdserve_kv_transfer_bytes_total", transport="nixl") > 0
    assert metric(prefill.metrics_port, "pdserve_kv_transfer_links", transport="nixl", link=found.group(1)) == 1
    assert metric(prefill.metrics_port, "pdserve_kv_transfer_failures_total", transport="nixl") == 0
