"""Small host-to-device uploads that never wait for the GPU, through a ring of reusable pinned buffers.

Every engine step uploads a few KB the host just built (token ids, positions, KV slots, page tables). From pageable
memory a copy waits until the GPU drained the stream (a blocking copy syncs; an asynchronous one from pageable memory
is staged by the driver behind queued work), which stalls a launch-bound step. Pinning each upload afresh
(`tensor.pin_memory()`) avoids that, but costs the engine thread more host time than anything else it does per upload: an
allocation from the pinned caching allocator, its events, and the copy. Here each
upload is one memcpy into the next buffer of a ring, allocated once.

A buffer is reused `num_buffers` stagings later, and only once the GPU has passed the point where the stage after it
was made: every copy out of a staged buffer queued on the device's current stream before the next `stage` call is
covered (the callers queue theirs at once). One ring per engine thread: it is not thread-safe.
"""

from __future__ import annotations

from typing import Optional

import torch

from pdserve.cuda_streams import current_stream, device_index


class HostStaging:
    def __init__(self, device: torch.device | str, num_buffers: int = 8):
        self.device = torch.device(device)
        self._device_index = device_index(self.device) if self.device.type == "cuda" else -1
        self._buffers: list[Optional[torch.Tensor]] = [None] * num_buffers  # pinned uint8, grown on demand
        self._events: list[Optional[torch.cuda.Event]] = [None] * num_buffers  # passed: copies out of it are done
        self._next = 0
        self._last: Optional[int] = None  # the buffer staged last, whose event the next stage records

    def stage(self, values: torch.Tensor) -> torch.Tensor:
        """A pinned copy of `values` (a contiguous CPU tensor), valid until the ring comes back to its buffer; on a
        CPU device, `values` itself. Queue the copies out of it before the next call."""
        if self.device.type != "cuda":
            return values
        assert values.device.type == "cpu" and values.is_contiguous(), "stage() takes a contiguous CPU tensor"
        if self._last is not None:  # everything queued since that stage, its copies included, is before this
            event = self._events[self._last]
            if event is None:
                event = self._events[self._last] = torch.cuda.Event()
            event.record(current_stream(self._device_index))
        i = self._next
        self._next, self._last = (i + 1) % len(self._buffers), i
        if self._events[i] is not None:
            self._events[i].synchronize()  # NOTE: passed long ago in practice: num_buffers stages back
        nbytes = values.numel() * values.element_size()
        buf = self._buffers[i]
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[i] = torch.empty(max(nbytes, 2 * (0 if buf is None else buf.numel()), 4096),
                                                 dtype=torch.uint8, pin_memory=True)
        staged = buf[:nbytes].view(values.dtype).view(values.shape)
        staged.copy_(values)
        return staged

    def upload(self, values: torch.Tensor) -> torch.Tensor:
        """`values` (a CPU tensor) on the device, queued on the current stream without waiting for the GPU."""
        if self.device.type != "cuda":
            return values.to(self.device)
        return self.stage(values.contiguous()).to(self.device, non_blocking=True)
