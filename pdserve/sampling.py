"""Sampling parameters and the batched sampler (the per-request stop decision: pdserve/common/stopping.py).

`probs_after_processing` is the single definition of the distribution a row is drawn from (temperature, then
top-k, then top-p); `Sampler.sample` draws from it and speculative decoding verifies against it, so the two
cannot drift apart.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from pdserve.common.values import SamplingParams, TokenLogprob


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
