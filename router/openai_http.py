"""OpenAI-compatible HTTP front door of the router: `GET /v1/models[/{id}]`, `POST /v1/completions` (one prompt, or
a batch of them as a list of strings or of token-id lists), `POST /v1/chat/completions`, with SSE streaming, `usage`,
`n`, `logprobs` (chat: `logprobs` + `top_logprobs`) and `echo`; `GET /health` and `GET /metrics` (the router's
Prometheus metrics) as vLLM and SGLang serve them.

It runs on the router's asyncio loop, in the router's process (aiohttp), and every request goes through
`Router.generate`, the same path as gRPC's Generate, so both fronts route, check, count and cancel alike. It shares
the gRPC front's security (`--api-key` as `Authorization: Bearer`, the TLS certificate) and its drain (on SIGTERM new
requests get 503, those in flight finish). Errors have OpenAI's body `{"error": {"message", "type", "param",
"code"}}`: bad requests are 400, no KV room 429, no workers 503. A client that disconnects cancels its generation on
both workers.

This module is the server (routes, middlewares, streaming, status codes); reading and checking a request's fields is
router/openai_request.py, building the response objects router/openai_shapes.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import socket
import ssl
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Optional

import grpc
from aiohttp import web

from pdserve.serving.auth import SecurityConfig, token_accepted
from pdserve.serving.grpc_shell import Drain, ServiceError
from pdserve.v1 import generate_pb2 as gen_pb

from .health import router_health
from .openai_request import (ChatTemplate, OpenAIError, ReadRequest, bad, from_service_error, read_body, read_chat,
                             read_completion, unknown_model)
from .openai_shapes import Reply, TokenText
from .server import Router

log = logging.getLogger(__name__)

# X-Accel-Buffering: a buffering reverse proxy (nginx) would otherwise hold tokens back until the end.
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class OpenAIHttpConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0 = a free one
    model_dir: Optional[str] = None  # where tokenizer_config.json (its chat_template) is read
    security: SecurityConfig = SecurityConfig()  # the router's: API keys and TLS certificate apply here too
    shutdown_timeout_s: float = 1.0  # after the router's drain, which already waited for requests in flight


class OpenAIFrontend:
    def __init__(self, router: Router, config: OpenAIHttpConfig, chat_template: Optional[ChatTemplate],
                 drain: Optional[Drain] = None):
        self.router, self.config, self.chat_template = router, config, chat_template
        self.drain = drain or Drain()  # the gRPC server's: one drain for both fronts
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._guard],
                              client_max_size=self.router.config.max_request_bytes)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id:.+}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except OpenAIError as e:
            if e.status == 400:  # counted as the gRPC front counts its rejected requests
                self.router.metrics.count(self.router.metrics.requests, outcome="rejected")
            return error_response(e)
        except ServiceError as e:
            return error_response(from_service_error(e))
        except web.HTTPException as e:  # unknown path, wrong method, body too large: same error shape
            if e.status < 400:
                raise
            return error_response(OpenAIError(e.status, e.reason, code=None))
        except ConnectionError:  # the client is gone: nobody to answer
            raise
        except Exception:  # a bug: still OpenAI's shape, the traceback in the log and no Python text in the body
            log.exception("%s %s failed", request.method, request.path)
            return error_response(OpenAIError(500, "internal error (the router's log has the details)",
                                              code="internal"))

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        """API keys as the gRPC front checks them; refused while draining; counted in the drain while running."""
        keys = self.config.security.api_keys
        if keys:
            auth = request.headers.get("Authorization", "")
            presented = auth[len("Bearer "):] if auth.startswith("Bearer ") else None
            if not token_accepted(presented, keys):
                raise OpenAIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' with one of "
                                       "the router's --api-key values", code="invalid_api_key")
        if request.method != "POST":
            return await handler(request)
        if self.drain.draining:
            raise OpenAIError(503, "this router is draining (shutting down): retry on another one",
                              code="unavailable")
        self.drain.in_flight += 1
        try:
            return await handler(request)
        finally:
            self.drain.in_flight -= 1

    def _model_name(self) -> str:
        return self.router.model_info().model_name

    def _model_card(self) -> dict:
        info = self.router.model_info()
        return {"id": info.model_name, "object": "model", "created": self.created, "owned_by": "pdserve",
                "max_model_len": info.max_context_length}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id} (the openai client's models.retrieve)."""
        card = self._model_card()
        if request.match_info["model_id"] != card["id"]:
            raise unknown_model(request.match_info["model_id"], card["id"])
        return web.json_response(card)

    async def health(self, request: web.Request) -> web.Response:
        """200 when this router can serve (not draining, a healthy prefill and decode worker), else 503 saying why:
        what load balancers and vLLM/SGLang-style health checks expect. The gRPC health check answers from the same
        rule (router/health.py)."""
        health = router_health(self.router.pool, self.drain.draining)
        if not health.serving:
            raise OpenAIError(503, health.reason, code="unavailable")
        return web.json_response({"status": "ok", "workers": health.workers})

    async def metrics(self, request: web.Request) -> web.Response:
        """The router's Prometheus metrics, as on --metrics-port."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return web.Response(body=generate_latest(self.router.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _body(self, request: web.Request) -> dict:
        try:
            raw = await request.read()
        except web.RequestPayloadError:  # a body its Content-Encoding does not describe (not gzip, say)
            raise bad(f"the body cannot be decoded as its Content-Encoding "
                      f"({request.headers.get('Content-Encoding', 'none')}) says") from None
        return await read_body(raw, self.router)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        read = await read_completion(await self._body(request), self.router)
        return await self._respond(request, "text_completion", "cmpl", read)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        read = await read_chat(await self._body(request), self.router, self.chat_template)
        return await self._respond(request, "chat.completion", "chatcmpl", read)

    async def _respond(self, request, kind: str, id_prefix: str, read: ReadRequest) -> web.StreamResponse:
        """n choices for each prompt: choice i*n + j is prompt i's j-th (its index in the response)."""
        prompts, params, opts, n = read.prompts, read.params, read.options, read.n
        rid = uuid.uuid4().hex
        reply = Reply(kind, f"{id_prefix}-{rid}", self._model_name(), opts.return_token_ids,
                      TokenText(self.router.tokenizer), prompts, n)
        # Each choice is a generation of its own; with a seed, a prompt's choice j uses seed + j: distinct and
        # reproducible, and the same for a prompt whether it came alone or in a batch.
        samples = [params if params.seed is None or j == 0 else
                   dataclasses.replace(params, seed=(params.seed + j) % 2**64) for j in range(n)]
        total = len(prompts) * n
        generations = [self.router.generate(p.ids, samples[j], rid if total == 1 else f"{rid}-{i * n + j}")
                       for i, p in enumerate(prompts) for j in range(n)]
        # Closing the merge (whatever ends this handler: the client gone, an error) closes every generation, which
        # drops its request on both workers and frees its pages.
        async with contextlib.aclosing(merged(generations)) as stream:
            if not opts.stream:
                done: dict[int, gen_pb.GenerateComplete] = {}
                async for i, msg in stream:
                    if msg.HasField("complete"):
                        done[i] = msg.complete
                if len(done) != total:
                    raise ServiceError(grpc.StatusCode.INTERNAL, "the generation ended without completing")
                return web.json_response(reply.whole([done[i] for i in range(total)]))
            # The first message is awaited before the headers go out, so failing to start (no workers, no KV
            # room) still gets its own HTTP status instead of an error inside a 200 stream.
            first = await anext(stream)
            resp = web.StreamResponse(headers=SSE_HEADERS)
            await resp.prepare(request)
            for i in range(n):
                if kind == "chat.completion":
                    await send(resp, reply.chunk(i, delta={"role": "assistant", "content": ""}))
            usage: dict[int, gen_pb.Usage] = {}
            try:
                item = first
                while True:
                    i, msg = item
                    if msg.HasField("chunk"):
                        c = msg.chunk
                        if c.prompt_logprobs or (reply.prompt_of(i).echo_text is not None and i not in reply.echoed):
                            await send(resp, reply.echo_chunk(i, list(c.prompt_logprobs)))
                        if c.text or c.logprobs or opts.return_token_ids:
                            await send(resp, reply.chunk(i, text=c.text, token_ids=list(c.token_ids),
                                                         logprobs=list(c.logprobs) if params.logprobs is not None
                                                         else None))
                    if msg.HasField("complete"):
                        await send(resp, reply.chunk(i, finish=msg.complete.finish_reason))
                        usage[i] = msg.complete.usage
                    item = await anext(stream, None)
                    if item is None:
                        break
                if opts.include_usage:
                    await send(resp, reply.usage_chunk([usage[i] for i in sorted(usage)]))
            except ServiceError as e:  # the status is already sent: the error goes in the stream, as OpenAI's
                await send(resp, from_service_error(e).body())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp


