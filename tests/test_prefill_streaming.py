"""The prefill engine streams each layer's KV as soon as that layer is computed (before the forward ends), ships
every layer including NextN's, and the rows it ships are exactly the pool's rows for the prompt."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import EngineConfig, LLMEngine
from pdserve.forward_batch import ForwardBatch, ForwardMode
from pdserve.kv_cache import CacheConfig
from pdserve.kv_transfer import TransferState, TransferStats
from pdserve.prefill_service.engine import PrefillEngine, PrefillJob
from pdserve.sampling import SamplingParams
from pdserve.scheduler import SchedulerConfig
from pdserve.spec_decode import SpeculativeConfig


class RecordingHandle:
    """A room that keeps what it is sent; its transfer ends (DONE) with its aux record."""
    streams_layers = True  # as TCP's and NCCL's handles
    transport, link = "tcp", None

    def __init__(self, events):
        self.events, self.layers, self.aux = events, {}, None

    def send_rows(self, layer, source, slots=None):
        self.events.append(f"send {layer}")
        self.layers[layer] = (source if slots is None else source[slots]).clone()

    def send_layers(self, first_layer, source, slots=None):
        for i in range(source.shape[0]):
            self.send_rows(first_layer + i, source[i], slots)

    def finish(self, aux):
        self.events.append("finish")
        self.aux = aux

    def abort(self):
        self.events.append("abort")

    def poll(self) -> TransferState:
        return TransferState.DONE if self.aux is not None else TransferState.TRANSFERRING

    def wait(self, timeout=None) -> TransferStats:
        return TransferStats(bytes_sent=len(self.layers), seconds=0.0)


class BulkRecordingHandle(RecordingHandle):
    streams_layers = False  # as cuda_ipc's: every layer at once after the forward

    def send_layers(self, first_layer, source, slots=None):
        self.events.append(f"send layers {first_layer}..{first_layer + source.shape[0] - 1}")
        for i in range(source.shape[0]):
            self.layers[first_layer + i] = (source[i] if slots is None else source[i][slots]).clone()


SPECULATING = SpeculativeConfig("NEXTN", 2)  # a prefill worker started with --speculative-algorithm: MTP KV too


def add_bound(engine: PrefillEngine, job: PrefillJob, handle, ships_mtp: bool = True) -> None:
    """A job whose bind is there before its first step (as when the reservation came back at once)."""
    engine.add(job)
    engine.bind(job.request_id, handle, ships_mtp)


def test_layers_stream_during_the_forward(tiny_v3_dir):
    core = LLMEngine(EngineConfig(str(tiny_v3_dir), cache=CacheConfig(page_size=4, num_pages=64),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=6), speculative=SPECULATING))
    events: list[str] = []
    last = core.model.layers[-1]
    last.register_forward_pre_hook(lambda *_: events.append("last layer starts"))
    engine = PrefillEngine(core, sender=None)
    prompt = core.encode("The router sends each request to a prefill worker")  # > 6 tokens: several chunks
    handle = RecordingHandle(events)
    add_bound(engine, PrefillJob("r1", prompt, SamplingParams(max_new_tokens=4)), handle)
    results = []
    while engine.has_work:
        results += engine.step()
    # Only the final chunk sends, and layer 0 goes out before the last layer of that forward begins.
    final = events[events.index("send 0") - 1:]
    assert events.index("send 0") < len(events) - 1 - events[::-1].index("last layer starts")
    assert [e for e in final if e.startswith("send")] == [f"send {i}" for i in range(core.model_config.num_kv_layers)]
    assert final[-1] == "finish"
    # Rows shipped == the pool's rows for the whole prompt, every layer (the MTP layer included).
    assert len(results) == 1 and handle.aux["first_token_id"] == results[0].first_token_id
    single = LLMEngine(EngineConfig(str(tiny_v3_dir), cache=CacheConfig(page_size=4, num_pages=64)))
    pages = single.pool.allocator.alloc(-(-len(prompt) // 4))
    n = len(prompt)
    batch = ForwardBatch(ForwardMode.EXTEND, torch.tensor(prompt), torch.arange(n), single.pool.slots_for(pages, 0, n),
                         4, qo_indptr=[0, n], prefix_lens=[0], page_tables=[pages])
    hidden = single.model(batch, single.pool.kv)
    slots = single.pool.slots_for(pages, 0, n)
    # (chunked vs one-shot prefill: equal up to fp32 summation order)
    for layer in range(core.model_config.num_hidden_layers):
        torch.testing.assert_close(handle.layers[layer], single.pool.kv[layer][slots], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(handle.aux["hidden"], hidden[-1], rtol=1e-4, atol=1e-4)
    assert handle.layers[core.model_config.num_hidden_layers].abs().sum() > 0  # NextN KV was computed
    assert core.kv_pages_in_use_by_requests() == 0


def test_without_speculation_no_mtp_layer_is_computed_or_shipped(tiny_v3_dir):
    """A decode worker that does not speculate asks for the main model's layers only (skip_mtp_kv: bound with
    ships_mtp=False); a prefill worker without --speculative-algorithm never computes the MTP layer's prompt KV, and
    refuses a destination that needs it; the main layers' rows are those a speculating prefill worker ships."""
    prompt_text = "The router sends each request to a prefill worker"

    def run(speculative, ships_mtp):
        core = LLMEngine(EngineConfig(str(tiny_v3_dir), cache=CacheConfig(page_size=4, num_pages=64),
                                      speculative=speculative))
        engine = PrefillEngine(core, sender=None)
        passes = []
        extend = core.runner.mtp_extend
        core.runner.mtp_extend = lambda *a: (passes.append(1), extend(*a))
        handle = RecordingHandle([])
        add_bound(engine, PrefillJob("r", core.encode(prompt_text), SamplingParams(max_new_tokens=4)), handle,
                  ships_mtp)
        while engine.has_work:
            engine.step()
        return core, engine, handle, passes

    core, engine, plain, passes = run(SpeculativeConfig(), ships_mtp=False)
    main, total = core.model_config.num_hidden_layers, core.model_config.num_kv_layers
    assert not engine.computes_mtp_kv and not passes and engine.num_layers_for(ships_mtp=False) == main
    assert sorted(plain.layers) == list(range(main))
    with pytest.raises(ValueError, match="start it with the decode worker's --speculative-algorithm"):
        engine.check_destination(PrefillJob("s", [1, 2, 3], SamplingParams()), [0], ships_mtp=True)

    _, engine, speculating, passes = run(SPECULATING, ships_mtp=True)
    assert engine.computes_mtp_kv and passes and engine.num_layers_for(ships_mtp=True) == total
    assert sorted(speculating.layers) == list(range(total))
    for layer in range(main):
        torch.testing.assert_close(plain.layers[layer], speculating.layers[layer], rtol=1e-5, atol=1e-5)
    assert plain.aux["first_token_id"] == speculating.aux["first_token_id"]
    _, _, to_plain_decode, _ = run(SPECULATING, ships_mtp=False)  # a speculating prefill, a plain decode
    assert sorted(to_plain_decode.layers) == list(range(main))


