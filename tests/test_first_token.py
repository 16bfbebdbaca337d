"""The first token reaches the client with the prefill worker's answer, not after the decode worker received the KV
(router/first_token.py). A decode worker whose KV arrivals wait DELAY_S (a test hook standing for a slow transfer,
tests/hooks/sitecustomize.py)
shows it: the first token comes well before DELAY_S, the second after it, and the tokens and text are the
single-process engine's."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from golden import GREEDY, PROMPTS
from pdserve.serving.rpc_convert import sampling_to_proto
from pdserve.sampling import SamplingParams
from pdserve.v1 import generate_pb2 as gen_pb
from pdserve.v1 import generate_pb2_grpc as gen_grpc
from stack import hooks_env, start, start_stack, stop_all, wait_idle

DELAY_S = 2.0

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slow_kv_stack(tiny_v3_dir, tmp_path_factory):
    stack = start_stack(tiny_v3_dir, tmp_path_factory.mktemp("slow-kv"),
                        decode_env=hooks_env(PDTEST_DECODE_SLOW_KV_ARRIVAL_S=DELAY_S))
    yield stack
    stack.stop()


def timed_chunks(address: str, prompt, params: SamplingParams) -> tuple[list[tuple[float, list[int], str]], list[int]]:
    """[(seconds after sending, token ids, text)] of each chunk, and the complete message's output ids."""
    req = gen_pb.GenerateRequest(sampling_params=sampling_to_proto(params))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.tokenized.input_ids.extend(prompt)
    chunks = []
    with grpc.insecure_channel(address) as ch:
        start_s = time.monotonic()
        for msg in gen_grpc.GenerationStub(ch).Generate(req, timeout=60):
            if msg.HasField("chunk"):
                chunks.append((time.monotonic() - start_s, list(msg.chunk.token_ids), msg.chunk.text))
            else:
                return chunks, list(msg.complete.output_ids)
    raise AssertionError("the stream ended without a complete message")


def test_the_first_token_comes_with_the_prefill_answer_ahead_of_the_decode_worker(slow_kv_stack, reference):
    outputs, _ = reference
    cases = (0, 3)  # ASCII, and multi-byte characters split across tokens
    # Side by side: each request's KV waits DELAY_S on its own timer, so neither waits for the other's.
    with ThreadPoolExecutor(len(cases)) as pool:
        runs = list(pool.map(lambda i: timed_chunks(slow_kv_stack.router.address, PROMPTS[i], GREEDY), cases))
    for i, (chunks, output_ids) in zip(cases, runs, strict=True):
        (t1, first, text1), (t2, _, _) = chunks[0], chunks[1]
        assert first == outputs[i].output_ids[:1] and t1 < DELAY_S / 2 <= DELAY_S <= t2, chunks
        assert [t for _, ids, _ in chunks for t in ids] == output_ids == outputs[i].output_ids
        assert "".join(text for _, _, text in chunks) == outputs[i].new_text
        if i == 0:
            assert text1, "the first token's text comes with it"
    assert wait_idle(slow_kv_stack.decode[0]).num_running_requests == 0


def test_a_first_token_that_ends_the_request_or_has_logprobs_comes_from_the_decode_worker(slow_kv_stack, reference):
    outputs, _ = reference
    one = SamplingParams(max_new_tokens=1, ignore_eos=True)
    with_logprobs = SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=2)
    with ThreadPoolExecutor(2) as pool:  # side by side, as above
        ended, logprobs = pool.map(lambda p: timed_chunks(slow_kv_stack.router.address, PROMPTS[0], p),
                                   (one, with_logprobs))
    chunks, output_ids = ended
    assert output_ids == outputs[0].output_ids[:1] and chunks[0][0] >= DELAY_S, chunks
    chunks, output_ids = logprobs
    assert output_ids == outputs[0].output_ids[:3] and chunks[0][0] >= DELAY_S, chunks


def test_a_router_without_a_tokenizer_sends_the_first_token_and_its_text_with_the_second(slow_kv_stack, reference,
                                                                                        tmp_path):
    outputs, engine = reference
    workers = ["--prefill", slow_kv_stack.prefill[0].address, "--decode", slow_kv_stack.decode[0].address]
    router = start("router", workers, tmp_path, "router-no-tokenizer")
    try:
        prompt = engine.encode(PROMPTS[0])
        chunks, output_ids = timed_chunks(router.address, prompt, GREEDY)
    finally:
        stop_all([router])
    (t1, first, text1), (t2, _, text2) = chunks[0], chunks[1]
    assert first == outputs[0].output_ids[:1] and text1 == "" and t1 < DELAY_S <= t2, chunks
    assert output_ids == outputs[0].output_ids
    assert "".join(text for _, _, text in chunks) == outputs[0].new_text and text2
