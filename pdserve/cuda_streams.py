"""The current CUDA stream of a device, for the engine thread's hot path.

`torch.cuda.current_stream()` (and `torch.cuda.Event.record()` without a stream, which calls it) resolves the device
through torch's generic device look-up, an NVML availability check and an environment read included, and builds a
new Stream object each time. A decode step asks for it several times: each pinned upload's event (HostStaging), two
events per timed graph replay (the decode tier's replay clock), the overlap step's copy event: host time added to
every round of a host-bound model. Here it is one C call and a dict look-up: the device index comes from the caller,
and the Stream object of each stream is kept.
"""

from __future__ import annotations

import torch

_streams: dict[tuple[int, int, int], torch.cuda.Stream] = {}  # (stream id, device index, device type) -> its Stream


def current_stream(device_index: int) -> torch.cuda.Stream:
    """torch.cuda.current_stream(device_index): the same stream (`torch.cuda.stream(s)` contexts included)."""
    key = torch._C._cuda_getCurrentStream(device_index)  # (stream id, device index, device type)
    stream = _streams.get(key)
    if stream is None:
        stream = _streams[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
    return stream


def device_index(device: torch.device | str) -> int:
    """The index of a CUDA device ("cuda" alone: the current device)."""
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def make_current(device: torch.device | str) -> None:
    """Make a CUDA `device` the calling thread's current one (nothing on other devices).

    NOTE: the current device is per thread, and a new thread starts on device 0. torch's own ops follow their
    tensors' device, but Triton, FlashInfer and DeepGEMM launch on the current device (and Triton looks its
    pointers up there), so every thread that runs the model on `cuda:N` calls this first."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


__all__ = ["current_stream", "device_index", "make_current"]
