"""The staging ring on a GPU (`pdserve.host_staging`): uploads made while the GPU is busy land intact although the
ring reuses its pinned buffers many times over, and they do not wait for the GPU. And the current stream its events
are recorded on (`pdserve.cuda_streams`), which must be torch's own."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.cuda_streams import current_stream
from pdserve.host_staging import HostStaging

pytestmark = pytest.mark.gpu


def test_uploads_behind_queued_work_land_intact_and_do_not_wait():
    staging = HostStaging("cuda", num_buffers=3)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s or more of GPU time queued ahead of every upload below
    start = time.perf_counter()
    first = staging.upload(torch.arange(1000))  # (only 3 buffers: the ring waits before a 4th upload)
    queued_s = time.perf_counter() - start
    uploads = [first] + [staging.upload(torch.arange(i, i + 1000 + i)) for i in range(1, 40)]
    # ...and staged rows read by a copy queued right after, as pack_rows' callers do
    packed = staging.stage(torch.full((7,), 42, dtype=torch.long))
    header = torch.empty(7, dtype=torch.long, device="cuda")
    header.copy_(packed, non_blocking=True)
    later = staging.upload(torch.zeros(5, dtype=torch.long))  # reuses a buffer: only after the copy above read it
    torch.cuda.synchronize()
    assert queued_s < 0.05, f"the first upload waited {queued_s:.3f} s for the GPU"
    for i, got in enumerate(uploads):
        assert torch.equal(got.cpu(), torch.arange(i, i + 1000 + i)), f"upload {i} was overwritten in the ring"
    assert header.tolist() == [42] * 7 and later.tolist() == [0] * 5


def test_current_stream_is_torchs_current_stream_in_and_out_of_a_stream_context():
    index = torch.cuda.current_device()
    assert current_stream(index) == torch.cuda.current_stream(index)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert current_stream(index) == side == torch.cuda.current_stream()
        staging = HostStaging("cuda", num_buffers=2)  # its events go on the side stream: uploads queued there
        got = [staging.upload(torch.arange(i, i + 100)) for i in range(6)]
    assert current_stream(index) == torch.cuda.current_stream() != side
    assert current_stream(index) is current_stream(index)  # kept, not built again
    side.synchronize()
    assert all(torch.equal(g.cpu(), torch.arange(i, i + 100)) for i, g in enumerate(got))
