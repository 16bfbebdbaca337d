"""Sampling parameters, the batched sampler and the per-request stop decision.

`probs_after_processing` is the single definition of the distribution a row is drawn from (temperature, then
top-k, then top-p); `Sampler.sample` draws from it and speculative decoding verifies against it, so the two
cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Optional, Protocol, Sequence

import torch

from pdserve.common.values import FINISH_LENGTH, FINISH_STOP, SamplingParams, TokenLogprob


def make_generator(seed: Optional[int], device: torch.device | str = "cpu") -> Optional[torch.Generator]:
    """A generator seeded for one request, or None (draws then use torch's global RNG).

    NOTE: torch.multinomial requires the generator on the same device as the logits.
    """
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def probs_after_processing(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The float32 distribution (vocab,) that `Sampler.sample` draws this row from.

    Greedy: one-hot on argmax (lowest id on ties). Otherwise softmax(logits / T) restricted to the top-k tokens,
    then to the smallest set of most likely tokens whose probability (renormalised over top-k) reaches top_p.
    Ties are ordered by lowest id, so top_k=1 is exactly greedy and the kept set is deterministic.
    """
    assert logits_row.dim() == 1, f"expected (vocab,), got {tuple(logits_row.shape)}"
    vocab = logits_row.numel()
    if params.is_greedy:
        probs = torch.zeros(vocab, dtype=torch.float32, device=logits_row.device)
        probs[torch.argmax(logits_row)] = 1.0
        return probs
    x = logits_row.float() / params.temperature
    k = params.top_k if 0 < params.top_k < vocab else vocab
    if k == vocab and params.top_p >= 1.0:
        return torch.softmax(x, dim=-1)
    sorted_x, order = torch.sort(x, descending=True, stable=True)  # (vocab,) each; ties keep lowest id first
    sorted_x[k:] = float("-inf")
    if params.top_p < 1.0:
        p = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(p, dim=-1) - p  # exclusive cumsum: 0 for the top token, so it is always kept
        sorted_x = sorted_x.masked_fill(mass_before >= params.top_p, float("-inf"))
    sorted_probs = torch.softmax(sorted_x, dim=-1)
    return torch.empty_like(sorted_probs).scatter_(0, order, sorted_probs)


class Sampler:
    """Draws one token per row of a logits batch, each row under its own SamplingParams and generator."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[Optional[torch.Generator]],
    ) -> torch.Tensor:
        """logits (batch, vocab) -> token ids (batch,) int64 on logits.device."""
        assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators), (
            f"logits {tuple(logits.shape)}, {len(params)} params, {len(generators)} generators"
        )
        out = torch.argmax(logits, dim=-1)  # (batch,) greedy rows are final; ties -> lowest id
        # NOTE: non-greedy rows are drawn one at a time, each from its own generator, so a seeded request's
        # tokens do not depend on which other requests share the batch. Cost is a few small kernels per row.
        for i, (p, gen) in enumerate(zip(params, generators)):
            if p.is_greedy:
                continue
            probs = probs_after_processing(logits[i], p)
            out[i] = torch.multinomial(probs, 1, generator=gen)[0]
        return out


def logprob_temperature(params: SamplingParams) -> float:
    """What the logits are divided by before the log-softmax that logprobs report: the temperature the sampler
    used, 1 for greedy rows (OpenAI reports the model's own distribution at temperature 0)."""
    return 1.0 if params.is_greedy else params.temperature


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], temperatures: Sequence[float],
                   num_top: int) -> list[TokenLogprob]:
    """logits (rows, vocab), the token of each row and its temperature -> each token's log-probability and the
    `num_top` most likely tokens of its row (ties: lowest id first). Called only for rows that asked for logprobs,
    so a batch without them pays nothing. fp32 throughout."""
    assert logits.dim() == 2 and logits.shape[0] == len(token_ids) == len(temperatures)
    if not len(token_ids):
        return []
    temps = torch.tensor(list(temperatures), dtype=torch.float32, device=logits.device)
    lp = torch.log_softmax(logits.float() / temps[:, None], dim=-1)  # (rows, vocab)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logits.device)
    chosen = lp.gather(1, ids[:, None])[:, 0].tolist()
    tops: list[tuple] = [()] * len(token_ids)
    if num_top > 0:
        # Sorting ascending ids first then a stable descending sort keeps the lowest id first among equal values.
        values, order = torch.sort(lp, dim=-1, descending=True, stable=True)
        values, order = values[:, :num_top].tolist(), order[:, :num_top].tolist()
        tops = [tuple(zip(o, v)) for o, v in zip(order, values)]
    return [TokenLogprob(int(t), float(c), top) for t, c, top in zip(token_ids, chosen, tops)]


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
