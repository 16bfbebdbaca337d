"""Overlap scheduling (pdserve.overlap): decode step N+1 is launched before the host reads step N's tokens. On the CPU
nothing runs ahead, but every piece of its bookkeeping does (placeholders resolved on the device, tokens read one step
late, rows of requests that finished meanwhile dropped, their pages held until the step is read), so the outputs
must be those of the in-order engine, token for token and text for text (fp32)."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.engine import EngineConfig, LLMEngine
from pdserve.kv_cache import CacheConfig
from pdserve.sampling import SamplingParams
from pdserve.scheduler import SchedulerConfig

PROMPTS = ["The router sends each request to a prefill worker",
           "Hello",
           "Mixture-of-experts layers route each token to a few experts chosen by a learned gate. " * 2,
           "def generate(prompt):",
           "Naïve café 東京 🚀"]


def make_engine(model_dir, overlap: bool, max_model_len: int = 4096, num_pages: int = 256) -> LLMEngine:
    return LLMEngine(EngineConfig(str(model_dir), overlap_schedule=overlap,
                                  cache=CacheConfig(page_size=4, num_pages=num_pages),
                                  scheduler=SchedulerConfig(max_model_len=max_model_len)))


def run(engine: LLMEngine, script: dict[int, list], max_steps: int = 400) -> dict[str, tuple]:
    """script: step number -> events before that step, ("add", name, prompt, params) or ("abort", name). Returns
    name -> (token ids, text, finish reason) as streamed, the reason None for an aborted request."""
    ids, tokens, texts, reasons = {}, {}, {}, {}
    step = 0
    while step <= max(script) or engine.has_unfinished:
        for event in script.get(step, []):
            if event[0] == "add":
                _, name, prompt, params = event
                ids[name] = engine.add_request(prompt, params, request_id=name)
                tokens[name], texts[name], reasons[name] = [], "", None
            else:
                engine.abort(ids[event[1]])
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            texts[out.request_id] += out.new_text
            assert out.output_ids == tokens[out.request_id], "output_ids must be what was streamed, no placeholder"
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        step += 1
        assert step < max_steps, "the engine did not go idle"
    return {name: (tokens[name], texts[name], reasons[name]) for name in ids}


def assert_idle(engine: LLMEngine) -> None:
    assert not engine.has_unfinished and engine._launched is None
    assert engine.kv_pages_in_use_by_requests() == 0
    engine.prefix_cache.reset()
    assert engine.pool.allocator.num_used == 0


def both(model_dir, script, **kw) -> tuple[dict, dict, LLMEngine]:
    in_order, overlapped = make_engine(model_dir, False, **kw), make_engine(model_dir, True, **kw)
    expected, got = run(in_order, script), run(overlapped, script)
    assert in_order.num_overlapped_steps == 0
    assert overlapped.num_overlapped_steps > 0, "no step overlapped: the test did not test overlap scheduling"
    assert_idle(in_order)
    assert_idle(overlapped)
    return expected, got, overlapped


@pytest.fixture(scope="module")
def greedy_tokens(tiny_v3_dir) -> list[list[int]]:
    engine = make_engine(tiny_v3_dir, False)
    return [o.output_ids for o in engine.generate(PROMPTS, SamplingParams(max_new_tokens=24, ignore_eos=True))]


def test_staggered_greedy_and_seeded_requests_match_the_in_order_engine(tiny_v3_dir):
    greedy = SamplingParams(max_new_tokens=20, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.8, top_p=0.9, top_k=20, seed=7)
    script = {0: [("add", "a", PROMPTS[0], greedy), ("add", "b", PROMPTS[1], sampled)],
              3: [("add", "c", PROMPTS[2], greedy)],  # admitted while a and b decode: a prefill step in between
              9: [("add", "d", PROMPTS[3], dataclasses.replace(sampled, seed=11, max_new_tokens=7))]}
    expected, got, _ = both(tiny_v3_dir, script)
    assert got == expected
    assert all(reason == "length" for _, _, reason in got.values())


def test_requests_that_stop_on_a_token_the_host_has_not_read_yet(tiny_v3_dir, greedy_tokens):
    """A stop token, a stop string, the context limit: each finishes a request whose next row is already
    launched; that row's token is dropped and nothing of it leaks into the output."""
    stop_token = SamplingParams(max_new_tokens=24, stop_token_ids=(greedy_tokens[0][5],))
    probe = make_engine(tiny_v3_dir, False).generate([PROMPTS[3]], SamplingParams(max_new_tokens=24,
                                                                                   ignore_eos=True))[0]
    stop_text = SamplingParams(max_new_tokens=24, ignore_eos=True,
                               stop=(probe.new_text[len(probe.new_text) // 2:][:3],))
    script = {0: [("add", "token", PROMPTS[0], stop_token), ("add", "text", PROMPTS[3], stop_text),
                  ("add", "long", PROMPTS[1], SamplingParams(max_new_tokens=64, ignore_eos=True))]}
    expected, got, _ = both(tiny_v3_dir, script, max_model_len=40)
    assert got == expected
    assert got["token"][2] == "stop" and got["token"][0][-1] == greedy_tokens[0][5]
    assert got["text"][2] == "stop"
    assert got["long"][2] == "length" and len(got["long"][0]) < 64  # the context (40 tokens) ran out first


def test_an_abort_between_steps_leaves_the_others_exact_and_no_page_behind(tiny_v3_dir):
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    script = {0: [("add", "kept", PROMPTS[0], params), ("add", "gone", PROMPTS[4], params)],
              6: [("abort", "gone")]}
    expected, got, _ = both(tiny_v3_dir, script)
    assert got["kept"] == expected["kept"]
    assert got["gone"][2] is None and 0 < len(got["gone"][0]) < 16


def test_the_launched_step_holds_the_pages_of_a_request_finished_meanwhile(tiny_v3_dir, greedy_tokens):
    """Its row writes KV after the host freed the request's pages: they stay allocated until the step is read, so a
    transfer from another process cannot be handed a page that this step still writes."""
    engine = make_engine(tiny_v3_dir, True)
    engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=24, stop_token_ids=(greedy_tokens[0][5],)),
                       request_id="r")
    finished = []
    while not finished:
        finished = [o for o in engine.step() if o.finished]
    launched = engine._launched
    assert launched is not None and launched.requests[0].request_id == "r"  # its row after the stop token
    held = list(launched.held_pages)
    assert launched.requests[0].pages == []  # the request let go of them ...
    assert min(launched.requests[0].output_ids) >= 0  # (and of the placeholder its dropped row appended)
    assert all(engine.pool.allocator.refcount(p) >= 1 for p in held)  # ... the launched step did not
    assert engine.has_unfinished
    assert engine.step() == []  # reads it, drops the row
    assert_idle(engine)


def test_prefix_cache_after_overlapped_requests(tiny_v3_dir, greedy_tokens):
    """Pages published when an overlapped request finishes hold the right KV: the same prompt again reuses them
    and decodes the same tokens."""
    engine = make_engine(tiny_v3_dir, True)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    first = engine.generate([PROMPTS[2]], params)[0]
    again = engine.generate([PROMPTS[2] + " " + "x"], params)[0]
    reference = make_engine(tiny_v3_dir, False).generate([PROMPTS[2] + " " + "x"], params)[0]
    assert first.output_ids == greedy_tokens[2]
    assert again.cached_tokens > 0
    assert again.output_ids == reference.output_ids
    assert engine.num_overlapped_steps > 0


def test_no_overlap_with_logprobs_or_short_of_pages(tiny_v3_dir):
    """Steps that are not plain decode rows with free pages run in order (and still give the same tokens)."""
    engine = make_engine(tiny_v3_dir, True)
    with_logprobs = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=2))[0]
    assert engine.num_overlapped_steps == 0 and len(with_logprobs.logprobs) == 8
    # A pool so small that requests preempt each other: the scheduler must be free to do it, in order.
    script = {0: [("add", n, p, SamplingParams(max_new_tokens=20, ignore_eos=True))
                  for n, p in zip("abc", PROMPTS[:2] + PROMPTS[3:4])]}
    in_order, overlapped = make_engine(tiny_v3_dir, False, num_pages=16), make_engine(tiny_v3_dir, True, num_pages=16)
    preempted = []
    preempt = overlapped.scheduler._preempt
    overlapped.scheduler._preempt = lambda req: (preempted.append(req.request_id), preempt(req))
    assert run(overlapped, script) == run(in_order, script)
    assert preempted and overlapped.num_overlapped_steps > 0
    assert_idle(overlapped)
