"""NextN (MTP) speculative decoding: the MTP layer drafts k tokens, the target model verifies them in one pass.

One round for a decoding request with tokens t_0..t_{n-1} (KV computed for positions 0..n-2; h_{n-2} = the target's
last hidden state, before the final norm, whose logits produced t_{n-1}):

  draft    step 1 runs the MTP layer at position n-2 on (t_{n-1}, h_{n-2}) and predicts d_1 (for t_n); step j > 1
           runs it at position n-3+j on (d_{j-1}, the MTP's own output hidden of step j-1) and predicts d_j.
  verify   one target forward over k+1 DECODE rows [t_{n-1}, d_1..d_k] at positions n-1..n-1+k with seq_lens
           n..n+k, so each row sees the rows before it (causal among the drafts for free). Row j's logits are the
           target's distribution for t_{n+j}.
  accept   greedy: the longest prefix with d_j == argmax of row j-1, then the target's token at the first mismatch
           (or the bonus from row k). Sampling: speculative rejection sampling (Leviathan et al. 2023; Chen et al.
           2023): accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), on rejection draw from
           norm(max(0, p_j - q_j)); with every draft accepted draw the bonus from p_{k+1}. p and q both come from
           `probs_after_processing` (temperature, top-k, top-p), the distribution plain decoding samples from,
           so the emitted tokens are distributed exactly as the target's.
  extend   the "draft extend" (SGLang): the MTP layer re-runs over the a+1 emitted positions with the target's
           true hidden states, which refreshes its KV where the drafts had used its own approximate hidden, and
           whose last row is step 1 of the next round (kept in the request's DraftState).

Order on the device, greedy rounds: verify -> extend over all k+1 positions (with the target's own tokens, queued
before the round's one device-to-host read, so the GPU works while the host wakes and accepts) -> the next round's
draft chain (queued right after acceptance, before the host appends tokens, detokenizes and schedules). Host work
thus hides behind the GPU's, and the next verification finds its drafts ready (DraftState.drafts).

KV beyond the accepted length (target and MTP layer) is simply not counted as computed and is rewritten by a
later round before anything attends to it; the scheduler returns the unused pages. The MTP layer only shapes the
drafts, so none of this can change the output: only the acceptance rate. (For the same reason prompt positions
served from the prefix cache keep the MTP KV of the request that computed them, although at a page's last
position that request's next token may have differed.)

On CUDA the draft steps, the verification pass and the draft extend are DECODE-mode batches that replay captured
graphs (ModelRunner.target_rows / mtp_rows, graphs captured for B and B*(k+1) rows); the CPU runs them eagerly.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

import torch

from pdserve.model_runner import ModelRunner, TokenRow
from pdserve.request import Request
from pdserve.sampling import SamplingParams, probs_after_processing
from pdserve.scheduler import SpecDecode

ALGORITHMS = ("NEXTN",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-algorithm`, `--speculative-num-steps`, `--speculative-num-draft-tokens` (SGLang's flags)."""

    algorithm: Optional[str] = None  # None = off; "NEXTN" = draft with the checkpoint's MTP layer
    num_steps: int = 3  # draft steps chained through the MTP layer per round (k)
    num_draft_tokens: Optional[int] = None  # positions verified per round; must be num_steps + 1 (None = that)

    def __post_init__(self) -> None:
        algo = self.algorithm.upper() if isinstance(self.algorithm, str) else self.algorithm
        if algo is not None and algo not in ALGORITHMS:
            raise ValueError(f"--speculative-algorithm {self.algorithm!r} is not supported (choose: "
                             f"{', '.join(ALGORITHMS)})")
        object.__setattr__(self, "algorithm", algo)
        if self.num_steps < 1:
            raise ValueError(f"--speculative-num-steps must be >= 1 (got {self.num_steps})")
        if self.num_draft_tokens is None:
            object.__setattr__(self, "num_draft_tokens", self.num_steps + 1)
        elif self.num_draft_tokens != self.num_steps + 1:
            raise ValueError(f"--speculative-num-draft-tokens ({self.num_draft_tokens}) must be "
                             f"--speculative-num-steps + 1 ({self.num_steps + 1}): NextN drafts a single chain, so "
                             "each round verifies the last token plus one position per draft step")

    @property
    def enabled(self) -> bool:
        return self.algorithm is not None


