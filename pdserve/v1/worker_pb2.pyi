from pdserve.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole

class KVLayout(_message.Message):
    __slots__ = ("model_fingerprint", "page_size", "num_kv_layers", "kv_dim", "dtype")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    page_size: int
    num_kv_layers: int
    kv_dim: int
    dtype: str
    def __init__(self, model_fingerprint: _Optional[str] = ..., page_size: _Optional[int] = ..., num_kv_layers: _Optional[int] = ..., kv_dim: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "input_ids", "sampling_params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _generate_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("room", "kv_endpoint", "dst_pages", "layout", "skip_mtp_kv")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DST_PAGES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_MTP_KV_FIELD_NUMBER: _ClassVar[int]
    room: int
    kv_endpoint: str
    dst_pages: _containers.RepeatedScalarFieldContainer[int]
    layout: KVLayout
    skip_mtp_kv: bool
    def __init__(self, room: _Optional[int] = ..., kv_endpoint: _Optional[str] = ..., dst_pages: _Optional[_Iterable[int]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., skip_mtp_kv: bool = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "input_ids", "sampling_params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _generate_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class BindRequest(_message.Message):
    __slots__ = ("request_id", "destination")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    destination: ReserveResponse
    def __init__(self, request_id: _Optional[str] = ..., destination: _Optional[_Union[ReserveResponse, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "cached_tokens", "evicted_block_hashes", "first_token_logprobs", "prompt_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    cached_tokens: int
    evicted_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    first_token_logprobs: _generate_pb2.TokenLogprobs
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprobs]
    def __init__(self, first_token_id: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., evicted_block_hashes: _Optional[_Iterable[bytes]] = ..., first_token_logprobs: _Optional[_Union[_generate_pb2.TokenLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class PrefillStreamRequest(_message.Message):
    __slots__ = ("prefill", "bind", "cancel")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    BIND_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    prefill: _containers.RepeatedCompositeFieldContainer[PrefillRequest]
    bind: _containers.RepeatedCompositeFieldContainer[BindRequest]
    cancel: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, prefill: _Optional[_Iterable[_Union[PrefillRequest, _Mapping]]] = ..., bind: _Optional[_Iterable[_Union[BindRequest, _Mapping]]] = ..., cancel: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefillAnswer(_message.Message):
    __slots__ = ("request_id", "response", "failure")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: PrefillResponse
    failure: Failure
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[PrefillResponse, _Mapping]] = ..., failure: _Optional[_Union[Failure, _Mapping]] = ...) -> None: ...

class PrefillStreamResponse(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[PrefillAnswer]
    def __init__(self, answers: _Optional[_Iterable[_Union[PrefillAnswer, _Mapping]]] = ...) -> None: ...

class DecodeStreamRequest(_message.Message):
    __slots__ = ("attach", "cancel")
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    attach: _containers.RepeatedScalarFieldContainer[str]
    cancel: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, attach: _Optional[_Iterable[str]] = ..., cancel: _Optional[_Iterable[str]] = ...) -> None: ...

class DecodeStreamResponse(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[DecodeUpdate]
    def __init__(self, updates: _Optional[_Iterable[_Union[DecodeUpdate, _Mapping]]] = ...) -> None: ...

class DecodeUpdate(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "logprobs", "failure")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _generate_pb2.FinishReason
    usage: _generate_pb2.Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprobs]
    failure: Failure
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_generate_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_generate_pb2.Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprobs, _Mapping]]] = ..., failure: _Optional[_Union[Failure, _Mapping]] = ...) -> None: ...

class Failure(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: bool = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("num_running_requests", "num_waiting_requests", "num_free_pages", "num_total_pages", "num_transferring")
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERRING_FIELD_NUMBER: _ClassVar[int]
    num_running_requests: int
    num_waiting_requests: int
    num_free_pages: int
    num_total_pages: int
    num_transferring: int
    def __init__(self, num_running_requests: _Optional[int] = ..., num_waiting_requests: _Optional[int] = ..., num_free_pages: _Optional[int] = ..., num_total_pages: _Optional[int] = ..., num_transferring: _Optional[int] = ...) -> None: ...

class GetWorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "address", "layout", "model", "kv_endpoint", "block_size")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: WorkerRole
    address: str
    layout: KVLayout
    model: _generate_pb2.ModelInfo
    kv_endpoint: str
    block_size: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., address: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., model: _Optional[_Union[_generate_pb2.ModelInfo, _Mapping]] = ..., kv_endpoint: _Optional[str] = ..., block_size: _Optional[int] = ...) -> None: ...
