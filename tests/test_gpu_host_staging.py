"""The staging ring on a GPU (`pdserve.host_staging`): uploads made while the GPU is busy land intact although the
ring reuses its pinned buffers many times over, and they do not wait for the GPU."""

from __future__ import annotations

import time

import pytest
import torch

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
