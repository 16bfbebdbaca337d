"""Tensor parallelism end to end on the CPU (Gloo, fp32): an engine of 2 ranks (this process and a real second
process) gives the single-process engine's greedy tokens, on the trained demo model (NextN speculation included),
on random V3 and V2 models and on a block-FP8 one, with each expert split (TP) or the experts split (EP), and with
attention data-parallel over the requests (DP attention); prompts are batched, chunked and hit the prefix cache."""

from __future__ import annotations

import pytest

from pdserve.config import ParallelConfig
from pdserve.cuda_graph import CudaGraphConfig
from pdserve.engine import EngineConfig, LLMEngine, StepHooks
from pdserve.kv_cache import CacheConfig, token_slots
from pdserve.sampling import SamplingParams
from pdserve.scheduler import SchedulerConfig
from pdserve.spec_decode import SpeculativeConfig

from golden import PROMPTS
from test_tp_weights import fp8_checkpoint

GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)
# A shared prefix longer than a page (run again, they hit the prefix cache) and a prompt longer than a step's token
# budget (chunked prefill).
SHARED = [list(range(40, 70)) + [3, 4, 5], list(range(40, 70)) + [9]]
ID_PROMPTS = SHARED + [list(range(200, 260)), [7]]


def engine(model_dir, tp: int, ep: int = 1, dp_attention: bool = False, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(str(model_dir), dtype="float32", cache=CacheConfig(page_size=4, num_pages=256),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=48, max_running_requests=8),
                                  parallel=ParallelConfig(tp_size=tp, ep_size=ep, dp_attention=dp_attention), **kw),
                     progress=lambda _m: None)


def outputs(e: LLMEngine, prompts) -> list[tuple[list[int], int]]:
    """(tokens, cached prompt tokens) of every prompt at once (continuous batching), then of the shared-prefix
    prompts again, one by one (prefix-cache hits)."""
    runs = e.generate(prompts, GREEDY) + [e.generate([p], GREEDY)[0] for p in SHARED]
    return [(o.output_ids, o.cached_tokens) for o in runs]


@pytest.fixture(scope="module")
def single_outputs():
    """outputs() of the single-process engine per model folder, computed once: the TP and EP runs of a model
    compare against the same reference."""
    done: dict[str, list[tuple[list[int], int]]] = {}

    def get(model_dir) -> list[tuple[list[int], int]]:
        if str(model_dir) not in done:
            done[str(model_dir)] = outputs(engine(model_dir, 1), ID_PROMPTS)
        return done[str(model_dir)]

    return get


def compare(model_dir, want, ep: int = 1) -> None:
    parallel = engine(model_dir, 2, ep)
    try:
        got = outputs(parallel, ID_PROMPTS)
    finally:
        parallel.close()
    assert any(cached for _, cached in got)  # some prompt reused the pages of another
    assert got == want


@pytest.fixture(scope="module")
def trained(trained_model_dir):
    """(the single-process engine, its outputs) on the demo model."""
    single = engine(trained_model_dir, 1)
    return single, outputs(single, [PROMPTS[0], PROMPTS[3]] + ID_PROMPTS)


def test_tp2_gives_the_single_process_tokens_on_the_trained_model(trained_model_dir, trained):
    single, want = trained
    parallel = engine(trained_model_dir, 2)
    try:
        got = outputs(parallel, [PROMPTS[0], PROMPTS[3]] + ID_PROMPTS)
        assert parallel.num_overlapped_steps > 0  # decode steps whose tokens only rank 0's device had
        assert got == want and any(cached for _, cached in got)
        # the logits behind them: the logprobs of every token and its alternatives, TP2 against one process
        lp = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=3)
        a, b = single.generate(PROMPTS[:2], lp), parallel.generate(PROMPTS[:2], lp)
        diff = max(abs(x - y) for oa, ob in zip(a, b) for ta, tb in zip(oa.logprobs, ob.logprobs)
                   for x, y in zip([ta.logprob] + [t[1] for t in ta.top], [tb.logprob] + [t[1] for t in tb.top]))
        print(f"max |logprob TP2 - TP1| = {diff:.2e}")
        assert diff < 1e-4
        check_prefilled_requests_join(single, parallel)
    finally:
        # At the stop rank 0's CUDA graphs go before its group (on GPUs the group's shutdown waits for them): the
        # engine's release, then any other, each while the group is still there.
        released = []
        parallel.ranks.first_release(lambda: released.append(parallel.ranks.group._group is not None))
        parallel.close()
    assert released == [True] and parallel.runner.graphs is None and parallel.ranks.group._group is None


