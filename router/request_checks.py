"""Every field a client sets, checked before anything reaches a worker (nothing invalid does): a GenerateRequest's
fields bounded from their sizes in its bytes before it is parsed, the prompt (text tokenized here, or token ids: not
empty, in the vocabulary, leaving room in the context), the sampling parameters against the model and this router's
limits, the request id. A failed check is INVALID_ARGUMENT naming the field. The gRPC front and the OpenAI HTTP front
(router/openai_request.py) both check through it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

from pdserve.common.tokenizer import Tokenizer
from pdserve.common.values import SamplingParams
from pdserve.serving.grpc_shell import invalid, message_fields
from pdserve.serving.rpc_convert import DEFAULT_MAX_NEW_TOKENS
from pdserve.v1 import generate_pb2 as gen_pb

MAX_REQUEST_ID_CHARS = 256
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
MAX_STOP_TOKEN_IDS = 256
# A token id takes at most this many bytes in a message: a 5-byte varint, and a tag byte when the repeated field is
# not packed. What a GenerateRequest's fields may hold is bounded from these before it is parsed.
MAX_ID_BYTES = 6
MAX_UNKNOWN_FIELD_BYTES = 64 << 10  # fields of a newer GenerateRequest this router does not know
_REQUEST_FIELDS = {f.number: f.name for f in gen_pb.GenerateRequest.DESCRIPTOR.fields}
_PARAMS_FIELDS = {f.number: f.name for f in gen_pb.SamplingParams.DESCRIPTOR.fields}
# Text prompts up to this many characters are tokenized on the event loop, where a hand-off to a thread would cost
# more than the encoding; longer ones on the tokenizer threads, without the GIL, so that a long prompt never holds up
# other requests.
INLINE_TOKENIZE_CHARS = 16384
# A prompt longer than the context times the longest token times this is refused before tokenizing: it cannot fit
# (the margin covers normalizers that drop characters).
PROMPT_CHARS_MARGIN = 2


class RequestChecks:
    """The router's checks of a client's request, against the model the workers report (`model_info`, which raises
    UNAVAILABLE while none has) and this router's limits."""

    def __init__(self, model_info: Callable[[], gen_pb.ModelInfo], tokenizer: Optional[Tokenizer],
                 max_new_tokens_limit: Optional[int], tokenize_threads: int):
        self.model_info, self.tokenizer, self.max_new_tokens_limit = model_info, tokenizer, max_new_tokens_limit
        self._tokenize_pool = ThreadPoolExecutor(tokenize_threads, thread_name_prefix="router-tokenize")
        self._tokenize_slots = asyncio.Semaphore(tokenize_threads)

    def close(self) -> None:
        """Ends the tokenizer threads (for a router that stops before its process does)."""
        self._tokenize_pool.shutdown()

    async def prompt_ids(self, request: gen_pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise invalid("prompt: give exactly one of text or tokenized.input_ids")
        if kind == "text":
            return await self.encode_text(request.text)
        ids = request.tokenized.input_ids
        self.check_length(len(ids), "tokenized.input_ids")  # before any pass over them: O(1) on a repeated field
        return self.check_ids(list(ids), "tokenized.input_ids")

    def max_prompt_chars(self) -> int:
        """The longest text that could still fit the model's context (see PROMPT_CHARS_MARGIN)."""
        return self.model_info().max_context_length * self.tokenizer.max_token_chars * PROMPT_CHARS_MARGIN

    async def encode_text(self, text: str, field: str = "text") -> list[int]:
        """Checked before any work: not empty, not longer than the context could hold, valid Unicode. Long texts
        are tokenized on the tokenizer threads (at most --tokenize-threads at once), off the event loop."""
        if not text:
            raise invalid(f"{field}: the prompt is empty")
        if self.tokenizer is None:
            raise invalid(f"{field}: this router has no tokenizer (start it with --model DIR); send token ids")
        limit = self.max_prompt_chars()
        if len(text) > limit:
            raise invalid(f"{field}: the prompt has {len(text)} characters; the model's context of "
                          f"{self.model_info().max_context_length} tokens cannot hold more than {limit}")
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate, which JSON's \\udXXX escapes can carry
                raise invalid(f"{field}: not valid Unicode text (a lone surrogate at character {e.start})") from None
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return self.check_ids(self.tokenizer.encode(text), field)
        async with self._tokenize_slots:
            ids = await asyncio.get_running_loop().run_in_executor(
                self._tokenize_pool, lambda: self.tokenizer.encode(text, release_gil=True))
        return self.check_ids(ids, field)

    def check_request_bytes(self, raw: bytes) -> None:
        """A GenerateRequest's fields bounded by their sizes in its bytes, before it is parsed (MessageGuard's
        precheck): parsing millions of token ids holds the event loop every other client waits on, and protobuf
        holds the GIL while it parses, so a thread would not free the loop. What passes holds at most the model's
        context in ids and parses in a moment. (A text prompt parses as one copy: bounded by --max-request-bytes,
        then by its characters in encode_text.)"""
        context = self.model_info().max_context_length
        sizes = _field_sizes(raw)
        limits = {"tokenized": (MAX_ID_BYTES * context, "tokenized.input_ids: {} bytes of token ids are more than "
                                f"the model's context of {context} tokens can hold (a prompt may have at most "
                                f"{context - 1} ids, {MAX_ID_BYTES * context} bytes)"),
                  "stop_token_ids": (MAX_ID_BYTES * MAX_STOP_TOKEN_IDS, "sampling_params.stop_token_ids: at most "
                                     f"{MAX_STOP_TOKEN_IDS} ids (got {{}} bytes of them)"),
                  "stop": (MAX_STOP_STRINGS * (4 * MAX_STOP_CHARS + 1), "sampling_params.stop: at most "
                           f"{MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters (got {{}} bytes "
                           "of them)"),
                  "request_id": (4 * MAX_REQUEST_ID_CHARS, f"request_id: at most {MAX_REQUEST_ID_CHARS} printable "
                                 "characters (got {} bytes)"),
                  "unknown": (MAX_UNKNOWN_FIELD_BYTES, "{} bytes of fields that GenerateRequest and SamplingParams "
                              "do not have")}
        for name, (limit, message) in limits.items():
            if sizes.get(name, 0) > limit:
                raise invalid(message.format(sizes[name]))

    def check_length(self, num_ids: int, field: str = "input_ids") -> None:
        """A prompt of `num_ids` tokens leaves room for at least one new token: checked before anything reads the
        ids (converting or scanning millions of them would hold the event loop every other client waits on)."""
        info = self.model_info()
        if num_ids >= info.max_context_length:
            raise invalid(f"{field}: the prompt has {num_ids} tokens; the model's context is "
                          f"{info.max_context_length}, so a prompt may have at most {info.max_context_length - 1}")

    def check_ids(self, ids: list[int], field: str = "input_ids") -> list[int]:
        """The prompt is non-empty, in the vocabulary, and leaves room for at least one new token."""
        if not ids:
            raise invalid(f"{field}: the prompt is empty")
        self.check_length(len(ids), field)
        info = self.model_info()
        bad = [t for t in ids if not 0 <= t < info.vocab_size] if min(ids) < 0 or max(ids) >= info.vocab_size else []
        if bad:
            raise invalid(f"{field}: token ids out of the vocabulary [0, {info.vocab_size}): {bad[:5]}")
        return ids

    def check_params(self, params: SamplingParams, num_prompt_tokens: int,
                     field: str = "sampling_params") -> None:
        """Limits SamplingParams itself cannot know (its own checks ran when it was built). A request must fit the
        context as asked: prompt + max_new_tokens above it is refused (as vLLM does) rather than cut short."""
        info = self.model_info()
        if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise invalid(f"{field}.stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids (got "
                          f"{len(params.stop_token_ids)})")
        limit = self.max_new_tokens_limit
        if limit is not None and params.max_new_tokens > limit:
            raise invalid(f"{field}.max_new_tokens: {params.max_new_tokens} is above this server's limit of "
                          f"{limit} (--max-new-tokens-limit)")
        room = info.max_context_length - num_prompt_tokens
        if params.max_new_tokens > room:
            raise invalid(f"{field}.max_new_tokens: prompt ({num_prompt_tokens} tokens) + max_new_tokens "
                          f"({params.max_new_tokens}) exceeds the model's context of {info.max_context_length} "
                          f"tokens; ask for at most {room}")
        bad = [t for t in params.stop_token_ids if t >= info.vocab_size]
        if bad:
            raise invalid(f"{field}.stop_token_ids: ids out of the vocabulary [0, {info.vocab_size}): {bad[:5]}")
        if len(params.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in params.stop):
            raise invalid(f"{field}.stop: at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} "
                          f"characters each")
        if any(not s.isascii() and not _is_unicode(s) for s in params.stop):
            raise invalid(f"{field}.stop: not valid Unicode text (a lone surrogate)")
        if params.stop and self.tokenizer is None:
            raise invalid(f"{field}.stop: stop strings need a tokenizer; start the router with --model DIR")

    def default_max_new_tokens(self, num_prompt_tokens: int) -> int:
        """For a request that did not set max_new_tokens: the default, cut to what the context and limit allow."""
        room = self.model_info().max_context_length - num_prompt_tokens
        return max(1, min(DEFAULT_MAX_NEW_TOKENS, room, self.max_new_tokens_limit or room))

    @staticmethod
    def check_request_id(request_id: str) -> None:
        if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
            raise invalid(f"request_id: at most {MAX_REQUEST_ID_CHARS} printable characters (got "
                          f"{len(request_id)} characters)")


def _field_sizes(raw: bytes) -> dict[str, int]:
    """Bytes of each field of the GenerateRequest `raw`, and of its sampling_params' fields, by name (a field given
    twice counts twice: the parser merges them); fields neither message has count as "unknown"."""
    sizes: dict[str, int] = {}
    view = memoryview(raw)
    for number, start, end in message_fields(view):
        name = _REQUEST_FIELDS.get(number, "unknown")
        sizes[name] = sizes.get(name, 0) + end - start
        if name == "sampling_params":
            for inner, s, e in message_fields(view[start:end]):
                inner_name = _PARAMS_FIELDS.get(inner, "unknown")
                sizes[inner_name] = sizes.get(inner_name, 0) + e - s
    return sizes


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


__all__ = ["RequestChecks", "MAX_STOP_TOKEN_IDS"]
