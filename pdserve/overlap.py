"""Overlap scheduling for decode steps (SGLang's overlap scheduler, for the steady state of decoding): the host
schedules, packs and launches decode step N+1 while the GPU still runs step N, and reads step N's sampled tokens
one step late, so the host's bookkeeping (stop checks, detokenization, outputs, the next step's inputs) hides behind
the GPU's work instead of adding to it.

The host does not know step N's tokens when it builds step N+1, so each request gets a placeholder in its output:
the negative id -(row + 1), row being the request's row in step N. Step N+1's input ids are fixed on the device
just before it runs (`LaunchedDecode.resolve_inputs`: a placeholder becomes that row of step N's sampled tokens),
and the host writes the real token over the placeholder when it reads step N (`LaunchedDecode.read`).

Only plain decode steps overlap (no prompt to admit, no speculation, no logprobs, free pages for every row:
`Scheduler.next_step_decodes_only`); any other step first reads the launched one, then runs in order. A request
that finishes on step N's token (EOS, stop string) got a row in step N+1 all the same: its token is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from pdserve.cuda_streams import current_stream
from pdserve.kv_cache import PageAllocator
from pdserve.request import Request


def placeholder(row: int) -> int:
    """The output id standing for row `row` of the launched step's sampled tokens until the host reads them."""
    return -(row + 1)


@dataclass
class LaunchedDecode:
    """A decode step whose forward and sampling are queued on the device, its tokens not yet read by the host."""

    requests: list[Request]
    output_index: list[int]  # where each row's token goes in its request's output_ids (a placeholder until read)
    tokens: torch.Tensor  # (rows,) int64 on the device: what the sampler drew
    host_tokens: torch.Tensor  # (rows,) their copy for the host (pinned, filled asynchronously on CUDA)
    copied: Optional[torch.cuda.Event]  # passed once host_tokens holds them
    # One reference per row on the page its KV goes to: a request that finishes or is aborted before this step
    # ran frees its pages, and a transfer from another process (CUDA IPC, NCCL) into a page handed out again would
    # race with this step's write. The pages return to the pool when the step has been read.
    held_pages: list[int]
    allocators: Sequence[PageAllocator]  # by DP rank (one pool without DP attention)
    held_ranks: list[int]  # the DP rank whose pool holds each held page

    @classmethod
    def launch(cls, requests: list[Request], tokens: torch.Tensor, allocators: Sequence[PageAllocator],
               page_size: int) -> "LaunchedDecode":
        """Called right after the step's sampling was queued: rows' pages held, placeholders appended.
        allocators: the pools' allocators, by DP rank (one without DP attention)."""
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(current_stream(tokens.device.index))
        else:
            host, copied = tokens, None
        # Each row wrote position num_tokens - 1, its request's last token (before the placeholder below).
        held = [r.pages[(r.num_tokens - 1) // page_size] for r in requests]
        ranks = [r.dp_rank for r in requests]
        _each_pool(allocators, held, ranks, PageAllocator.incref)
        index = []
        for row, r in enumerate(requests):
            index.append(len(r.output_ids))
            r.output_ids.append(placeholder(row))
        return cls(requests, index, tokens, host, copied, held, allocators, ranks)

    def resolver_for(self, requests: list[Request]) -> Callable[[torch.Tensor], None]:
        """What fixes the input ids of the next step's rows `requests` (see resolve_inputs). In the steady state the
        next step's first rows are this step's, in order (new requests after them, finished ones gone at the end):
        then one copy does it, instead of resolve_inputs' six small kernels, each a launch on the decode thread."""
        k, launched = 0, self.requests
        while k < len(requests) and k < len(launched) and requests[k] is launched[k]:
            k += 1
        if any(r.last_token_id < 0 for r in requests[k:]):  # a placeholder further down: rows moved
            return self.resolve_inputs
        tokens = self.tokens
        return lambda input_ids: input_ids[:k].copy_(tokens[:k])

    def resolve_inputs(self, input_ids: torch.Tensor) -> None:
        """The next step's input ids (on the device, before it runs): placeholders -> this step's tokens."""
        rows = (-input_ids - 1).clamp_(0, self.tokens.shape[0] - 1)  # (n,) the row each placeholder stands for
        input_ids.copy_(torch.where(input_ids < 0, self.tokens.index_select(0, rows), input_ids))

    def read(self) -> list[int]:
        """Wait for the step, release its pages; its tokens, one per row (written over nothing: the caller does)."""
        if self.copied is not None:
            self.copied.synchronize()  # releases the GIL while it waits
        tokens = self.host_tokens.tolist()
        _each_pool(self.allocators, self.held_pages, self.held_ranks, PageAllocator.decref)
        self.held_pages = []
        return tokens


def _each_pool(allocators: Sequence[PageAllocator], pages: list[int], ranks: list[int],
               op: Callable[[PageAllocator, list[int]], None]) -> None:
    if len(allocators) == 1:
        op(allocators[0], pages)
        return
    for rank, allocator in enumerate(allocators):
        op(allocator, [p for p, k in zip(pages, ranks) if k == rank])


__all__ = ["LaunchedDecode", "placeholder"]