def test_ep2_gives_the_single_process_tokens_on_the_trained_model(trained_model_dir, trained):
    """Each rank holds 4 of the 8 experts whole; the MTP layer's MoE too."""
    _, want = trained
    parallel = engine(trained_model_dir, 2, ep=2)
    try:
        assert parallel.model.layers[1].mlp.w13.shape[0] == 4
        assert outputs(parallel, [PROMPTS[0], PROMPTS[3]] + ID_PROMPTS) == want
    finally:
        parallel.close()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-buffers"])
def test_tp2_with_nextn_speculation_is_lossless(trained_model_dir, trained, graphs):
    """Drafts chained through the MTP layer on every rank, verified by the target: the plain greedy tokens.
    graph-buffers: the target's and the MTP layer's rows through the CUDA graphs' static buffers, run eagerly
    (CudaGraphConfig.eager_replay), each rank filling its own from rank 0's packed inputs."""
    _, want = trained
    kw = dict(cuda_graph=CudaGraphConfig(max_bs=8, eager_replay=True)) if graphs else {}
    parallel = engine(trained_model_dir, 2, speculative=SpeculativeConfig("NEXTN", 3), **kw)
    try:
        assert outputs(parallel, [PROMPTS[0], PROMPTS[3]] + ID_PROMPTS) == want
        if graphs:
            assert parallel.runner.graphs.replays > 0 and parallel.runner.mtp_graphs.replays > 0
    finally:
        parallel.close()


@pytest.mark.parametrize("model, ep", [("tiny_v3_dir", 1), ("tiny_v2_dir", 1), ("tiny_v2_dir", 2)])
def test_tp2_gives_the_single_process_tokens_on_random_models(model, ep, request, single_outputs):
    model_dir = request.getfixturevalue(model)
    compare(model_dir, single_outputs(model_dir), ep)


@pytest.fixture(scope="module")
def fp8_32_dir(tmp_path_factory, tiny_v3_dir) -> str:
    return fp8_checkpoint(tmp_path_factory.mktemp("tp-engine") / "fp8-32", tiny_v3_dir, 32)


@pytest.mark.parametrize("ep", [1, 2])
def test_tp2_gives_the_single_process_tokens_with_fp8_blocks(fp8_32_dir, single_outputs, ep):
    compare(fp8_32_dir, single_outputs(fp8_32_dir), ep)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-buffers"])
def test_dp_attention_gives_the_single_process_tokens(trained_model_dir, trained, graphs):
    """TP2 + DP attention: each request's attention on one rank, over that rank's own pool; the MLP/MoE over both
    ranks' tokens. Prompts of different lengths and output budgets keep both ranks busy, then leave one idle while
    the other still decodes (it joins every collective with no tokens). graph-buffers: decode steps through the
    CUDA graphs' static buffers, run eagerly (CudaGraphConfig.eager_replay): each rank's rows padded to the bucket of
    the rank with the most, every rank's whole bucket gathered for the MLP, as the captured graphs run on GPUs."""
    single, want = trained
    kw = dict(cuda_graph=CudaGraphConfig(max_bs=8, eager_replay=True)) if graphs else {}
    parallel = engine(trained_model_dir, 2, dp_attention=True, **kw)
    try:
        assert (parallel.runner.graphs is not None) == graphs
        assert parallel.model.layers[0].self_attn.num_heads == parallel.model_config.num_attention_heads  # whole
        assert parallel.kv_capacity_tokens == 2 * single.kv_capacity_tokens
        got = outputs(parallel, [PROMPTS[0], PROMPTS[3]] + ID_PROMPTS)
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]

        prompts = [PROMPTS[0], PROMPTS[3]] + ID_PROMPTS
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (2, 12, 5, 9, 1, 7)]
        ids = [parallel.add_request(p, sp) for p, sp in zip(prompts, params)]
        final, per_step = {}, []
        while parallel.has_unfinished:
            per_step.append(tuple(parallel.scheduler.running_per_rank()))
            final.update((o.request_id, o.output_ids) for o in parallel.step() if o.finished)
        assert any(min(n) > 0 for n in per_step) and any(min(n) == 0 < max(n) for n in per_step), per_step
        assert [final[i] for i in ids] == [o.output_ids for o in single.generate(prompts, params)]

        check_prefilled_requests_join(single, parallel)
        if graphs:
            assert parallel.runner.graphs.replays > 0
    finally:
        parallel.close()


