"""The single-process engine end to end on the tiny model: batching, chunked prefill, prefix cache, preemption,
sampling and stop conditions, and KV accounting back to idle."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine
from pdserve.kv_cache import CacheConfig
from pdserve.sampling import SamplingParams
from pdserve.scheduler import SchedulerConfig

PROMPTS = ["The router sends each request to a prefill worker",
           "Hello",
           "Mixture-of-experts layers route each token to a few experts chosen by a learned gate. " * 3,
           "def generate(prompt):",
           "Naïve café 東京 🚀"]
GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)


def make_engine(model_dir, page_size=4, num_pages=256, budget=2048, prefix_cache=True):
    return LLMEngine(EngineConfig(str(model_dir), cache=CacheConfig(page_size=page_size, num_pages=num_pages),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=budget,
                                                            enable_prefix_cache=prefix_cache)))


def assert_idle(engine):
    assert engine.kv_pages_in_use_by_requests() == 0
    engine.prefix_cache.reset()
    assert engine.pool.allocator.num_used == 0


@pytest.fixture(scope="module")
def reference_outputs(tiny_v3_dir):
    """Each prompt alone, one-shot prefill, no prefix cache."""
    engine = make_engine(tiny_v3_dir, prefix_cache=False)
    return [engine.generate([p], GREEDY)[0].output_ids for p in PROMPTS]


def test_batched_equals_alone(tiny_v3_dir, reference_outputs):
    engine = make_engine(tiny_v3_dir)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.output_ids for o in outs] == reference_outputs
    assert all(o.finish_reason == "length" and len(o.output_ids) == 16 for o in outs)
    assert_idle(engine)


def test_chunked_prefill_equals_one_shot(tiny_v3_dir, reference_outputs):
    engine = make_engine(tiny_v3_dir, budget=7)  # the long prompt (~70 tokens) runs in many chunks
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.output_ids for o in outs] == reference_outputs
    assert_idle(engine)


def test_repeated_prompt_hits_prefix_cache(tiny_v3_dir, reference_outputs):
    engine = make_engine(tiny_v3_dir)
    first = engine.generate([PROMPTS[2]], GREEDY)[0]
    again = engine.generate([PROMPTS[2]], GREEDY)[0]
    assert first.cached_tokens == 0
    assert 0 < again.cached_tokens < again.prompt_tokens and again.cached_tokens % 4 == 0
    assert again.output_ids == first.output_ids == reference_outputs[2]
    # A prompt that extends the first one's prompt + output reuses pages covering its generated tokens too.
    longer = engine.encode(PROMPTS[2]) + first.output_ids + [7, 8, 9]
    third = engine.generate([longer], GREEDY)[0]
    assert third.cached_tokens >= again.prompt_tokens
    assert_idle(engine)


def test_preemption_under_a_small_pool_keeps_outputs(tiny_v3_dir, reference_outputs):
    # 40 pages of 4 tokens cannot hold all five requests at once (the long one alone needs ~22).
    engine = make_engine(tiny_v3_dir, num_pages=40)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    requests = list(engine.scheduler.waiting)
    outputs = {}
    while engine.has_unfinished:
        outputs.update({o.request_id: o.output_ids for o in engine.step() if o.finished})
    assert sum(r.num_preemptions for r in requests) > 0, "the pool was meant to be too small for all at once"
    assert [outputs[i] for i in ids] == reference_outputs
    assert_idle(engine)


def test_seeded_sampling_is_reproducible(tiny_v3_dir):
    engine = make_engine(tiny_v3_dir)
    params = [SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=s, ignore_eos=True)
              for s in (1, 1, 2)]
    a, b, c = (o.output_ids for o in engine.generate([PROMPTS[0]] * 3, params))
    assert a == b and a != c
    # The same seed gives the same tokens when batched with other work.
    again = engine.generate([PROMPTS[1], PROMPTS[0]], [GREEDY, params[0]])[1].output_ids
    assert again == a


def test_stop_token_ids_and_stop_strings(tiny_v3_dir, reference_outputs):
    engine = make_engine(tiny_v3_dir)
    ref = reference_outputs[0]
    stop_tok = ref[5]
    first = ref.index(stop_tok)  # the first occurrence ends the request, the stop token included
    out = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=16, stop_token_ids=(stop_tok,)))[0]
    assert out.output_ids == ref[: first + 1] and out.finish_reason == "stop"

    full_text = engine.generate([PROMPTS[0]], GREEDY)[0].new_text
    stop = full_text[len(full_text) // 2: len(full_text) // 2 + 3]
    out = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=16, stop=(stop,), ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.new_text == full_text[: full_text.index(stop)]
    assert_idle(engine)


def test_abort_frees_pages(tiny_v3_dir):
    engine = make_engine(tiny_v3_dir)
    rid = engine.add_request(PROMPTS[2], SamplingParams(max_new_tokens=100, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv_pages_in_use_by_requests() > 0
    assert engine.abort(rid)
    assert not engine.has_unfinished
    assert not engine.abort(rid)  # unknown now
    assert_idle(engine)


def test_bad_input_is_rejected(tiny_v3_dir):
    engine = make_engine(tiny_v3_dir)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="out of the vocabulary"):
        engine.add_request([1, engine.model_config.vocab_size], GREEDY)
    with pytest.raises(ValueError, match="out of the vocabulary"):
        engine.add_request([-1, 1], GREEDY)
    with pytest.raises(ValueError, match="must be integers"):
        engine.add_request([1, 2.0], GREEDY)
    assert engine.encode(torch.tensor([3, 1, 2])) == [3, 1, 2]  # integer tensors and their elements are fine
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([5] * 5000, GREEDY)
    assert not engine.has_unfinished


def test_deepseek_v2_and_fp8_run(tiny_v2_dir, tiny_v3_fp8_dir):
    for model_dir in (tiny_v2_dir, tiny_v3_fp8_dir):
        out = make_engine(model_dir).generate([PROMPTS[0]], GREEDY)[0]
        assert len(out.output_ids) == 16


def test_logprobs_are_the_log_softmax_of_the_logits_and_survive_chunking(tiny_v3_dir):
    """Each token's logprob is log_softmax(logits / T) of the step that sampled it (raw logits when greedy), prompt
    logprobs come out the same whether the prompt is computed in one step or in chunks of 8, and a request that
    asks for none gets none."""
    import torch

    prompt = list(range(3, 33))
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    whole = make_engine(tiny_v3_dir).generate([prompt], params)[0]
    chunked = make_engine(tiny_v3_dir, budget=8).generate([prompt], params)[0]
    assert whole.output_ids == chunked.output_ids and len(whole.prompt_logprobs) == len(prompt)
    assert whole.prompt_logprobs[0] is None and chunked.prompt_logprobs[0] is None
    for a, b in zip(whole.prompt_logprobs[1:] + whole.logprobs, chunked.prompt_logprobs[1:] + chunked.logprobs):
        assert abs(a.logprob - b.logprob) < 1e-4 and [t for t, _ in a.top] == [t for t, _ in b.top]
    assert [lp.token_id for lp in whole.logprobs] == whole.output_ids
    assert [lp.token_id for lp in whole.prompt_logprobs[1:]] == prompt[1:]
    # The reference: the model's logits at the last position of each prefix, through the engine's forward.
    engine = make_engine(tiny_v3_dir)
    seen = []
    engine.sampler.sample = lambda logits, p, g: (seen.append(logits.clone()), torch.argmax(logits, -1))[1]
    engine.generate([prompt], SamplingParams(max_new_tokens=4, ignore_eos=True))
    for lp, logits in zip(whole.logprobs, seen):
        want = torch.log_softmax(logits[0].float(), -1)
        assert abs(lp.logprob - want[lp.token_id].item()) < 1e-5
        assert lp.top[0][1] == pytest.approx(want.max().item(), abs=1e-5)
    engine, seen = make_engine(tiny_v3_dir), []
    sample = engine.sampler.sample
    engine.sampler.sample = lambda logits, p, g: (seen.append(logits.clone()), sample(logits, p, g))[1]
    warm = engine.generate([prompt], SamplingParams(max_new_tokens=3, temperature=0.5, seed=1, logprobs=0))[0]
    for lp, logits in zip(warm.logprobs, seen, strict=True):  # sampled: the temperature is applied
        assert lp.top == ()
        assert abs(lp.logprob - torch.log_softmax(logits[0].float() / 0.5, -1)[lp.token_id].item()) < 1e-5
    plain = make_engine(tiny_v3_dir).generate([prompt], SamplingParams(max_new_tokens=2))[0]
    assert plain.logprobs is None and plain.prompt_logprobs is None


def test_logprobs_are_refused_with_speculative_decoding(tiny_v3_dir):
    from pdserve.spec_decode import SpeculativeConfig

    engine = LLMEngine(EngineConfig(str(tiny_v3_dir), cache=CacheConfig(page_size=4, num_pages=64),
                                    speculative=SpeculativeConfig("NEXTN")))
    with pytest.raises(ValueError, match="^logprobs: not available .*speculative"):
        engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=2, logprobs=1))
    assert engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2, prompt_logprobs=1))[0].prompt_logprobs