@dataclass
class DraftState:
    """Where a request's next draft chain starts (kept on Request.spec; valid while num_tokens is unchanged)."""

    num_tokens: int  # the request's length this state belongs to (n)
    hidden: torch.Tensor  # (D,) the target's hidden state at position n-2 (before the final norm)
    # Draft step 1 (MTP at position n-2), when already computed by the previous round's extend or by prefill.
    step1_logits: Optional[torch.Tensor] = None  # (vocab,) fp32
    step1_hidden: Optional[torch.Tensor] = None  # (D,) MTP output hidden, the input of step 2
    # Greedy drafts d_1..d_k (k,) on the device, chained right after the extend that computed step 1 (queued on
    # the GPU before the host's bookkeeping, so the next round starts with its drafts already made).
    drafts: Optional[torch.Tensor] = None


@dataclass
class Verified:
    """The outcome of one speculative row: tokens to emit and the target's hidden states at their inputs."""

    row: SpecDecode
    tokens: list[int]  # accepted drafts plus one target token (1..k+1 tokens)
    hidden: torch.Tensor  # (len(tokens), D): target hidden at positions n-1..n-2+len(tokens)
    # The next round's draft step 1 (MTP logits (vocab,), MTP hidden (D,)) when the extend already ran (greedy
    # rounds run it before their device-to-host read); None: extend() computes it.
    step1: Optional[tuple[torch.Tensor, torch.Tensor]] = None


@dataclass
class SpecRoundStats:
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per row that drafted (k > 0)
    draft_seconds: float = 0.0  # MTP work: draft chain, plus the draft extend after verification
    verify_seconds: float = 0.0  # target forward over the k+1 rows and the acceptance decisions


class SpecObserver(Protocol):
    """Told about every round (the decode worker records Prometheus histograms through it)."""

    def on_spec_round(self, stats: SpecRoundStats) -> None: ...


# ---- acceptance rules (pure functions: unit-tested against exact distributions) ---------------------------------
def greedy_accept(target_ids: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """target_ids: argmax of each of the k+1 verification rows. The longest matching prefix plus one target token."""
    assert len(target_ids) == len(drafts) + 1
    for j, d in enumerate(drafts):
        if d != target_ids[j]:
            return [*drafts[:j], target_ids[j]]
    return [*drafts, target_ids[len(drafts)]]


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: Sequence[int],
                     generator: Optional[torch.Generator]) -> list[int]:
    """Speculative rejection sampling. target_probs (k+1, V): p_1..p_{k+1}; draft_probs (k, V): q_j, the
    distribution d_j was drawn from. Returns the accepted drafts plus one token drawn from the residual (on
    rejection) or from p_{k+1} (all accepted). The emitted sequence is distributed as the target's."""
    k = len(drafts)
    assert target_probs.shape[0] == k + 1 and draft_probs.shape[0] == k
    out: list[int] = []
    for j, d in enumerate(drafts):
        p, q = target_probs[j], draft_probs[j]
        u = torch.rand((), generator=generator, device=p.device)
        if bool(u * q[d] < p[d]):  # u < p/q without dividing; q[d] > 0 since d was drawn from q
            out.append(d)
            continue
        residual = (p - q).clamp(min=0)
        if not bool(residual.sum() > 0):  # p == q up to rounding: a rejection is then (almost) impossible
            residual = p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[k], 1, generator=generator)))
    return out


