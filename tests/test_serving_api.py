"""The client API's contract on a running stack: status codes for bad input and no room, model info, health and
reflection, seeded sampling and stop strings identical to the single-process engine."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.engine import EngineConfig, LLMEngine
from pdserve.kv_cache import CacheConfig
from pdserve.sampling import SamplingParams
from pdserve.v1 import generate_pb2 as gen_pb
from pdserve.v1 import generate_pb2_grpc as gen_grpc
from pdserve.v1 import worker_pb2_grpc as pb_grpc

from stack import decode_updates, generate, start_stack, wait_idle

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tiny_v3_dir, tmp_path_factory):
    # A decode pool of 40 pages x 4 tokens: a 200-token prompt cannot be reserved there.
    s = start_stack(tiny_v3_dir, tmp_path_factory.mktemp("logs-api"), decode_args=["--num-pages", "40"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine(tiny_v3_dir):
    return LLMEngine(EngineConfig(str(tiny_v3_dir), cache=CacheConfig(page_size=4, num_pages=512)))


def call(stack, request: gen_pb.GenerateRequest) -> grpc.RpcError:
    with grpc.insecure_channel(stack.router.address) as ch:
        with pytest.raises(grpc.RpcError) as info:
            list(gen_grpc.GenerationStub(ch).Generate(request, timeout=30))
    return info.value


@pytest.mark.parametrize("request_kwargs, field", [
    ({}, "prompt"),
    ({"text": ""}, "text"),
    ({"tokenized": gen_pb.TokenizedInput(input_ids=[])}, "tokenized"),
    ({"tokenized": gen_pb.TokenizedInput(input_ids=[1, 10_000_000])}, "input_ids"),
    ({"text": "hi", "sampling_params": gen_pb.SamplingParams(temperature=-1.0)}, "temperature"),
    ({"text": "hi", "sampling_params": gen_pb.SamplingParams(top_p=1.5)}, "top_p"),
    ({"text": "hi", "sampling_params": gen_pb.SamplingParams(max_new_tokens=0)}, "max_new_tokens"),
])
def test_bad_requests_are_invalid_argument_naming_the_field(stack, request_kwargs, field):
    err = call(stack, gen_pb.GenerateRequest(**request_kwargs))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.details()


def test_no_kv_room_is_resource_exhausted_and_leaks_nothing(stack):
    err = call(stack, gen_pb.GenerateRequest(tokenized=gen_pb.TokenizedInput(input_ids=[7] * 200)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "pages" in err.details()
    idle = wait_idle(stack.decode[0])
    assert idle.num_free_pages == idle.num_total_pages


def test_unknown_request_is_not_found(stack):
    with grpc.insecure_channel(stack.decode[0].address) as ch:
        updates = decode_updates(pb_grpc.DecodeWorkerStub(ch), "never-reserved", timeout=5)
    assert [u.failure.code for u in updates] == [grpc.StatusCode.NOT_FOUND.value[0]], updates
    assert "not reserved" in updates[0].failure.message


def test_model_info_health_and_reflection(stack, engine):
    with grpc.insecure_channel(stack.router.address) as ch:
        info = gen_grpc.GenerationStub(ch).GetModelInfo(gen_pb.GetModelInfoRequest(), timeout=5)
        assert info.vocab_size == engine.model_config.vocab_size and info.model_type == "deepseek_v3"
        assert set(info.eos_token_ids) == engine.eos_token_ids and info.max_context_length > 0
    for proc, service in [(stack.router, "pdserve.v1.Generation"), (stack.prefill[0], "pdserve.v1.PrefillWorker"),
                          (stack.decode[0], "pdserve.v1.DecodeWorker")]:
        with grpc.insecure_channel(proc.address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            reflect = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
            names = {s.name for s in next(reflect).list_services_response.service}
            assert {service, "grpc.health.v1.Health"} <= names


def test_seeded_sampling_and_stop_strings_match_single_process(stack, engine):
    prompt = "The router sends each request to"
    sampled = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, top_k=40, seed=1234, ignore_eos=True)
    want = engine.generate([prompt], sampled)[0]
    got = generate(stack.router.address, prompt, sampled)
    assert got.output_ids == want.output_ids  # the RNG state travels with the KV

    greedy_text = engine.generate([prompt], SamplingParams(max_new_tokens=16, ignore_eos=True))[0].new_text
    stop = greedy_text[6:9]
    params = SamplingParams(max_new_tokens=16, stop=(stop,), ignore_eos=True)
    want = engine.generate([prompt], params)[0]
    got = generate(stack.router.address, prompt, params)
    assert (got.output_ids, got.text, got.finish_reason) == (want.output_ids, want.new_text, "stop")
    assert stop not in got.text
