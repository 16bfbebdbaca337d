"""The OpenAI API's response objects, built from the router's messages: completions and chat, whole or as stream
chunks, with `usage` and `logprobs` in OpenAI's two shapes (completions: parallel lists `tokens` / `token_logprobs` /
`top_logprobs` / `text_offset`; chat: `logprobs.content`, one object per token).

A completions request may carry several prompts, each answered by n choices: choice `index` i*n + j is prompt i's
j-th sample (as vLLM numbers them), and `usage` adds up every prompt and every choice."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from pdserve.v1 import generate_pb2 as gen_pb


class TokenText:
    """A token id's text for logprobs (OpenAI reports tokens as strings): the tokenizer's piece, or
    `token_id:N` without a tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, token_id: int, offsets: bool = False) -> str:
        """offsets: the token's share of the text (special tokens such as BOS have none)."""
        if self.tokenizer is None:
            return "" if offsets else f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=offsets)


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: its ids and, for completions' echo, the text that starts each of its choices."""

    ids: list[int]
    echo_text: Optional[str] = None  # None: no echo


@dataclass
class Reply:
    """Builds the response objects of one request in OpenAI's shapes (completion or chat, whole or chunks)."""

    kind: str  # "text_completion" | "chat.completion"
    id: str
    model: str
    with_token_ids: bool
    token_text: TokenText
    prompts: list[Prompt]  # choice index k answers prompts[k // n]
    n: int = 1  # choices per prompt
    created: int = field(default_factory=lambda: int(time.time()))
    echoed: set = field(default_factory=set)  # choices whose echo chunk went out (streaming)
    offsets: dict = field(default_factory=dict)  # choice -> text offset of its next token (completions logprobs)

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    def _envelope(self, choices: list, chunk: bool) -> dict:
        kind = "chat.completion.chunk" if chunk and self.chat else self.kind
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def prompt_of(self, index: int) -> Prompt:
        return self.prompts[index // self.n]

    def whole(self, completes: list[gen_pb.GenerateComplete]) -> dict:
        choices = []
        for i, c in enumerate(completes):
            choice = {"index": i, "logprobs": None, "finish_reason": finish_reason(c.finish_reason)}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": c.text}
                if c.logprobs:
                    choice["logprobs"] = {"content": self._chat_logprobs(c.logprobs)}
            else:
                prompt = self.prompt_of(i)
                choice["text"] = c.text
                entries = list(c.logprobs)
                if prompt.echo_text is not None:
                    choice["text"] = prompt.echo_text + c.text
                    if c.logprobs or c.prompt_logprobs:
                        entries = self._prompt_entries(prompt, list(c.prompt_logprobs)) + entries
                if c.logprobs or (prompt.echo_text is not None and c.prompt_logprobs):
                    choice["logprobs"] = self._completion_logprobs(i, entries)
            if self.with_token_ids:
                choice["token_ids"] = list(c.output_ids)
            choices.append(choice)
        return {**self._envelope(choices, chunk=False), "usage": usage([c.usage for c in completes], self.n)}

    def echo_chunk(self, index: int, prompt_logprobs: list) -> dict:
        """Streaming with echo: the prompt's text (and logprobs) before the choice's first tokens."""
        self.echoed.add(index)
        prompt = self.prompt_of(index)
        choice = {"index": index, "text": prompt.echo_text or "", "logprobs": None, "finish_reason": None}
        if prompt_logprobs:
            choice["logprobs"] = self._completion_logprobs(index, self._prompt_entries(prompt, prompt_logprobs))
        return self._envelope([choice], chunk=True)

    def chunk(self, index: int, text: str = "", token_ids: Optional[list[int]] = None, finish: Optional[int] = None,
              delta: Optional[dict] = None, logprobs: Optional[list] = None) -> dict:
        choice: dict = {"index": index, "logprobs": None,
                        "finish_reason": None if finish is None else finish_reason(finish)}
        if self.chat:
            choice["delta"] = delta if delta is not None else ({"content": text} if finish is None else {})
            if logprobs:
                choice["logprobs"] = {"content": self._chat_logprobs(logprobs)}
        else:
            choice["text"] = text
            if logprobs:
                choice["logprobs"] = self._completion_logprobs(index, logprobs)
        if self.with_token_ids and finish is None and delta is None:
            choice["token_ids"] = token_ids or []
        return self._envelope([choice], chunk=True)

    def usage_chunk(self, u: list[gen_pb.Usage]) -> dict:
        """u: every choice's usage, in index order."""
        return {**self._envelope([], chunk=True), "usage": usage(u, self.n)}

    # ---- logprobs in OpenAI's two shapes --------------------------------------------------------------------------
    @staticmethod
    def _prompt_entries(prompt: Prompt, prompt_logprobs: list) -> list:
        """The prompt's entries: None for the first token (nothing predicts it), then one per later token."""
        ids = prompt.ids
        return [(ids[0], None)] + list(prompt_logprobs) if ids else []

    def _completion_logprobs(self, index: int, entries: list) -> dict:
        """/v1/completions: parallel lists tokens, token_logprobs, top_logprobs (token text -> logprob),
        text_offset. An entry is a TokenLogprobs, or (token id, None) for a token without one."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self.offsets.get(index, 0)
        for e in entries:
            token_id, lp = e if isinstance(e, tuple) else (e.token_id, e)
            text = self.token_text(token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if lp is None else lp.logprob)
            out["top_logprobs"].append(None if lp is None else {self.token_text(t.token_id): t.logprob
                                                                for t in lp.top})
            out["text_offset"].append(offset)
            offset += len(self.token_text(token_id, offsets=True))
        self.offsets[index] = offset
        return out

    def _chat_logprobs(self, entries: list) -> list[dict]:
        """/v1/chat/completions: logprobs.content, one object per token with its top_logprobs."""
        def item(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}
        return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t.token_id, t.logprob) for t in e.top]}
                for e in entries]


def finish_reason(value: int) -> str:
    return "length" if value == gen_pb.FINISH_REASON_LENGTH else "stop"  # OpenAI has no other reason for us


def usage(per_choice: list[gen_pb.Usage], n: int = 1) -> dict:
    """per_choice: in index order, n choices per prompt. Each prompt counts once (its first choice's prompt and
    cached tokens, as vLLM counts them), every choice's completion tokens."""
    firsts = per_choice[::n]
    prompt, cached = sum(u.prompt_tokens for u in firsts), sum(u.cached_tokens for u in firsts)
    completion = sum(u.completion_tokens for u in per_choice)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


__all__ = ["Prompt", "Reply", "TokenText", "finish_reason", "usage"]
