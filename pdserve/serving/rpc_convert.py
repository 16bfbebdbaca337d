"""Protobuf <-> internal dataclasses, at the edge only: nothing below the servicers imports *_pb2."""

from __future__ import annotations

from typing import Optional, Sequence

from pdserve.common.values import KVLayout, SamplingParams, TokenLogprob
from pdserve.v1 import generate_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as worker_pb

DEFAULT_MAX_NEW_TOKENS = 64

FINISH_TO_PROTO = {"stop": gen_pb.FINISH_REASON_STOP, "length": gen_pb.FINISH_REASON_LENGTH,
                   "abort": gen_pb.FINISH_REASON_ABORT}
FINISH_FROM_PROTO = {v: k for k, v in FINISH_TO_PROTO.items()}


def sampling_from_proto(msg: gen_pb.SamplingParams) -> SamplingParams:
    """Raises ValueError naming the field (mapped to INVALID_ARGUMENT)."""
    return SamplingParams(
        max_new_tokens=msg.max_new_tokens if msg.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS,
        temperature=msg.temperature if msg.HasField("temperature") else 0.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k if msg.HasField("top_k") else 0,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
    )


def sampling_to_proto(p: SamplingParams) -> gen_pb.SamplingParams:
    msg = gen_pb.SamplingParams(max_new_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p,
                                top_k=p.top_k, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
                                ignore_eos=p.ignore_eos)
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    return msg


def logprob_to_proto(lp: Optional[TokenLogprob]) -> gen_pb.TokenLogprobs:
    """None (a token whose logprob another worker computed) -> an empty entry."""
    if lp is None:
        return gen_pb.TokenLogprobs()
    return gen_pb.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob,
                                top=[gen_pb.TokenLogprob(token_id=t, logprob=v) for t, v in lp.top])


def logprobs_to_proto(lps: Optional[Sequence[Optional[TokenLogprob]]]) -> list[gen_pb.TokenLogprobs]:
    return [logprob_to_proto(lp) for lp in lps or ()]


def layout_to_proto(layout: KVLayout) -> worker_pb.KVLayout:
    return worker_pb.KVLayout(model_fingerprint=layout.model_fingerprint, page_size=layout.page_size,
                              num_kv_layers=layout.num_kv_layers, kv_dim=layout.kv_dim, dtype=layout.dtype)


def layout_from_proto(msg: worker_pb.KVLayout) -> KVLayout:
    return KVLayout(model_fingerprint=msg.model_fingerprint, page_size=msg.page_size,
                    num_kv_layers=msg.num_kv_layers, kv_dim=msg.kv_dim, dtype=msg.dtype)


def usage_to_proto(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> gen_pb.Usage:
    return gen_pb.Usage(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                        completion_tokens=completion_tokens)


def finish_to_proto(reason: Optional[str]) -> int:
    return FINISH_TO_PROTO.get(reason or "", gen_pb.FINISH_REASON_UNSPECIFIED)
