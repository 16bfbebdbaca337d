"""The prefill tier's engine: computes prompts (chunked, reusing its prefix cache), samples the first token, and
streams the latent KV of every layer to the decode worker that reserved pages for it.

Layer-wise streaming: when a step holds a prompt's final chunk, each layer's KV rows for the whole prompt are
handed to the sender as soon as that layer's forward has written them, so the transfer overlaps the remaining
layers (`layerwise=False` sends them all after the forward instead, to compare). The NextN/MTP layer's KV follows
once the first token is known (its last position needs that token).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from pdserve.engine import LLMEngine
from pdserve.serving.grpc_shell import exhausted
from pdserve.kv_transfer import KVSender
from pdserve.common.blocks import block_hashes
from pdserve.request import FinishReason, Request
from pdserve.sampling import SamplingParams, make_generator


@dataclass
class PrefillJob:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    room: int
    kv_endpoint: str
    dst_pages: list[int]
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass
class PrefillResult:
    request_id: str
    first_token_id: int
    cached_tokens: int
    handle: object  # the transfer's SendHandle: wait() for completion off the engine thread
    ttft_s: float


class PrefillEngine:
    """Wraps an LLMEngine's scheduler and runner; every request ends after its first token."""

    def __init__(self, core: LLMEngine, sender: KVSender,
                 on_blocks: Optional[Callable[[list[bytes]], None]] = None, max_queued: int = 256,
                 layerwise: bool = True):
        self.core, self.sender = core, sender
        self.layerwise = layerwise
        self.max_queued = max_queued  # prompts waiting for compute; a bounded queue answers "full" at once
        self.pool, self.scheduler, self.runner = core.pool, core.scheduler, core.runner
        self.num_main_layers = core.model_config.num_hidden_layers
        self.ships_mtp = core.model.has_mtp_weights  # else the decode side gets no MTP layer (no speculation)
        self.num_layers_sent = self.num_main_layers + (core.model_config.num_nextn_predict_layers if self.ships_mtp
                                                       else 0)
        self.on_blocks = on_blocks  # told the block hashes this worker now holds (ownership publishing)
        self._jobs: dict[str, tuple[PrefillJob, object]] = {}

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_unfinished

    def add(self, job: PrefillJob, handle) -> None:
        if job.request_id in self._jobs:
            raise ValueError(f"request_id {job.request_id!r} is already being prefilled")
        if len(self.scheduler.waiting) >= self.max_queued:
            raise exhausted(f"this prefill worker's queue is full ({self.max_queued} prompts waiting, "
                            "--max-queued-requests); retry later or add prefill workers")
        p = job.params
        # The first token is drawn exactly as the single-process engine would draw it; the generator state then
        # travels with the KV so decode continues the same random stream.
        req = Request(job.request_id, job.prompt_ids,
                      SamplingParams(max_new_tokens=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                     seed=p.seed, ignore_eos=True),
                      arrival_time=job.arrival_time, generator=make_generator(p.seed, self.core.config.device))
        needed = -(-len(job.prompt_ids) // self.pool.page_size)
        if len(job.dst_pages) < needed:
            raise ValueError(f"decode reserved {len(job.dst_pages)} pages but the prompt needs {needed}")
        self.scheduler.add(req)
        self._jobs[job.request_id] = (job, handle)

    def abort(self, request_id: str) -> bool:
        entry = self._jobs.pop(request_id, None)
        if entry is None:
            return False
        self.scheduler.abort(request_id)
        entry[1].abort()
        return True

    def step(self) -> list[PrefillResult]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        final = [c for c in out.prefill if c.samples]
        slots = {c.request.request_id: self.pool.slots_for(c.request.pages, 0, c.request.num_tokens) for c in final}

        def send_layer(layer: int) -> None:
            for c in final:
                # index_select copies, so the sender owns its rows while the pool moves on.
                self._handle(c.request).send_layer(layer, self.pool.kv[layer].index_select(0, slots[c.request.request_id]))

        forward = self.runner.execute(out, layer_done=send_layer if final and self.layerwise else None)
        if final and not self.layerwise:
            for layer in range(self.num_main_layers):
                send_layer(layer)
        if self.ships_mtp:
            self.runner.mtp_extend(out.prefill, forward.extend_hidden)
        results = []
        if forward.requests:
            tokens = self.core.sampler.sample(forward.logits, [r.params for r in forward.requests],
                                              [r.generator for r in forward.requests]).tolist()
            if self.ships_mtp:
                self.runner.mtp_decode(forward.requests, tokens, forward.hidden)
                for req in forward.requests:
                    for j in range(self.num_layers_sent - self.num_main_layers):
                        layer = self.num_main_layers + j
                        self._handle(req).send_layer(layer, self.pool.kv[layer].index_select(0, slots[req.request_id]))
            self.scheduler.update(out)
            now = time.monotonic()
            for req, tok, hidden in zip(forward.requests, tokens, forward.hidden):
                job, handle = self._jobs.pop(req.request_id)
                handle.finish({"first_token_id": tok, "cached_tokens": req.num_cached_tokens,
                               "hidden": hidden.detach().to("cpu", torch.float32).clone(),
                               "rng_state": _rng_state(req.generator)})
                req.output_ids.append(tok)
                self.scheduler.finish(req, FinishReason.LENGTH)
                if self.on_blocks is not None:
                    self.on_blocks(block_hashes(req.prompt_ids, self.pool.page_size))
                results.append(PrefillResult(req.request_id, tok, req.num_cached_tokens, handle,
                                             now - job.arrival_time))
        else:
            self.scheduler.update(out)
        return results

    def _handle(self, req: Request):
        return self._jobs[req.request_id][1]


def _rng_state(gen: Optional[torch.Generator]) -> bytes:
    return b"" if gen is None else gen.get_state().numpy().tobytes()
