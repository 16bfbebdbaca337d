from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class TokenizedInput(_message.Message):
    __slots__ = ("input_ids",)
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, input_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    prompt_logprobs: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: bool = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "tokenized", "sampling_params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZED_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    tokenized: TokenizedInput
    sampling_params: SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., tokenized: _Optional[_Union[TokenizedInput, _Mapping]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class GenerateComplete(_message.Message):
    __slots__ = ("output_ids", "finish_reason", "usage", "text", "logprobs", "prompt_logprobs")
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, output_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "complete")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: GenerateChunk
    complete: GenerateComplete
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[GenerateChunk, _Mapping]] = ..., complete: _Optional[_Union[GenerateComplete, _Mapping]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "vocab_size", "max_context_length", "eos_token_ids", "model_type")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    max_context_length: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    model_type: str
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context_length: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., model_type: _Optional[str] = ...) -> None: ...