def test_a_transport_that_copies_on_the_gpu_gets_each_prompts_layers_in_one_call(tiny_v3_dir):
    """cuda_ipc's handles do not stream layer by layer (`streams_layers` False): each prompt's main layers go in one
    `send_layers` after the forward, the MTP layer's in one more, with the rows a streaming handle gets; prompts of
    both kinds in one step each get theirs."""
    core = LLMEngine(EngineConfig(str(tiny_v3_dir), cache=CacheConfig(page_size=4, num_pages=64),
                                  speculative=SPECULATING))
    engine = PrefillEngine(core, sender=None)
    events: list[str] = []
    last = core.model.layers[-1]
    last.register_forward_hook(lambda *_: events.append("last layer done"))
    streaming, bulk = RecordingHandle([]), BulkRecordingHandle(events)
    prompts = [core.encode("The router sends each request to a prefill worker"), core.encode("Hello there, decode")]
    add_bound(engine, PrefillJob("s", prompts[0], SamplingParams()), streaming)
    add_bound(engine, PrefillJob("b", prompts[1], SamplingParams()), bulk)
    while engine.has_work:
        engine.step()
    main, total = core.model_config.num_hidden_layers, core.model_config.num_kv_layers
    assert events == ["last layer done", f"send layers 0..{main - 1}", f"send layers {main}..{total - 1}", "finish"]
    assert sorted(streaming.layers) == sorted(bulk.layers) == list(range(total))
    alone = PrefillEngine(LLMEngine(EngineConfig(str(tiny_v3_dir), cache=CacheConfig(page_size=4, num_pages=64),
                                                 speculative=SPECULATING)), sender=None)
    reference = RecordingHandle([])
    add_bound(alone, PrefillJob("b", prompts[1], SamplingParams()), reference)
    while alone.has_work:
        alone.step()
    for layer in range(total):
        torch.testing.assert_close(bulk.layers[layer], reference.layers[layer], rtol=1e-5, atol=1e-5)
    assert bulk.aux["first_token_id"] == reference.aux["first_token_id"]
