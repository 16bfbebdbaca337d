"""The router: serves the client API, tokenizes, picks a prefill and a decode worker per request (prefix ownership
balanced against load), and relays the decode worker's stream to the client."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Optional

import grpc

from pdserve.serving.auth import BearerAuthInterceptor
from pdserve.serving.grpc_shell import (
    MAX_MESSAGE_BYTES, Drain, ServiceError, abort_with, create_server, exhausted, invalid, start_serving,
)
from pdserve.serving.metrics import Metrics
from pdserve.common.blocks import block_hashes
from pdserve.common.trace import mark
from pdserve.serving.rpc_convert import FINISH_FROM_PROTO, sampling_from_proto
from pdserve.common.values import SamplingParams
from pdserve.common.tokenizer import Tokenizer
from pdserve.v1 import generate_pb2 as gen_pb
from pdserve.v1 import generate_pb2_grpc as gen_grpc
from pdserve.v1 import worker_pb2 as pb

from pdserve.cluster.ownership import OwnershipStore, OwnershipUnavailable
from .call_failed import CallFailed
from .decode_streams import DecodeStreams
from .health import follow_health, router_health
from .prefill_streams import PrefillStreams
from .relay import Relay, RelayLinks, RelayRequest
from .request_checks import MAX_STOP_TOKEN_IDS, RequestChecks
from .warm_pairs import keep_pairs_warm, warm_pairs
from .workers import Worker, WorkerDown, WorkerPool, pick_decode, pick_prefill

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 0
    balance_threshold: int = 4  # extra queued requests tolerated on the prefix owner before load wins
    records_ownership: bool = True  # False when prefill workers publish to Redis themselves
    max_new_tokens_limit: Optional[int] = None  # per request; None: only the model's context bounds it
    max_concurrent_requests: int = 1024  # requests in flight on this router; beyond: RESOURCE_EXHAUSTED
    max_request_bytes: int = 16 << 20  # largest GenerateRequest accepted (gRPC answers RESOURCE_EXHAUSTED)
    tokenize_threads: int = 2  # long text prompts tokenized at once (the others wait their turn)
    # After the first token (sent at once: TTFT), new tokens a client gets per message at least (a request's last
    # message may carry fewer): fewer, larger messages for the router and its clients at high concurrency, like
    # SGLang's --stream-interval. 1: each batch of tokens as it arrives (several when the router runs behind).
    stream_interval: int = 1
    # Send one request of the router's own through each prefill/decode pair before serving, and through each new pair
    # as it appears (router/warm_pairs.py): no client request pays for a pair's KV connection.
    warm_pairs: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens_limit is not None and self.max_new_tokens_limit < 1:
            raise ValueError(f"--max-new-tokens-limit must be >= 1, got {self.max_new_tokens_limit}")
        if self.max_concurrent_requests < 1:
            raise ValueError(f"--max-concurrent-requests must be >= 1, got {self.max_concurrent_requests}")
        if self.tokenize_threads < 1:
            raise ValueError(f"--tokenize-threads must be >= 1, got {self.tokenize_threads}")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, got {self.stream_interval}")


class Router:
    """Request checks (`checks`, request_checks.py: nothing invalid reaches a worker), admission (concurrency limit,
    unique in-flight ids), the choice of a prefill and a decode worker per request, and its attempt on them (a
    `Relay`, relay.py), retried once on other workers if one was unreachable before any token reached the client."""

    def __init__(self, config: RouterConfig, pool: WorkerPool, ownership: OwnershipStore, metrics: Metrics,
                 tokenizer: Optional[Tokenizer]):
        self.config, self.pool, self.ownership, self.metrics, self.tokenizer = (config, pool, ownership, metrics,
                                                                                tokenizer)
        self._ownership_retry_at = 0.0
        self._turn = 0  # round-robin among equally good workers
        self._unpairable: set[str] = set()  # workers no worker of the other role can pair with (logged once)
        self._in_flight_ids: set[str] = set()  # client-given ids of requests running now
        self.num_active = 0
        self.checks = RequestChecks(self.model_info, tokenizer, config.max_new_tokens_limit, config.tokenize_threads)
        self.decode_streams = DecodeStreams(pool.metadata, pool.seen)  # one DecodeStream call per decode worker
        self.prefill_streams = PrefillStreams(pool.metadata, pool.seen)  # one PrefillStream call per prefill one
        self.relay_links = RelayLinks(self.prefill_streams, self.decode_streams, pool.metadata, config.stream_interval,
                                      tokenizer, self.model_info, self._learn_ownership)
        self._uncounted = Metrics.create("router")  # never exported: the router's own requests (relay_uncounted)
        self.warm_task: Optional[asyncio.Task] = None  # keep_pairs_warm, from start_router
        self.health_task: Optional[asyncio.Task] = None  # follow_health, from start_router
        self._model_name = ""  # the workers' model, kept once one has reported (the metrics' model_name label)
        metrics.name_model(self._model_name_label)

    # ---- choosing workers --------------------------------------------------------------------------------------
    async def choose(self, prompt_ids: list[int], avoid: frozenset[str] = frozenset(),
                     deadline: Optional[float] = None) -> tuple[Worker, Worker, Optional[list[bytes]], str]:
        """avoid: addresses to skip when another worker of the same role is healthy (the retry of a request).
        deadline: the request's (monotonic), which bounds the wait for a healthy worker."""
        if not (self.pool.of_role("prefill") and self.pool.of_role("decode")):
            # Workers may be restarting or briefly out: wait for them within the request's deadline, up to a bound.
            limit = time.monotonic() + self.pool.health.wait_for_worker_s
            await self.pool.wait_for(("prefill", "decode"), limit if deadline is None else min(limit, deadline))
        prefills, decodes = (_prefer_others(self.pool.of_role(role), avoid) for role in ("prefill", "decode"))
        if not prefills or not decodes:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"no healthy workers: {len(prefills)} prefill, {len(decodes)} decode")
        prefills, decodes = self._pairable(prefills, decodes)
        block = prefills[0].info.block_size
        # The first block's owners first: where no worker holds it (a fresh prompt) none holds a longer prefix, and
        # the prompt's other keys are made once the request is done (`_learn_ownership`), off its first token's way
        # (hashing a whole long prompt costs host time, and on Redis one lookup per block instead of one).
        hashes: Optional[list[bytes]] = block_hashes(prompt_ids[:block], block)
        matched = await self._owners(hashes) if hashes else {}
        if len(prompt_ids) >= 2 * block:  # keys beyond the first one: all of them where it is held, else later
            hashes = block_hashes(prompt_ids, block) if matched else None
            if matched:
                matched = await self._owners(hashes)
        self._turn += 1
        prefill, reason, _ = pick_prefill(prefills, matched, self.config.balance_threshold, self._turn)
        decode = pick_decode([d for d in decodes if d.layout == prefill.layout], self._turn)
        self.metrics.count(self.metrics.router_decisions, reason=reason)
        return prefill, decode, hashes, reason

    def _pairable(self, prefills: list[Worker], decodes: list[Worker]) -> tuple[list[Worker], list[Worker]]:
        """The workers that can pair with some worker of the other role (the same KV layout): one that joined with
        another model, page size or dtype is never chosen, rather than chosen and failing every request it gets
        (it looks least busy, since its requests fail at once). Logged and counted once per worker."""
        prefill_layouts, decode_layouts = {w.layout for w in prefills}, {w.layout for w in decodes}
        ok_p = [w for w in prefills if w.layout in decode_layouts]
        ok_d = [w for w in decodes if w.layout in prefill_layouts]
        if not ok_p or not ok_d:
            p, d = prefills[0], decodes[0]
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"no prefill and decode worker can pair: e.g. prefill {p.address} and decode "
                               f"{d.address}: {p.layout.mismatch(d.layout)}")
        for w, names, others in [(w, ("prefill", "decode"), ok_d) for w in prefills if w not in ok_p] + \
                [(w, ("decode", "prefill"), ok_p) for w in decodes if w not in ok_d]:
            if w.address not in self._unpairable:
                self._unpairable.add(w.address)
                self.metrics.count(self.metrics.workers_down, reason="incompatible")
                log.warning("%s worker %s is not routed to: it cannot pair with any %s worker (%s)", names[0],
                            w.address, names[1], w.layout.mismatch(others[0].layout, names))
        self._unpairable -= {w.address for w in ok_p + ok_d}  # one that can pair now is routed again
        return ok_p, ok_d

    async def _owners(self, hashes: list[bytes]) -> dict[str, int]:
        """The ownership store's match of a prompt's leading blocks; {} while it is away."""
        if time.monotonic() < self._ownership_retry_at:
            return {}
        try:
            if self.ownership.blocking:
                # Off the event loop: a hung Redis costs this request its socket timeout, not every request.
                return await asyncio.to_thread(self.ownership.match, hashes)
            return self.ownership.match(hashes)
        except OwnershipUnavailable as e:  # Redis away: route by load only, never fail the request
            self.metrics.count(self.metrics.redis_errors)
            self._ownership_retry_at = time.monotonic() + 1.0
            log.warning("prefix ownership unavailable, routing by load for 1s: %s", e)
            return {}

    def _model_name_label(self) -> str:
        """The model's name as the workers report it, kept when they are away so that the series keep their labels;
        "" until one has reported."""
        if not self._model_name:
            try:
                self._model_name = self.model_info().model_name
            except ServiceError:
                pass
        return self._model_name

    def model_info(self) -> gen_pb.ModelInfo:
        for w in self.pool.workers.values():
            if w.info is not None:
                return w.info.model
        raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no worker has reported yet")

    # ---- one request, start to finish (shared by the gRPC and HTTP fronts) -----------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str = "",
                       timeout_s: Optional[float] = None) -> AsyncIterator[gen_pb.GenerateResponse]:
        """Chunks of new tokens, then one `complete` message. Failures raise ServiceError with the status a client
        should see (a worker's own status is passed through). `timeout_s`: the client's remaining deadline, passed
        on to every worker call. Cancelling the iteration drops the request on both workers."""
        m = self.metrics
        arrival = time.monotonic()
        deadline = None if timeout_s is None else arrival + timeout_s
        try:
            self.checks.check_ids(prompt_ids, "prompt")  # again here: the HTTP front calls generate() directly
            self.checks.check_params(params, len(prompt_ids))
            self.checks.check_request_id(request_id)
            if request_id and request_id in self._in_flight_ids:
                raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {request_id!r} is already in "
                                   "flight on this router; give each request its own id")
            if self.num_active >= self.config.max_concurrent_requests:
                raise exhausted(f"the router is at its limit of {self.config.max_concurrent_requests} concurrent "
                                "requests (--max-concurrent-requests); retry later")
        except ServiceError:
            m.count(m.requests, outcome="rejected")
            raise
        rid = request_id or uuid.uuid4().hex
        mark("router.recv", rid)
        self.num_active += 1
        if request_id:
            self._in_flight_ids.add(request_id)
        outcome = "failed"
        try:
            tried: frozenset[str] = frozenset()
            for attempt in range(2):
                prefill, decode, hashes, _ = await self.choose(prompt_ids, avoid=tried, deadline=deadline)
                streamed = False
                prefill.in_flight += 1
                decode.in_flight += 1
                try:
                    # Workers see one id per attempt, so a retry never collides with the first try's leftovers.
                    internal_id = rid if attempt == 0 else f"{rid}-retry{attempt}"
                    mark("router.routed", internal_id)
                    relay = Relay(self.relay_links, RelayRequest(internal_id, prompt_ids, params, hashes, arrival,
                                                                 deadline), prefill, decode, m)
                    async for msg in relay.run():
                        streamed = True
                        msg.request_id = rid
                        if msg.HasField("complete"):
                            # NOTE: before the yield: a caller that stops reading after the complete message (the
                            # HTTP front) closes this generator at the yield, which must not count as an abort.
                            outcome = "finished"
                        yield msg
                    outcome = "finished"
                    return
                except (grpc.aio.AioRpcError, CallFailed, WorkerDown) as e:  # a worker's status, passed on
                    # (or retried)
                    code, details = ((grpc.StatusCode.UNAVAILABLE, str(e)) if isinstance(e, WorkerDown)
                                     else (e.code(), e.details()))
                    if code == grpc.StatusCode.UNAVAILABLE:
                        self.pool.poll_soon(prefill, decode)
                    if code == grpc.StatusCode.UNAVAILABLE and not streamed and attempt == 0:
                        log.warning("request %s: %s; retrying once on other workers", rid, details)
                        m.count(m.router_decisions, reason="retry")
                        tried = frozenset({prefill.address, decode.address})
                        continue
                    raise ServiceError(code, details or code.name) from None
                finally:
                    prefill.in_flight -= 1
                    decode.in_flight -= 1
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "aborted"
            raise
        finally:
            self.num_active -= 1
            self._in_flight_ids.discard(request_id)
            m.count(m.requests, outcome=outcome)

    def relay_uncounted(self, rid: str, ids: list[int], params: SamplingParams, prefill: Worker, decode: Worker,
                        deadline: float) -> AsyncIterator[gen_pb.GenerateResponse]:
        """A request of the router's own (warm_pairs.py) through a given pair, kept out of the exported metrics."""
        request = RelayRequest(rid, ids, params, [], time.monotonic(), deadline)
        return Relay(self.relay_links, request, prefill, decode, self._uncounted).run()

    def _learn_ownership(self, prefill: Worker, ids: list[int], hashes: Optional[list[bytes]],
                         resp: pb.PrefillResponse) -> None:
        """`hashes`: the keys of the prompt `ids`'s blocks that `prefill` now holds; None: made here (see choose)."""
        if not self.config.records_ownership or prefill.info is None:
            return
        if hashes is None:
            hashes = block_hashes(ids, prefill.info.block_size)
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
        r = self.r
        try:
            if len(request.sampling_params.stop_token_ids) > MAX_STOP_TOKEN_IDS:  # before converting them
                raise invalid(f"sampling_params.stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids (got "
                              f"{len(request.sampling_params.stop_token_ids)})")
            ids = await r.checks.prompt_ids(request)
            params = sampling_from_proto(request.sampling_params)
            if not request.sampling_params.HasField("max_new_tokens"):
                params = dataclasses.replace(params, max_new_tokens=r.checks.default_max_new_tokens(len(ids)))
        except (ServiceError, ValueError) as e:
            r.metrics.count(r.metrics.requests, outcome="rejected")
            await abort_with(context, e)
        try:
            async for msg in r.generate(ids, params, request.request_id, timeout_s=context.time_remaining()):
                yield msg
        except ServiceError as e:
            await abort_with(context, e)