# ---- the speculator ---------------------------------------------------------------------------------------------
class NextNSpeculator:
    """Runs draft -> verify -> accept -> extend for the speculative rows of a step (the engine owns the loop)."""

    def __init__(self, runner: ModelRunner, config: SpeculativeConfig):
        assert config.enabled
        self.runner, self.config = runner, config
        # Called right before a round's device-to-host read, while the GPU verifies (the engine's hooks'
        # before_device_wait).
        self.before_read: Callable[[], None] = lambda: None
        # Totals since start (benchmarks and tests read them).
        self.num_rows = 0  # rows that drafted
        self.num_drafted = 0
        self.num_emitted = 0  # tokens emitted by rows that drafted
        self.num_chained_ahead = 0  # rounds whose drafts were chained right behind the previous round's extend

    @property
    def mean_accept_length(self) -> float:
        """Tokens per verification row that drafted (accepted drafts + 1); 1.0 means no draft is ever accepted."""
        return self.num_emitted / self.num_rows if self.num_rows else 0.0

    # ---- state ------------------------------------------------------------------------------------------------
    def prime(self, reqs: list[Request], hidden: torch.Tensor) -> None:
        """After a prompt's last chunk and its first sampled token: draft step 1 at the last prompt position.

        hidden (len(reqs), D): the target's hidden state there. Fills the MTP layer's KV at that position (the
        earlier positions come from ModelRunner.mtp_extend) and keeps the step's output for the first round.
        """
        if not reqs:
            return
        rows = [TokenRow(r, r.num_tokens - 2, r.last_token_id) for r in reqs]
        logits, h = self.runner.mtp_rows(rows, hidden)
        for i, r in enumerate(reqs):
            r.spec = DraftState(r.num_tokens, hidden[i], logits[i], h[i])

    def adopt(self, req: Request, hidden: torch.Tensor) -> None:
        """A request prefilled elsewhere: hidden (D,) is the prefill worker's target hidden state at the last prompt
        position; the first round recomputes draft step 1 from it (the MTP KV up to there came with the prompt)."""
        req.spec = DraftState(req.num_tokens, hidden.to(self.runner.device))

    # ---- a round ----------------------------------------------------------------------------------------------
    def propose_and_verify(self, rows: list[SpecDecode]) -> tuple[list[Verified], SpecRoundStats]:
        stats = SpecRoundStats()
        start = time.perf_counter()
        chained = self._draft_chain(rows)
        if chained is not None:  # every row greedy with k drafts: tokens stay on the device until acceptance
            mid = time.perf_counter()
            verified, drafts = self._verify_chained(rows, chained)
        else:
            drafts, draft_probs = self._draft(rows)
            mid = time.perf_counter()
            verified = self._verify(rows, drafts, draft_probs)
        stats.verify_seconds = time.perf_counter() - mid
        stats.draft_seconds = mid - start
        for v, d in zip(verified, drafts):
            if d:
                stats.accept_lengths.append(len(v.tokens))
                self.num_rows += 1
                self.num_drafted += len(d)
                self.num_emitted += len(v.tokens)
        return verified, stats

    def extend(self, verified: list[Verified], stats: Optional[SpecRoundStats] = None) -> None:
        """The draft extend, called right after acceptance and before the tokens are appended, so that it is queued
        on the device while the host appends, detokenizes and schedules: the MTP layer over the emitted positions
        with the target's hidden states; its last row is the next round's step 1. Rows whose verification already
        ran it (Verified.step1, greedy rounds) skip the forward. (A row whose request then finishes, on a stop
        token, a stop string or its length, only wasted its share of one forward.)"""
        if not verified:
            return
        start = time.perf_counter()
        todo = [v for v in verified if v.step1 is None]
        if todo:
            rows: list[TokenRow] = []
            for v in todo:  # positions n-1 .. n-2+len(tokens), each with the token after it
                req = v.row.request
                rows += [TokenRow(req, req.num_tokens - 1 + i, tok) for i, tok in enumerate(v.tokens)]
            logits, h = self.runner.mtp_rows(rows, torch.cat([v.hidden for v in todo]))
            for v, end in zip(todo, itertools.accumulate(len(v.tokens) for v in todo)):
                v.step1 = logits[end - 1], h[end - 1]
        states = []
        for v in verified:
            req = v.row.request
            req.spec = DraftState(req.num_tokens + len(v.tokens), v.hidden[-1], *v.step1)
            states.append(req.spec)
        self._chain_ahead(verified, states)
        if stats is not None:
            stats.draft_seconds += time.perf_counter() - start

    def _chain_ahead(self, verified: list[Verified], states: list[DraftState]) -> None:
        """The next round's greedy draft chain, queued right behind the extend: d_1 = argmax of step 1, then
        d_2..d_k at positions n'-1 .. n'+k-3 (n' = the length after this round's tokens). Only when every row is
        greedy and its pages (reserved for this round's verification) already cover those positions; otherwise
        the next round chains at its start. Pages freed after this round only held the chain's own MTP KV, which
        nothing reads after the chain (the next extend rewrites those positions first), and the chain runs before
        any later owner's writes (one stream)."""
        k, ps = self.config.num_steps, self.runner.pool.page_size
        if k < 2 or not all(v.row.request.params.is_greedy and s.num_tokens + k - 2 <= len(v.row.request.pages) * ps
                            for v, s in zip(verified, states)):
            return
        for s, drafts in zip(states, self._chain([v.row.request for v in verified], states)):
            s.drafts = drafts

    def _chain(self, reqs: list[Request], states: list[DraftState]) -> torch.Tensor:
        """Greedy drafts (rows, k) on the device: d_1 = argmax of step 1, then d_2..d_k chained through the MTP
        layer (one captured graph on CUDA); step 2 runs at position n-1 on d_1, written into the batch on the
        device (n = the length each state belongs to)."""
        first = torch.stack([s.step1_logits for s in states]).argmax(dim=-1)  # (rows,) d_1
        rows = [TokenRow(req, s.num_tokens - 1, 0) for req, s in zip(reqs, states)]
        rest = self.runner.mtp_draft_chain(rows, torch.stack([s.step1_hidden for s in states]),
                                           self.config.num_steps - 1, first)
        return torch.cat([first.unsqueeze(1), rest], dim=1)

    # ---- stages -----------------------------------------------------------------------------------------------
    def _draft(self, rows: list[SpecDecode]) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        """Per row: the draft tokens d_1..d_k and, for sampling rows, the distributions q_j they were drawn from."""
        states = self._states(rows)
        num = [row.num_drafts if s is not None else 0 for row, s in zip(rows, states)]
        drafts: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        active = [i for i in range(len(rows)) if num[i] > 0]
        step_logits = {i: states[i].step1_logits for i in active}
        step_hidden = {i: states[i].step1_hidden for i in active}
        for j in range(1, max(num, default=0) + 1):
            active = [i for i in active if num[i] >= j]
            if j > 1:  # MTP at position n-3+j on (d_{j-1}, its own hidden of step j-1)
                step_rows = [TokenRow(rows[i].request, rows[i].request.num_tokens - 3 + j, drafts[i][-1])
                             for i in active]
                logits, h = self.runner.mtp_rows(step_rows, torch.stack([step_hidden[i] for i in active]))
                for a, i in enumerate(active):
                    step_logits[i], step_hidden[i] = logits[a], h[a]
            greedy = [i for i in active if rows[i].request.params.is_greedy]
            if greedy:  # one argmax and one device->host copy for the whole step
                ids = torch.stack([step_logits[i] for i in greedy]).argmax(dim=-1).tolist()
                for i, tok in zip(greedy, ids):
                    drafts[i].append(tok)
            for i in active:
                req = rows[i].request
                if not req.params.is_greedy:
                    q = probs_after_processing(step_logits[i], req.params)
                    drafts[i].append(int(torch.multinomial(q, 1, generator=req.generator)))
                    probs[i].append(q)
        return drafts, probs

    def _states(self, rows: list[SpecDecode]) -> list[Optional[DraftState]]:
        """Each row's draft state (None: the row does not draft), with draft step 1 computed where no earlier
        extend did (requests that arrived prefilled from another worker)."""
        states: list[Optional[DraftState]] = []
        for row in rows:
            state = row.request.spec if row.num_drafts else None  # no state (PD without a hidden): no drafts
            assert state is None or state.num_tokens == row.request.num_tokens, "stale draft state"
            states.append(state)
        todo = [i for i, s in enumerate(states) if s is not None and s.step1_logits is None]
        if todo:
            reqs = [rows[i].request for i in todo]
            logits, h = self.runner.mtp_rows([TokenRow(r, r.num_tokens - 2, r.last_token_id) for r in reqs],
                                             torch.stack([states[i].hidden for i in todo]))
            for j, i in enumerate(todo):
                states[i].step1_logits, states[i].step1_hidden = logits[j], h[j]
        return states

    def _draft_chain(self, rows: list[SpecDecode]) -> Optional[torch.Tensor]:
        """When every row is greedy and drafts k >= 2 tokens: d_1 = argmax of step 1, then d_2..d_k chained through
        the MTP layer on the device (one captured graph on CUDA), with no host round trip. Returns the drafts
        (rows, k) on the device, or None when the batch does not qualify (the caller drafts step by step)."""
        k = self.config.num_steps
        if k < 2 or not rows or any(row.num_drafts != k or row.request.spec is None
                                    or not row.request.params.is_greedy for row in rows):
            return None
        states = self._states(rows)
        if all(s.drafts is not None for s in states):  # chained right after the last round's extend
            self.num_chained_ahead += 1
            return torch.stack([s.drafts for s in states])
        return self._chain([row.request for row in rows], states)

    def _verify_chained(self, rows: list[SpecDecode], drafts_dev: torch.Tensor
                        ) -> tuple[list[Verified], list[list[int]]]:
        """_verify for device drafts (rows, k): the verification rows take them on the device, and the drafts and
        the target's argmaxes come back to the host together, in the round's only device-to-host copy."""
        b, k = drafts_dev.shape
        vrows = [TokenRow(row.request, row.request.num_tokens - 1 + m, row.request.last_token_id if m == 0 else 0)
                 for row in rows for m in range(k + 1)]

        def put_drafts(input_ids: torch.Tensor) -> None:  # rows [t_{n-1}, d_1..d_k] per request
            input_ids.view(b, k + 1)[:, 1:].copy_(drafts_dev)

        hidden, logits = self.runner.target_rows(vrows, put_drafts)  # (b*(k+1), D), (b*(k+1), vocab)
        target = logits.argmax(dim=-1)  # (b*(k+1),)

        def put_targets(input_ids: torch.Tensor) -> None:  # the MTP row at position p takes t_{p+1}
            input_ids.copy_(target)

        # The draft extend, queued BEFORE the device-to-host read so that the GPU runs it while the host wakes up
        # and accepts: over all k+1 positions, each with the target's token after it, which up to the accepted
        # length are exactly the emitted tokens. Rows past it write MTP KV at positions >= n'-1 (n' = the new
        # length), which the next chain or extend rewrites before anything reads it.
        ext_logits, ext_hidden = self.runner.mtp_rows(vrows, hidden, put_targets)
        ids = torch.cat([drafts_dev.flatten(), target])
        self.before_read()
        host = ids.tolist()
        drafts = [host[i * k:(i + 1) * k] for i in range(b)]
        verified = self._accept_rows(rows, drafts, [[] for _ in rows], host[b * k:], logits, hidden)
        for i, v in enumerate(verified):
            last = i * (k + 1) + len(v.tokens) - 1  # the row of the last emitted token's input position
            v.step1 = ext_logits[last], ext_hidden[last]
        return verified, drafts

    def _verify(self, rows: list[SpecDecode], drafts: list[list[int]],
                draft_probs: list[list[torch.Tensor]]) -> list[Verified]:
        vrows: list[TokenRow] = []
        for row, d in zip(rows, drafts):
            req = row.request
            n = req.num_tokens
            vrows += [TokenRow(req, n - 1 + m, tok) for m, tok in enumerate([req.last_token_id, *d])]
        hidden, logits = self.runner.target_rows(vrows)  # (sum(k+1), D), (sum(k+1), vocab)
        target = logits.argmax(dim=-1)
        self.before_read()
        target_ids = target.tolist()  # greedy rows' targets, in one device->host copy
        return self._accept_rows(rows, drafts, draft_probs, target_ids, logits, hidden)

    @staticmethod
    def _accept_rows(rows: list[SpecDecode], drafts: list[list[int]], draft_probs: list[list[torch.Tensor]],
                     target_ids: list[int], logits: torch.Tensor, hidden: torch.Tensor) -> list[Verified]:
        """Acceptance per row over the verification rows laid out row after row (1 + len(drafts) each)."""
        out, off = [], 0
        for row, d, q in zip(rows, drafts, draft_probs):
            req, width = row.request, len(d) + 1
            if req.params.is_greedy:  # no random draws: the generator stays untouched, as in plain decoding
                tokens = greedy_accept(target_ids[off: off + width], d)
            else:
                tokens = _sample_accept(logits[off: off + width], d, q, req.params, req.generator)
            out.append(Verified(row, tokens, hidden[off: off + len(tokens)]))
            off += width
        return out


def _sample_accept(logits: torch.Tensor, drafts: list[int], draft_probs: list[torch.Tensor], params: SamplingParams,
                   generator: Optional[torch.Generator]) -> list[int]:
    target = torch.stack([probs_after_processing(row, params) for row in logits])  # (k+1, V)
    q = torch.stack(draft_probs) if draft_probs else target.new_empty(0, target.shape[1])
    return rejection_sample(target, q, drafts, generator)


__all__ = ["SpeculativeConfig", "NextNSpeculator", "DraftState", "Verified", "SpecRoundStats", "SpecObserver",
           "greedy_accept", "rejection_sample", "ALGORITHMS"]
