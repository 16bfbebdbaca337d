"""Speculative sampling is lossless: the tokens it emits are distributed exactly as the target model's.

Two chi-square goodness-of-fit tests against distributions computed exactly:
1. the rejection-sampling rule alone, on synthetic Markov chains (target P, draft Q over a 4-token vocabulary);
2. the whole engine (drafts from the MTP layer, processed with temperature and top-k, verified in one forward) on a
   tiny model with a 16-token vocabulary, against the target model's own next-token distributions.
Each also runs with a deliberately wrong acceptance rule and must then FAIL: the tests have power.

Threshold: the chi-square upper 0.1% point (Wilson-Hilferty approximation), cells with an expected count below 5
pooled into one. With a correct sampler a run exceeds it with probability about 1e-3 over seeds (the false-alarm
rate); the seeds are fixed, so each run is deterministic.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch
from safetensors.torch import save_file

import pdserve.spec_decode as spec_decode
from pdserve.config import ModelConfig
from pdserve.engine import EngineConfig, LLMEngine
from pdserve.forward_batch import ForwardBatch, ForwardMode
from pdserve.kernels import KernelBackends
from pdserve.kv_cache import CacheConfig
from pdserve.sampling import SamplingParams, probs_after_processing
from pdserve.scheduler import SchedulerConfig
from pdserve.spec_decode import SpeculativeConfig, rejection_sample
from pdserve.tiny_model import export_hf_state_dict, tiny_config_dict
from pdserve.weights import build_model, init_dummy_weights


Z_999 = 3.0902  # standard normal upper 0.1% point


def chi2_threshold(df: int, z: float = Z_999) -> float:
    """Wilson-Hilferty: the chi-square(df) quantile at the normal quantile z (within 1% for df >= 10)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: Counter, expected_probs: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; cells expected below 5 are pooled (observations outside the
    support included, so a token the target cannot produce counts against the sampler)."""
    stat, df, pooled_obs, pooled_exp = 0.0, 0, 0, 0.0
    for cell, p in expected_probs.items():
        e = n * p
        if e >= 5:
            stat += (counts.get(cell, 0) - e) ** 2 / e
            df += 1
        else:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += e
    pooled_obs += sum(c for cell, c in counts.items() if cell not in expected_probs)
    if pooled_exp > 0 or pooled_obs:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        df += 1
    return stat, df - 1


# ---- deliberately wrong rules: the tests must reject them ---------------------------------------------------------
def accept_always(target_probs, draft_probs, drafts, generator):
    return [*drafts, int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator))]


def resample_from_target(target_probs, draft_probs, drafts, generator):
    """Right acceptance test, wrong correction: draws from p instead of norm(max(0, p - q)) on rejection."""
    out = []
    for j, d in enumerate(drafts):
        p, q = target_probs[j], draft_probs[j]
        if bool(torch.rand((), generator=generator) * q[d] < p[d]):
            out.append(d)
            continue
        return out + [int(torch.multinomial(p, 1, generator=generator))]
    return out + [int(torch.multinomial(target_probs[-1], 1, generator=generator))]


# ---- 1. the rule alone, on Markov chains --------------------------------------------------------------------------
V, K, DEPTH, N_SEQ = 4, 3, 3, 4000


def random_rows(gen: torch.Generator) -> torch.Tensor:
    x = -torch.log(torch.rand(V, V, generator=gen))  # Dirichlet(1) rows
    return x / x.sum(-1, keepdim=True)


def sample_sequences(rule, seed: int = 0) -> tuple[Counter, dict]:
    gen = torch.Generator().manual_seed(1234)
    P, Q = random_rows(gen), random_rows(gen)  # P[a]: target's next-token distribution after token a; Q: draft's
    gen.manual_seed(seed)
    counts: Counter = Counter()
    for _ in range(N_SEQ):
        seq = [0]
        while len(seq) <= DEPTH:
            drafts, qs = [], []
            for _ in range(K):
                q = Q[drafts[-1] if drafts else seq[-1]]
                drafts.append(int(torch.multinomial(q, 1, generator=gen)))
                qs.append(q)
            target = torch.stack([P[t] for t in [seq[-1], *drafts]])  # (K+1, V): p_j given the tokens before
            seq += rule(target, torch.stack(qs), drafts, gen)
        counts[tuple(seq[1: DEPTH + 1])] += 1
    exact = {}
    for a in range(V):
        for b in range(V):
            for c in range(V):
                exact[(a, b, c)] = float(P[0, a] * P[a, b] * P[b, c])
    return counts, exact


def test_rejection_sampling_matches_the_target_exactly():
    counts, exact = sample_sequences(rejection_sample)
    stat, df = chi_square(counts, exact, N_SEQ)
    print(f"correct rule: chi2 {stat:.1f}, df {df}, threshold {chi2_threshold(df):.1f}")
    assert stat < chi2_threshold(df)


@pytest.mark.parametrize("rule", [accept_always, resample_from_target])
def test_wrong_rules_are_detected(rule):
    counts, exact = sample_sequences(rule)
    stat, df = chi_square(counts, exact, N_SEQ)
    print(f"{rule.__name__}: chi2 {stat:.1f}, df {df}, threshold {chi2_threshold(df):.1f}")
    assert stat > chi2_threshold(df)


def test_greedy_special_cases():
    # Rejection sampling with one-hot distributions is greedy acceptance (and never needs the residual fallback).
    gen = torch.Generator().manual_seed(0)
    eye = torch.eye(V)
    assert rejection_sample(eye[[1, 2, 3]], eye[[1, 0]], [1, 0], gen) == [1, 2]
    assert rejection_sample(eye[[1, 2, 3]], eye[[1, 2]], [1, 2], gen) == [1, 2, 3]
    assert spec_decode.greedy_accept([1, 2, 3], [1, 0]) == [1, 2]
    assert spec_decode.greedy_accept([1, 2, 3], [0, 2]) == [1]
    assert spec_decode.greedy_accept([1, 2, 3], [1, 2]) == [1, 2, 3]


# ---- 2. the engine, on a 16-token model ---------------------------------------------------------------------------
PROMPT = [3, 7, 2, 9]
PARAMS = dict(temperature=0.9, top_k=12, max_new_tokens=4, ignore_eos=True)
N_REQ = 1500


@pytest.fixture(scope="module")
def vocab16_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("vocab16")
    raw = tiny_config_dict("deepseek_v3", vocab_size=16)
    model = build_model(ModelConfig.from_hf_dict(raw), torch.float32, KernelBackends.create())
    init_dummy_weights(model, seed=5, std=0.15)
    save_file(export_hf_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw))
    return out


def exact_target(engine: LLMEngine, params: SamplingParams) -> tuple[dict, dict]:
    """p(t1, t2) and p(t3) of the target under params, from one forward over every (t1, t2) continuation."""
    vocab, pool = engine.model_config.vocab_size, engine.pool
    seqs = [PROMPT + [a, b] for a in range(vocab) for b in range(vocab)]
    n, qo, slots, pages = len(seqs[0]), [0], [], []
    for _ in seqs:
        p = pool.allocator.alloc(-(-n // pool.page_size))
        pages.append(p)
        slots.append(pool.slots_for(p, 0, n))
        qo.append(qo[-1] + n)
    batch = ForwardBatch(ForwardMode.EXTEND, torch.tensor(sum(seqs, [])), torch.arange(n).repeat(len(seqs)),
                         torch.cat(slots), pool.page_size, qo_indptr=qo, prefix_lens=[0] * len(seqs),
                         page_tables=pages)
    logits = engine.model.logits(engine.model(batch, pool.kv)).view(len(seqs), n, vocab)
    for p in pages:
        pool.allocator.decref(p)
    probs = lambda row: probs_after_processing(row, params).double()  # noqa: E731
    p1 = probs(logits[0, n - 3])
    p2 = torch.stack([probs(logits[a * vocab, n - 2]) for a in range(vocab)])  # (t1, t2)
    joint = p1[:, None] * p2
    p3 = sum(joint[a, b] * probs(logits[a * vocab + b, n - 1]) for a in range(vocab) for b in range(vocab))
    return ({(a, b): float(joint[a, b]) for a in range(vocab) for b in range(vocab)},
            {(c,): float(p3[c]) for c in range(vocab)})


def engine_statistics(model_dir) -> tuple[list[tuple[float, int]], float]:
    engine = LLMEngine(EngineConfig(str(model_dir), cache=CacheConfig(page_size=4, num_pages=4096),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=8192,
                                                              max_running_requests=N_REQ),
                                    speculative=SpeculativeConfig("NEXTN", 2)))
    params = [SamplingParams(seed=i, **PARAMS) for i in range(N_REQ)]
    outs = engine.generate([PROMPT] * N_REQ, params)
    joint, marginal = exact_target(engine, params[0])
    c12 = Counter(tuple(o.output_ids[:2]) for o in outs)
    c3 = Counter((o.output_ids[2],) for o in outs)
    return [chi_square(c12, joint, N_REQ), chi_square(c3, marginal, N_REQ)], engine.speculator.mean_accept_length


def test_engine_sampling_matches_the_target(vocab16_dir):
    results, accept = engine_statistics(vocab16_dir)
    for (stat, df), what in zip(results, ("(t1, t2)", "t3")):
        print(f"{what}: chi2 {stat:.1f}, df {df}, threshold {chi2_threshold(df):.1f}; accept length {accept:.2f}")
        assert stat < chi2_threshold(df)
    assert accept > 1.1  # drafts are accepted often enough for the acceptance path to matter


def test_engine_with_a_wrong_rule_fails(vocab16_dir, monkeypatch):
    monkeypatch.setattr(spec_decode, "rejection_sample", accept_always)
    results, _ = engine_statistics(vocab16_dir)
    print("accept_always in the engine:", [(round(s, 1), df) for s, df in results])
    assert any(stat > chi2_threshold(df) for stat, df in results)