class _Captured(StepHooks):
    """What a prefill worker ships of each prompt: its first token and every layer's KV rows."""

    def __init__(self, engine: LLMEngine):
        self.engine, self.rows = engine, {}

    def on_prefilled(self, prompts, first_tokens, hidden):
        pool = self.engine.pool
        for req, tok in zip(prompts, first_tokens):
            slots = token_slots(req.pages, req.num_prompt_tokens, pool.page_size)
            self.rows[req.request_id] = (tok, pool.kv[:, slots].clone())  # (layers, prompt tokens, kv_dim)


def check_prefilled_requests_join(single: LLMEngine, parallel: LLMEngine) -> None:
    """A decode worker's way in: prompts computed elsewhere land in rank 0's pool (as a transfer puts them) and join
    with their first token; under TP every rank gets a copy of their KV, under DP attention each moves to the least
    loaded rank's pool; they decode the single-process tokens, and every rank's pool is idle afterwards."""
    prompts = [PROMPTS[0], PROMPTS[3]] + ID_PROMPTS
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    want = [o.output_ids for o in single.generate(prompts, params)]
    captured = _Captured(single)
    single.hooks = captured
    try:
        computed = [single.add_request(p, SamplingParams(max_new_tokens=1, ignore_eos=True)) for p in prompts]
        while single.has_unfinished:
            single.step()
    finally:
        single.hooks = StepHooks()
    pool, ranks = parallel.pool, []
    for i, rid in enumerate(computed):
        first, rows = captured.rows[rid]
        ids = single.encode(prompts[i])
        pages = parallel.prefix_cache.alloc_with_eviction(-(-len(ids) // pool.page_size))
        pool.kv[:, token_slots(pages, len(ids), pool.page_size)] = rows  # what the transport writes
        parallel.add_prefilled(f"joined-{i}", ids, params, pages, first, 0)
        ranks.append(parallel._requests[f"joined-{i}"].dp_rank)
    dp = parallel.config.parallel.dp_attention
    assert sorted(set(ranks)) == ([0, 1] if dp else [0]), ranks  # under DP attention some moved to rank 1's pool
    final = {}
    while parallel.has_unfinished:
        final.update((o.request_id, o.output_ids) for o in parallel.step() if o.finished)
    assert [final[f"joined-{i}"] for i in range(len(prompts))] == want
    assert parallel.kv_pages_in_use_by_requests() == 0


def test_dp_attention_with_ep_and_nextn_is_lossless(trained_model_dir, trained):
    """DP attention over expert-parallel MoEs, drafts chained through the MTP layer (its attention DP too, eager),
    verified through the target's graph buffers (CudaGraphConfig.eager_replay: rows padded per rank)."""
    _, want = trained
    parallel = engine(trained_model_dir, 2, ep=2, dp_attention=True, speculative=SpeculativeConfig("NEXTN", 3),
                      cuda_graph=CudaGraphConfig(max_bs=8, eager_replay=True))
    try:
        got = outputs(parallel, [PROMPTS[0], PROMPTS[3]] + ID_PROMPTS)
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
        assert parallel.runner.graphs.replays > 0 and parallel.runner.mtp_graphs is None
    finally:
        parallel.close()
