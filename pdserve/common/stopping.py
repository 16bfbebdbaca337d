"""The per-request stop decision (stop tokens, EOS, length, stop strings) and the text streamed up to it.

Torch-free: the engine runs it on every generated token, and the router runs the same code on a request's first
token to send it ahead of the decode worker's stream (router/first_token.py), so the two cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Optional, Protocol, Sequence

from pdserve.common.values import FINISH_LENGTH, FINISH_STOP, SamplingParams


def _token_finish_reason(
    last_id: int, num_output: int, params: SamplingParams, eos_token_ids: Collection[int]
) -> Optional[str]:
    # A natural stop is reported in preference to the length limit when both happen on the same token.
    if (not params.ignore_eos and last_id in eos_token_ids) or last_id in params.stop_token_ids:
        return FINISH_STOP
    if num_output >= params.max_new_tokens:
        return FINISH_LENGTH
    return None


def check_stop(
    output_ids: Sequence[int],
    new_text_tail: Optional[str],
    params: SamplingParams,
    eos_token_ids: Collection[int],
) -> Optional[str]:
    """Stateless finish check after the last token of `output_ids`: "stop", "length" or None.

    `new_text_tail` is recent decoded text long enough to hold any stop string that ends in the newest token
    (None without a tokenizer). Use `StopChecker` to also get the streamed text truncated at the stop string.
    """
    if not output_ids:
        return None
    if new_text_tail and any(s in new_text_tail for s in params.stop):
        return FINISH_STOP
    return _token_finish_reason(output_ids[-1], len(output_ids), params, eos_token_ids)


class StopStringMatcher:
    """Finds the first stop string in text that arrives in chunks, holding back text that may begin one.

    `feed` returns (text safe to emit, stopped). Emitted text never contains a stop string: on a match the text
    is cut just before it. Only the longest suffix that is a prefix of some stop string is held back, so
    streaming is delayed no more than necessary, and a match spanning chunk boundaries is still found.
    """

    def __init__(self, stop: Sequence[str]):
        assert all(stop), "stop strings must be non-empty (SamplingParams validates this)"
        self._stop = tuple(stop)
        self._held = ""
        self.stopped = False

    def feed(self, chunk: str) -> tuple[str, bool]:
        assert not self.stopped, "feed after a stop string matched"
        buf = self._held + chunk
        # Earliest start wins: among matches completed by this chunk, it gives the shortest output.
        hits = [i for i in (buf.find(s) for s in self._stop) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return buf[: min(hits)], True
        hold = self._partial_match_len(buf)
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """Releases held-back text when the request ends for another reason."""
        held, self._held = self._held, ""
        return held

    def _partial_match_len(self, buf: str) -> int:
        longest = max(len(s) for s in self._stop) - 1
        for n in range(min(len(buf), longest), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0


class Detokenizer(Protocol):
    """What StopChecker needs from tokenizer.IncrementalDetokenizer."""

    def push(self, new_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


@dataclass(frozen=True)
class StopUpdate:
    num_accepted: int  # leading tokens of the pushed ids that belong to the output; the rest follow the finish
    text: str  # newly finalised text to stream ("" without a detokenizer)
    finish_reason: Optional[str]  # "stop", "length" or None


class StopChecker:
    """Per-request stop state: feed generated tokens, get streamable text and the finish reason.

    Tokens are examined one at a time, so several tokens from one step (speculative decoding) are cut right
    after the first that finishes the request. Output token ids are kept as generated, including the one that
    completed a stop string; only the text is truncated.
    """

    def __init__(
        self, params: SamplingParams, eos_token_ids: Iterable[int], detokenizer: Optional[Detokenizer] = None
    ):
        if params.stop and detokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer, and this model was loaded without tokenizer.json")
        self.params = params
        self.eos_token_ids = frozenset(eos_token_ids)
        self._detok = detokenizer
        self._matcher = StopStringMatcher(params.stop) if params.stop else None
        self.num_output = 0
        self.finish_reason: Optional[str] = None

    def update(self, new_ids: Sequence[int]) -> StopUpdate:
        assert self.finish_reason is None, "update after the request finished"
        text = []
        for n, tok in enumerate(new_ids, start=1):
            self.num_output += 1
            reason = _token_finish_reason(tok, self.num_output, self.params, self.eos_token_ids)
            piece = self._detok.push([tok]) if self._detok is not None else ""
            if reason is not None and self._detok is not None:
                piece += self._detok.flush()
            if self._matcher is not None:
                piece, hit = self._matcher.feed(piece)
                if hit:
                    reason = FINISH_STOP
                elif reason is not None:
                    piece += self._matcher.flush()
            text.append(piece)
            if reason is not None:
                self.finish_reason = reason
                return StopUpdate(n, "".join(text), reason)
        return StopUpdate(len(new_ids), "".join(text), None)
