"""Reading an OpenAI request: its JSON body, its prompts (completions: one or a batch, text or token ids; chat: the
messages rendered by the model's chat template), its sampling fields and its stream options, each checked against the
field it came from. A request that reads is a `ReadRequest` for the HTTP server (router/openai_http.py) to generate;
one that does not is an `OpenAIError`: OpenAI's error body and the HTTP status it answers with (a client's mistake is a
4xx naming its field, never a 500).

Extensions beyond OpenAI's fields (as vLLM names them): `top_k`, `ignore_eos`, `stop_token_ids`, and
`return_token_ids`, which adds the generated ids to each choice (`token_ids`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

import grpc
import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdserve.common.values import MAX_LOGPROBS, SamplingParams
from pdserve.serving.grpc_shell import ServiceError

from .openai_shapes import Prompt
from .request_checks import MAX_STOP_TOKEN_IDS
from .server import Router

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


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        """OpenAI's error object: the whole body of an error response, or an event of a stream that already began."""
        return {"error": {"message": str(self), "type": ERROR_TYPE.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def bad(message: str, param: Optional[str] = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def from_service_error(e: ServiceError) -> OpenAIError:
    field = re.match(r"([\w.]+)(?:\[\d+\])?:", str(e))  # "prompt[3]:" names prompt 3 of a batch
    param = ROUTER_FIELDS.get(field.group(1)) if field else None
    return OpenAIError(HTTP_STATUS.get(e.code, 500), str(e), param, e.code.name.lower())


async def read_body(raw: bytes, router: Router) -> dict:
    """The request's JSON object, which names the model this router serves."""
    try:
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
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    asked = body.get("model")
    if not isinstance(asked, str) or not asked:
        raise bad("model is required: the id from GET /v1/models", "model")
    if asked != router.model_info().model_name:
        raise unknown_model(asked, router.model_info().model_name)
    return body


def unknown_model(asked: str, model: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{asked}` does not exist; this server serves `{model}`", "model",
                       "model_not_found")


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
            router.checks.check_length(num_ids, field)
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
    """RequestChecks.encode_text (a string) / check_ids (token ids), their INVALID_ARGUMENT as a 400 (counted as a
    rejected request)."""
    try:
        if isinstance(prompt, str):
            return await router.checks.encode_text(prompt, field)
        return router.checks.check_ids(prompt, field)
    except ServiceError as e:
        raise from_service_error(e) from None

@dataclass(frozen=True)
class ReadRequest:
    """A request as read: n choices for each prompt, all sampled with params."""

    prompts: list[Prompt]
    params: SamplingParams
    options: StreamOptions
    n: int


async def read_completion(body: dict, router: Router) -> ReadRequest:
    """/v1/completions. Every prompt is checked against the router's limits before any generation starts: a
    stream's status is known before its headers go out."""
    n = num_choices(body)
    given, batch = completion_prompts(body.get("prompt"), router)
    if len(given) * n > router.config.max_concurrent_requests:
        raise bad(f"prompt: {len(given)} prompts x n={n} are {len(given) * n} generations; this router runs at "
                  f"most {router.config.max_concurrent_requests} requests at once "
                  "(--max-concurrent-requests): send fewer per request", "prompt")
    params = sampling_params(body, COMPLETIONS_DEFAULT_MAX_TOKENS)
    echo = bool(body.get("echo"))
    prompts = []
    for i, prompt in enumerate(given):
        field = f"prompt[{i}]" if batch else "prompt"
        ids = await prompt_ids(router, prompt, field)
        try:
            router.checks.check_params(params, len(ids))
        except ServiceError as e:
            raise from_service_error(e if not batch else ServiceError(e.code, f"{e} ({field})")) from None
        # echo: the prompt as sent (text), or the text of its ids
        text = (prompt if isinstance(prompt, str) else router.tokenizer.decode(ids) if router.tokenizer
                else "") if echo else None
        prompts.append(Prompt(ids, text))
    return ReadRequest(prompts, params, stream_options(body), n)


async def read_chat(body: dict, router: Router, chat_template: Optional[ChatTemplate]) -> ReadRequest:
    """/v1/chat/completions: the messages rendered by the model's chat template into one prompt."""
    limit = router.model_info().max_context_length
    if isinstance(body.get("messages"), list) and len(body["messages"]) > limit:  # before reading any of them
        raise bad(f"messages: {len(body['messages'])} messages cannot fit the model's context of {limit} tokens",
                  "messages")
    messages = chat_messages(body)
    if chat_template is None:
        raise bad("this model has no chat_template in its tokenizer_config.json; use /v1/completions", "messages")
    text = chat_template.render(messages) if len(messages) <= INLINE_TEMPLATE_MESSAGES else \
        await asyncio.to_thread(chat_template.render, messages)
    ids = await prompt_ids(router, text, "messages")
    # OpenAI's default: as many tokens as the context (and this router's --max-new-tokens-limit) allows.
    room = max(1, router.model_info().max_context_length - len(ids))
    params = sampling_params(body, min(room, router.config.max_new_tokens_limit or room), chat=True)
    return ReadRequest([Prompt(ids)], params, stream_options(body), num_choices(body))


__all__ = ["ChatTemplate", "OpenAIError", "ReadRequest", "bad", "from_service_error", "read_body", "read_chat",
           "read_completion", "unknown_model"]
