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

Extensions beyond OpenAI's fields (as vLLM names them): `top_k`, `ignore_eos`, `stop_token_ids`, and
`return_token_ids`, which adds the generated ids to each choice (`token_ids`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import socket
import ssl
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

import grpc
import jinja2
from aiohttp import web
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdserve.serving.auth import SecurityConfig, token_accepted
from pdserve.serving.grpc_shell import Drain, ServiceError
from pdserve.common.values import MAX_LOGPROBS, SamplingParams
from pdserve.v1 import generate_pb2 as gen_pb

from .health import router_health
from .openai_shapes import Prompt, Reply, TokenText
from .server import MAX_STOP_TOKEN_IDS, Router

log = logging.getLogger(__name__)

HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
               grpc.StatusCode.UNAVAILABLE: 503}
ERROR_TYPE = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
              405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}
# The router names the offending field first ("prompt: the prompt is empty"); in OpenAI's words:
ROUTER_FIELDS = {"prompt": "prompt", "messages": "messages", "sampling_params.max_new_tokens": "max_tokens",
                 "sampling_params.stop_token_ids": "stop_token_ids", "sampling_params.stop": "stop"}
# Request fields pdserve cannot honour, with the values that mean "not used": anything else is a 400, not ignored.
UNSUPPORTED = {"suffix": (None, ""), "logit_bias": (None, {}), "tools": (None, []), "frequency_penalty": (None, 0),
               "presence_penalty": (None, 0), "response_format": (None, {"type": "text"})}
MAX_N = 16  # choices per prompt (each is a generation of its own)
MAX_PROMPTS = 256  # prompts in one /v1/completions request (its batch of strings or token-id lists)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Work that grows with the request runs on a thread beyond these sizes, so one large request does not hold the
# event loop every other client waits on.
INLINE_JSON_BYTES = 64 << 10
INLINE_TEMPLATE_MESSAGES = 64
# X-Accel-Buffering: a buffering reverse proxy (nginx) would otherwise hold tokens back until the end.
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class OpenAIHttpConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0 = a free one
    model_dir: Optional[str] = None  # where tokenizer_config.json (its chat_template) is read
    security: SecurityConfig = SecurityConfig()  # the router's: API keys and TLS certificate apply here too
    shutdown_timeout_s: float = 1.0  # after the router's drain, which already waited for requests in flight


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def response(self) -> web.Response:
        error_type = ERROR_TYPE.get(self.status, "server_error")
        return web.json_response({"error": {"message": str(self), "type": error_type, "param": self.param,
                                            "code": self.code}}, status=self.status)


