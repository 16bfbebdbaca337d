"""The golden end-to-end check shared by the serving tests (TCP, Gloo, NCCL): greedy tokens through router +
prefill + decode equal the single-process engine's, token for token. The `reference` fixture is in conftest.py."""

from __future__ import annotations

from pdserve.engine import EngineConfig, LLMEngine
from pdserve.kv_cache import CacheConfig
from pdserve.sampling import SamplingParams

from stack import generate

PROMPTS = ["The router sends each request to a prefill worker",
           "Hello",
           "Mixture-of-experts layers route each token to a few experts chosen by a learned gate. " * 2,
           "Naïve café 東京 🚀",
           [5, 6, 7, 8, 9, 10, 11, 12, 13]]
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def reference_outputs(model_dir, dtype: str = "auto") -> tuple[dict, LLMEngine]:
    """({prompt index: RequestOutput}, the engine) of the single-process engine on the CPU."""
    engine = LLMEngine(EngineConfig(str(model_dir), dtype=dtype, cache=CacheConfig(page_size=4, num_pages=512)))
    return {i: engine.generate([p], GREEDY)[0] for i, p in enumerate(PROMPTS)}, engine


def check_against_reference(address, reference):
    outputs, _ = reference
    for i, prompt in enumerate(PROMPTS):
        got = generate(address, prompt, GREEDY)
        want = outputs[i]
        assert got.output_ids == want.output_ids, f"prompt {i}: disaggregated tokens differ"
        assert got.streamed_ids == got.output_ids, "stream out of order or incomplete"
        assert got.text == want.new_text == got.streamed_text
        assert (got.prompt_tokens, got.completion_tokens, got.finish_reason) == (want.prompt_tokens, 12, "length")


def check_concurrently(address, reference, n: int = 32) -> None:
    """`n` requests at once, the golden prompts in turn: each gets the reference's tokens."""
    from concurrent.futures import ThreadPoolExecutor

    outputs, _ = reference
    jobs = [i % len(PROMPTS) for i in range(n)]
    with ThreadPoolExecutor(n) as pool:
        got = list(pool.map(lambda i: generate(address, PROMPTS[i], GREEDY, timeout=120).output_ids, jobs))
    assert got == [outputs[i].output_ids for i in jobs]