async def start_router(router: Router) -> tuple[grpc.aio.Server, int]:
    security = router.pool.security
    options = [("grpc.max_receive_message_length", router.config.max_request_bytes),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
    auth = [BearerAuthInterceptor(security.api_keys, "--api-key")] if security.api_keys else []
    server, port = create_server(
        router.config.host, router.config.port, [gen_pb.DESCRIPTOR.services_by_name["Generation"].full_name],
        lambda s: gen_grpc.add_GenerationServicer_to_server(GenerationServicer(router), s), options=options,
        interceptors=auth, drain=Drain(tracked={"Generate"}, refused={"Generate"}),
        credentials=security.server_credentials(), prechecks={"Generate": router.checks.check_request_bytes})
    await router.pool.start()
    if router.config.warm_pairs:  # before it serves: no client request pays for a pair's KV connection
        vocab_size = lambda: router.model_info().vocab_size  # noqa: E731
        await warm_pairs(router.pool, router.relay_uncounted, vocab_size)
        router.warm_task = asyncio.create_task(keep_pairs_warm(router.pool, router.relay_uncounted, vocab_size))
    # grpc.health.v1 says what HTTP /health says (router/health.py): NOT_SERVING while no worker pair is healthy.
    serving = router_health(router.pool, draining=False).serving
    await start_serving(server, serving)
    router.health_task = asyncio.create_task(follow_health(server, router.pool, serving))
    return server, port


def _prefer_others(workers: list[Worker], avoid: frozenset[str]) -> list[Worker]:
    others = [w for w in workers if w.address not in avoid]
    return others or workers


__all__ = ["Router", "RouterConfig", "GenerationServicer", "start_router", "FINISH_FROM_PROTO"]