def bad(message: str, param: Optional[str] = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def from_service_error(e: ServiceError) -> OpenAIError:
    field = re.match(r"([\w.]+)(?:\[\d+\])?:", str(e))  # "prompt[3]:" names prompt 3 of a batch
    param = ROUTER_FIELDS.get(field.group(1)) if field else None
    return OpenAIError(HTTP_STATUS.get(e.code, 500), str(e), param, e.code.name.lower())


class ChatTemplate:
    """The model's `chat_template` from tokenizer_config.json, rendered as transformers does (sandboxed Jinja,
    trim_blocks and lstrip_blocks, `raise_exception`)."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = self._raise
        self._template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    @staticmethod
    def _raise(message: str):
        raise jinja2.TemplateError(message)

    @classmethod
    def from_model_dir(cls, path: Optional[str]) -> Optional["ChatTemplate"]:
        """None when the directory has no tokenizer_config.json or it has no chat_template."""
        config_file = os.path.join(path, "tokenizer_config.json") if path else ""
        if not os.path.isfile(config_file):
            return None
        with open(config_file, encoding="utf-8") as f:
            cfg = json.load(f)
        source = cfg.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not source:
            return None

        def token(value: Any) -> str:
            return value.get("content", "") if isinstance(value, dict) else (value or "")

        return cls(source, token(cfg.get("bos_token")), token(cfg.get("eos_token")))

    def render(self, messages: list[dict]) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token,
                                         eos_token=self.eos_token)
        except jinja2.TemplateError as e:
            raise bad(f"messages: the chat template refused them: {e}", "messages") from None


# ---- reading a request ----------------------------------------------------------------------------------------
def _typed(body: dict, name: str, kinds: tuple, what: str, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise bad(f"{name} must be {what}, got {json.dumps(value)}", name)
    return value


def _number(body: dict, name: str, default: float) -> float:
    try:
        return float(_typed(body, name, (int, float), "a number", default))
    except OverflowError:  # an integer beyond any float
        raise bad(f"{name} must be a finite number", name) from None


def _logprobs(body: dict, chat: bool) -> Optional[int]:
    """Alternatives per token asked for (None: no logprobs). Completions: `logprobs` is that number; chat:
    `logprobs` is a boolean and `top_logprobs` the number."""
    if not chat:
        value = _typed(body, "logprobs", (int,), f"an integer in [0, {MAX_LOGPROBS}]")
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {value}", "logprobs")
        return value
    top = _typed(body, "top_logprobs", (int,), f"an integer in [0, {MAX_LOGPROBS}]")
    if not _typed(body, "logprobs", (bool,), "a boolean", False):
        if top is not None:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
    return top or 0


def num_choices(body: dict) -> int:
    n = _typed(body, "n", (int,), "an integer", 1)
    if not 1 <= n <= MAX_N:
        raise bad(f"n must be an integer in [1, {MAX_N}], got {n}", "n")
    best_of = _typed(body, "best_of", (int,), "an integer", n)
    if best_of != n:
        raise bad("best_of: only best_of equal to n is supported (every generated choice is returned)", "best_of")
    return n


def sampling_params(body: dict, default_max_tokens: int, chat: bool = False) -> SamplingParams:
    for name, unused in UNSUPPORTED.items():
        if body.get(name) not in unused:
            what = ("JSON output (response_format) is not implemented by pdserve; ask for JSON in the prompt or "
                    "leave response_format out" if name == "response_format" else f"{name} is not supported by pdserve")
            raise bad(what, name)
    if chat and body.get("echo") not in (None, False):
        raise bad("echo is only for /v1/completions", "echo")
    logprobs = _logprobs(body, chat)
    echo = not chat and _typed(body, "echo", (bool,), "a boolean", False)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _typed(body, name, (int,), "an integer", default_max_tokens)
    stop = _typed(body, "stop", (str, list), "a string or a list of strings", ())
    stop_token_ids = _typed(body, "stop_token_ids", (list,), "a list of token ids", [])
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:  # before reading them
        raise bad(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids (got {len(stop_token_ids)})", "stop_token_ids")
    if any(not isinstance(t, int) or isinstance(t, bool) for t in stop_token_ids):
        raise bad("stop_token_ids must be a list of token ids", "stop_token_ids")
    try:
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=_number(body, "temperature", 1.0),
            top_p=_number(body, "top_p", 1.0),
            top_k=_typed(body, "top_k", (int,), "an integer", 0),
            seed=_typed(body, "seed", (int,), "an integer"),
            stop=stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=_typed(body, "ignore_eos", (bool,), "a boolean", False),
            logprobs=logprobs,
            prompt_logprobs=logprobs if echo else None)
    except (ValueError, TypeError) as e:  # SamplingParams names its own field first
        field = str(e).split(" ", 1)[0]
        param = name if field == "max_new_tokens" else field
        raise bad(str(e).replace("max_new_tokens", name), param) from None


@dataclass(frozen=True)
class StreamOptions:
    stream: bool
    include_usage: bool
    return_token_ids: bool


def stream_options(body: dict) -> StreamOptions:
    stream = _typed(body, "stream", (bool,), "a boolean", False)
    options = _typed(body, "stream_options", (dict,), "an object", {})
    if options and not stream:
        raise bad("stream_options is only allowed with stream: true", "stream_options")
    return StreamOptions(stream, bool(options.get("include_usage", False)),
                         _typed(body, "return_token_ids", (bool,), "a boolean", False))


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string role", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise bad(f"messages[{i}].content: only text parts are supported", "messages")
            if any(not isinstance(p.get("text", ""), str) for p in content):
                raise bad(f"messages[{i}].content: a text part's text must be a string", "messages")
            content = "".join(p.get("text", "") for p in content)
        if content is not None and not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        out.append({**m, "content": content or ""})
    return out


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def completion_prompts(prompt: Any, router: Router) -> tuple[list, bool]:
    """The prompts of a /v1/completions request, each a string or a list of token ids, and whether they came as a
    batch (a list of strings or of token-id lists, as OpenAI and vLLM take them). Every length is checked before
    the list it measures is read."""
    def length(num_ids: int, field: str) -> None:
        try:
            router.check_length(num_ids, field)
        except ServiceError as e:
            raise from_service_error(e) from None

    shape = "prompt must be a string, a list of token ids, or a list of either (one prompt each)"
    if isinstance(prompt, str):
        return [prompt], False
    if not isinstance(prompt, list):
        raise bad(shape, "prompt")
    if not prompt or not isinstance(prompt[0], (str, list)):  # one prompt of token ids
        length(len(prompt), "prompt")
        if not _is_ids(prompt):
            raise bad(shape, "prompt")
        return [prompt], False
    if len(prompt) > MAX_PROMPTS:
        raise bad(f"prompt: at most {MAX_PROMPTS} prompts per request (got {len(prompt)})", "prompt")
    kind = type(prompt[0])
    for i, p in enumerate(prompt):
        if type(p) is not kind:
            raise bad(f"prompt[{i}]: a batch is all strings or all token-id lists, not both", "prompt")
        if kind is list:
            length(len(p), f"prompt[{i}]")
            if not _is_ids(p):
                raise bad(f"prompt[{i}] must be a list of token ids", "prompt")
    return prompt, True


async def prompt_ids(router: Router, prompt, field: str) -> list[int]:
    """Router.encode_text (a string) / check_ids (token ids), their INVALID_ARGUMENT as a 400 (counted as a rejected
    request)."""
    try:
        if isinstance(prompt, str):
            return await router.encode_text(prompt, field)
        return router.check_ids(prompt, field)
    except ServiceError as e:
        raise from_service_error(e) from None


# ---- the server -----------------------------------------------------------------------------------------------
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
            return e.response()
        except ServiceError as e:
            return from_service_error(e).response()
        except web.HTTPException as e:  # unknown path, wrong method, body too large: same error shape
            if e.status < 400:
                raise
            return OpenAIError(e.status, e.reason, code=None).response()
        except ConnectionError:  # the client is gone: nobody to answer
            raise
        except Exception:  # a bug: still OpenAI's shape, the traceback in the log and no Python text in the body
            log.exception("%s %s failed", request.method, request.path)
            return OpenAIError(500, "internal error (the router's log has the details)", code="internal").response()

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
            raise OpenAIError(404, f"The model `{request.match_info['model_id']}` does not exist; this server "
                                   f"serves `{card['id']}`", "model", "model_not_found")
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
            # A large body is parsed on a thread: json.loads of megabytes would hold the loop every client waits on.
            body = json.loads(raw) if len(raw) <= INLINE_JSON_BYTES else await asyncio.to_thread(json.loads, raw)
        except json.JSONDecodeError as e:
            raise bad(f"the body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
        except UnicodeDecodeError:
            raise bad("the body is not valid JSON: it is not UTF-8 text") from None
        except RecursionError:  # json's parser recurses once per nesting level
            raise bad("the body is not valid JSON that pdserve accepts: arrays or objects are nested too deeply") \
                from None
        except ValueError as e:  # (after the two above, also ValueErrors) an integer literal past Python's limit
            raise bad(f"the body is not valid JSON that pdserve accepts: {str(e).split(':')[0]}") from None
        except web.RequestPayloadError:  # a body its Content-Encoding does not describe (not gzip, say)
            raise bad(f"the body cannot be decoded as its Content-Encoding "
                      f"({request.headers.get('Content-Encoding', 'none')}) says") from None
        if not isinstance(body, dict):
            raise bad("the body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad("model is required: the id from GET /v1/models", "model")
        if model != self._model_name():
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves "
                                   f"`{self._model_name()}`", "model", "model_not_found")
        return body

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        n = num_choices(body)
        given, batch = completion_prompts(body.get("prompt"), self.router)
        if len(given) * n > self.router.config.max_concurrent_requests:
            raise bad(f"prompt: {len(given)} prompts x n={n} are {len(given) * n} generations; this router runs at "
                      f"most {self.router.config.max_concurrent_requests} requests at once "
                      "(--max-concurrent-requests): send fewer per request", "prompt")
        params = sampling_params(body, COMPLETIONS_DEFAULT_MAX_TOKENS)
        echo = bool(body.get("echo"))
        prompts = []
        for i, prompt in enumerate(given):
            field = f"prompt[{i}]" if batch else "prompt"
            ids = await prompt_ids(self.router, prompt, field)
            try:  # every prompt before any generation starts: a stream's status is known before its headers go out
                self.router.check_params(params, len(ids))
            except ServiceError as e:
                raise from_service_error(e if not batch else ServiceError(e.code, f"{e} ({field})")) from None
            # echo: the prompt as sent (text), or the text of its ids
            text = (prompt if isinstance(prompt, str) else self.router.tokenizer.decode(ids) if self.router.tokenizer
                    else "") if echo else None
            prompts.append(Prompt(ids, text))
        return await self._respond(request, "text_completion", "cmpl", prompts, params, stream_options(body), n)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        limit = self.router.model_info().max_context_length
        if isinstance(body.get("messages"), list) and len(body["messages"]) > limit:  # before reading any of them
            raise bad(f"messages: {len(body['messages'])} messages cannot fit the model's context of {limit} tokens",
                      "messages")
        messages = chat_messages(body)
        if self.chat_template is None:
            raise bad("this model has no chat_template in its tokenizer_config.json; use /v1/completions",
                      "messages")
        text = self.chat_template.render(messages) if len(messages) <= INLINE_TEMPLATE_MESSAGES else \
            await asyncio.to_thread(self.chat_template.render, messages)
        ids = await prompt_ids(self.router, text, "messages")
        # OpenAI's default: as many tokens as the context (and this router's --max-new-tokens-limit) allows.
        room = max(1, self.router.model_info().max_context_length - len(ids))
        params = sampling_params(body, min(room, self.router.config.max_new_tokens_limit or room), chat=True)
        return await self._respond(request, "chat.completion", "chatcmpl", [Prompt(ids)], params,
                                   stream_options(body), num_choices(body))

    async def _respond(self, request, kind: str, id_prefix: str, prompts: list[Prompt], params: SamplingParams,
                       opts: StreamOptions, n: int = 1) -> web.StreamResponse:
        """n choices for each prompt: choice i*n + j is prompt i's j-th (its index in the response)."""
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
                err = from_service_error(e)
                await send(resp, {"error": {"message": str(err), "type": ERROR_TYPE.get(err.status, "server_error"),
                                            "param": err.param, "code": err.code}})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp


async def merged(streams: list) -> AsyncIterator[tuple[int, gen_pb.GenerateResponse]]:
    """(choice index, message) from several generations as they arrive; the first failure ends it. Closing it
    cancels the generations still running."""
    if len(streams) == 1:  # no tasks: the generation runs in the caller's task, as before
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
