"""The router: serves the client API, tokenizes, picks a prefill and a decode worker per request (prefix ownership
balanced against load), and relays the decode worker's stream to the client."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Optional

import grpc

from pdserve.grpc_shell import ServiceError, abort_with, create_server, invalid, start_serving
from pdserve.metrics import Metrics
from pdserve.prefix_cache import block_hashes
from pdserve.rpc_convert import FINISH_FROM_PROTO, sampling_from_proto, sampling_to_proto
from pdserve.sampling import SamplingParams
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import generate_pb2 as gen_pb
from pdserve.v1 import generate_pb2_grpc as gen_grpc
from pdserve.v1 import worker_pb2 as pb

from .ownership import OwnershipStore, OwnershipUnavailable
from .workers import Worker, WorkerPool, pick_decode, pick_prefill

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 0
    balance_threshold: int = 4  # extra queued requests tolerated on the prefix owner before load wins
    records_ownership: bool = True  # False when prefill workers publish to Redis themselves


class Router:
    def __init__(self, config: RouterConfig, pool: WorkerPool, ownership: OwnershipStore, metrics: Metrics,
                 tokenizer: Optional[Tokenizer]):
        self.config, self.pool, self.ownership, self.metrics, self.tokenizer = (config, pool, ownership, metrics,
                                                                                tokenizer)
        self._ownership_retry_at = 0.0
        self._turn = 0  # round-robin among equally good workers

    # ---- choosing workers --------------------------------------------------------------------------------------
    async def choose(self, prompt_ids: list[int]) -> tuple[Worker, Worker, list[bytes], str]:
        prefills, decodes = self.pool.of_role("prefill"), self.pool.of_role("decode")
        if not prefills or not decodes:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"no healthy workers: {len(prefills)} prefill, {len(decodes)} decode")
        block = prefills[0].info.block_size
        hashes = block_hashes(prompt_ids, block)
        matched: dict[str, int] = {}
        if hashes and time.monotonic() >= self._ownership_retry_at:
            try:
                # Off the event loop: a hung Redis costs this request its socket timeout, not every request.
                matched = await asyncio.to_thread(self.ownership.match, hashes)
            except OwnershipUnavailable as e:  # Redis away: route by load only, never fail the request
                self.metrics.count(self.metrics.redis_errors)
                self._ownership_retry_at = time.monotonic() + 1.0
                log.warning("prefix ownership unavailable, routing by load for 1s: %s", e)
        self._turn += 1
        prefill, reason, _ = pick_prefill(prefills, matched, self.config.balance_threshold, self._turn)
        decode = pick_decode(decodes, self._turn)
        mismatch = prefill.layout.mismatch(decode.layout)
        if mismatch:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"prefill {prefill.address} and decode {decode.address} cannot pair: {mismatch}")
        self.metrics.count(self.metrics.router_decisions, reason=reason)
        return prefill, decode, hashes, reason

    def model_info(self) -> gen_pb.ModelInfo:
        for w in self.pool.workers.values():
            if w.info is not None:
                return w.info.model
        raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no worker has reported yet")

    def prompt_ids(self, request: gen_pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise invalid("prompt: give exactly one of text or tokenized.input_ids")
        if kind == "text":
            return self.encode_text(request.text)
        return self.check_ids(list(request.tokenized.input_ids), "tokenized.input_ids")

    def encode_text(self, text: str, field: str = "text") -> list[int]:
        if not text:
            raise invalid(f"{field}: the prompt is empty")
        if self.tokenizer is None:
            raise invalid(f"{field}: this router has no tokenizer (start it with --model DIR); send token ids")
        return self.check_ids(self.tokenizer.encode(text), field)

    def check_ids(self, ids: list[int], field: str = "input_ids") -> list[int]:
        if not ids:
            raise invalid(f"{field}: the prompt is empty")
        vocab = self.model_info().vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise invalid(f"{field}: token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        return ids

    # ---- one request, start to finish (shared by the gRPC and HTTP fronts) -----------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str = "") -> AsyncIterator[gen_pb.GenerateResponse]:
        """Chunks of new tokens, then one `complete` message. Failures raise ServiceError with the status a client
        should see (a worker's own status is passed through). Cancelling the iteration drops the request on both
        workers."""
        m = self.metrics
        arrival = time.monotonic()
        rid = request_id or uuid.uuid4().hex
        try:
            prefill, decode, hashes, _ = await self.choose(prompt_ids)
        except ServiceError:
            m.count(m.requests, outcome="rejected")
            raise
        outcome = "failed"
        prefill.in_flight += 1
        decode.in_flight += 1
        try:
            async for msg in self._relay(rid, prompt_ids, params, prefill, decode, hashes, arrival):
                yield msg
            outcome = "finished"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "aborted"
            raise
        except grpc.aio.AioRpcError as e:  # a worker's status, passed through
            raise ServiceError(e.code(), e.details() or e.code().name) from None
        finally:
            prefill.in_flight -= 1
            decode.in_flight -= 1
            m.count(m.requests, outcome=outcome)

    async def _relay(self, rid, ids, params, prefill: Worker, decode: Worker, hashes, arrival):
        m = self.metrics
        sp = sampling_to_proto(params)
        reserve: pb.ReserveResponse = await decode.stub.Reserve(
            pb.ReserveRequest(request_id=rid, input_ids=ids, sampling_params=sp))
        decode_call = decode.stub.Decode(pb.DecodeRequest(room=reserve.room))
        prefill_task = asyncio.ensure_future(prefill.stub.Prefill(pb.PrefillRequest(
            request_id=rid, input_ids=ids, sampling_params=sp, room=reserve.room, kv_endpoint=reserve.kv_endpoint,
            dst_pages=reserve.dst_pages, dst_layout=reserve.layout)))
        output_ids: list[int] = []
        text: list[str] = []
        last = None
        try:
            while True:
                read = asyncio.ensure_future(decode_call.read())
                done, _ = await asyncio.wait({read, prefill_task}, return_when=asyncio.FIRST_COMPLETED)
                if prefill_task in done and prefill_task.exception() is not None and read not in done:
                    read.cancel()
                    raise prefill_task.exception()  # decode would only notice at its KV timeout
                msg = await read
                if msg is grpc.aio.EOF:
                    raise ServiceError(grpc.StatusCode.INTERNAL, "decode worker ended the stream without finishing")
                now = time.monotonic()
                if last is None:
                    m.ttft.observe(now - arrival)
                else:
                    m.itl.observe(now - last)
                last = now
                output_ids += msg.token_ids
                text.append(msg.text)
                if msg.token_ids or msg.text:
                    yield gen_pb.GenerateResponse(request_id=rid, chunk=gen_pb.GenerateChunk(
                        token_ids=msg.token_ids, text=msg.text))
                if msg.finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED:
                    resp = await prefill_task
                    self._learn_ownership(prefill, hashes, resp)
                    m.e2e.observe(now - arrival)
                    m.count(m.generated_tokens, len(output_ids))
                    m.count(m.prompt_tokens, len(ids))
                    m.count(m.prefix_hit_tokens, resp.cached_tokens)
                    yield gen_pb.GenerateResponse(request_id=rid, complete=gen_pb.GenerateComplete(
                        output_ids=output_ids, finish_reason=msg.finish_reason, usage=msg.usage,
                        text="".join(text)))
                    return
        finally:
            # On any early exit (client cancel, a worker failing) both workers drop the request and free pages.
            decode_call.cancel()
            if not prefill_task.done():
                prefill_task.cancel()

    def _learn_ownership(self, prefill: Worker, hashes: list[bytes], resp: pb.PrefillResponse) -> None:
        if not self.config.records_ownership or prefill.info is None:
            return
        try:
            if resp.evicted_block_hashes:
                self.ownership.remove(prefill.info.worker_id, list(resp.evicted_block_hashes))
            self.ownership.record(prefill.info.worker_id, hashes)
        except OwnershipUnavailable:
            self.metrics.count(self.metrics.redis_errors)


class GenerationServicer(gen_grpc.GenerationServicer):
    """Thin: protobuf in, Router.generate, protobuf out; errors mapped to their status."""

    def __init__(self, router: Router):
        self.r = router

    async def GetModelInfo(self, request, context) -> gen_pb.ModelInfo:
        try:
            return self.r.model_info()
        except ServiceError as e:
            await abort_with(context, e)

    async def Generate(self, request: gen_pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            ids = self.r.prompt_ids(request)
            params = sampling_from_proto(request.sampling_params)
        except (ServiceError, ValueError) as e:
            self.r.metrics.count(self.r.metrics.requests, outcome="rejected")
            await abort_with(context, e)
        try:
            async for msg in self.r.generate(ids, params, request.request_id):
                yield msg
        except ServiceError as e:
            await abort_with(context, e)


async def start_router(router: Router) -> tuple[grpc.aio.Server, int]:
    server, port = create_server(
        router.config.host, router.config.port, [gen_pb.DESCRIPTOR.services_by_name["Generation"].full_name],
        lambda s: gen_grpc.add_GenerationServicer_to_server(GenerationServicer(router), s))
    await router.pool.start()
    await start_serving(server)
    return server, port


__all__ = ["Router", "RouterConfig", "GenerationServicer", "start_router", "FINISH_FROM_PROTO"]