async def merged(streams: list) -> AsyncIterator[tuple[int, gen_pb.GenerateResponse]]:
    """(choice index, message) from several generations as they arrive; the first failure ends it. Closing it
    cancels the generations still running."""
    if len(streams) == 1:  # nothing to merge: the generation runs in the caller's task, with no task to cancel
        async with contextlib.aclosing(streams[0]) as only:
            async for msg in only:
                yield 0, msg
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for msg in stream:
                    queue.put_nowait((i, msg, None))
            queue.put_nowait((i, None, None))
        except Exception as e:  # noqa: BLE001 - handed to the reader
            queue.put_nowait((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, st)) for i, st in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, msg, error = await queue.get()
            if error is not None:
                raise error
            if msg is None:
                running -= 1
            else:
                yield i, msg
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def error_response(e: OpenAIError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


async def send(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")


def _tls(security: SecurityConfig) -> Optional[ssl.SSLContext]:
    if not security.tls_cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(security.tls_cert, security.tls_key)
    return context


async def start_openai_http(router: Router, config: OpenAIHttpConfig,
                            drain: Optional[Drain] = None) -> tuple[web.AppRunner, int]:
    """Serve the OpenAI API on the running loop; returns the runner (`await runner.cleanup()` stops it) and the
    bound port. `drain`: the gRPC server's, so that SIGTERM drains both fronts together."""
    frontend = OpenAIFrontend(router, config, ChatTemplate.from_model_dir(config.model_dir), drain)
    # handler_cancellation: a client that disconnects cancels its handler, hence its generation.
    runner = web.AppRunner(frontend.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.port))
    except OSError as e:
        sock.close()
        await runner.cleanup()
        raise OSError(f"--http-port: cannot listen on {config.host}:{config.port}: {e}") from None
    await web.SockSite(runner, sock, shutdown_timeout=config.shutdown_timeout_s,
                       ssl_context=_tls(config.security)).start()
    return runner, sock.getsockname()[1]


__all__ = ["OpenAIHttpConfig", "ChatTemplate", "OpenAIFrontend", "start_openai_http"]
