from pdserve.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandshakeRequest(_message.Message):
    __slots__ = ("layout_json", "kv_events_key")
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_KEY_FIELD_NUMBER: _ClassVar[int]
    layout_json: str
    kv_events_key: str
    def __init__(self, layout_json: _Optional[str] = ..., kv_events_key: _Optional[str] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("layout_json", "fingerprint", "kv_events_port", "kv_events_replay_port", "kv_events_topic", "features", "kv_events_key")
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_PORT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_REPLAY_PORT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_TOPIC_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_KEY_FIELD_NUMBER: _ClassVar[int]
    layout_json: str
    fingerprint: str
    kv_events_port: int
    kv_events_replay_port: int
    kv_events_topic: str
    features: _containers.RepeatedScalarFieldContainer[str]
    kv_events_key: str
    def __init__(self, layout_json: _Optional[str] = ..., fingerprint: _Optional[str] = ..., kv_events_port: _Optional[int] = ..., kv_events_replay_port: _Optional[int] = ..., kv_events_topic: _Optional[str] = ..., features: _Optional[_Iterable[str]] = ..., kv_events_key: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "sampling", "seed", "layout_fingerprint", "lora_adapter", "stop", "lora_fingerprint", "held_block_hashes", "constraint", "constraint_fingerprint", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LORA_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParameters
    seed: int
    layout_fingerprint: str
    lora_adapter: str
    stop: _generation_pb2.StopConditions
    lora_fingerprint: str
    held_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    constraint: _generation_pb2.Constraint
    constraint_fingerprint: str
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParameters, _Mapping]] = ..., seed: _Optional[int] = ..., layout_fingerprint: _Optional[str] = ..., lora_adapter: _Optional[str] = ..., stop: _Optional[_Union[_generation_pb2.StopConditions, _Mapping]] = ..., lora_fingerprint: _Optional[str] = ..., held_block_hashes: _Optional[_Iterable[int]] = ..., constraint: _Optional[_Union[_generation_pb2.Constraint, _Mapping]] = ..., constraint_fingerprint: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PrefillHeader(_message.Message):
    __slots__ = ("request_id", "prompt_len", "layout_json", "lora_adapter", "lora_fingerprint", "first_block", "prompt_digest")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    LORA_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_len: int
    layout_json: str
    lora_adapter: str
    lora_fingerprint: str
    first_block: int
    prompt_digest: bytes
    def __init__(self, request_id: _Optional[str] = ..., prompt_len: _Optional[int] = ..., layout_json: _Optional[str] = ..., lora_adapter: _Optional[str] = ..., lora_fingerprint: _Optional[str] = ..., first_block: _Optional[int] = ..., prompt_digest: _Optional[bytes] = ...) -> None: ...

class PrefillTrailer(_message.Message):
    __slots__ = ("num_frames", "num_bytes", "prefill_seconds", "first_token", "first_logprobs", "num_cached_tokens", "prompt_logprobs", "forks", "draft_aux")
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORKS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AUX_FIELD_NUMBER: _ClassVar[int]
    num_frames: int
    num_bytes: int
    prefill_seconds: float
    first_token: int
    first_logprobs: _generation_pb2.TokenLogprobs
    num_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprobs]
    forks: _containers.RepeatedCompositeFieldContainer[SequenceStart]
    draft_aux: bytes
    def __init__(self, num_frames: _Optional[int] = ..., num_bytes: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., first_token: _Optional[int] = ..., first_logprobs: _Optional[_Union[_generation_pb2.TokenLogprobs, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprobs, _Mapping]]] = ..., forks: _Optional[_Iterable[_Union[SequenceStart, _Mapping]]] = ..., draft_aux: _Optional[bytes] = ...) -> None: ...

class SequenceStart(_message.Message):
    __slots__ = ("token", "logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprobs: _generation_pb2.TokenLogprobs
    def __init__(self, token: _Optional[int] = ..., logprobs: _Optional[_Union[_generation_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...

class PrefillMessage(_message.Message):
    __slots__ = ("header", "kv_frame", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    KV_FRAME_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: PrefillHeader
    kv_frame: bytes
    trailer: PrefillTrailer
    def __init__(self, header: _Optional[_Union[PrefillHeader, _Mapping]] = ..., kv_frame: _Optional[bytes] = ..., trailer: _Optional[_Union[PrefillTrailer, _Mapping]] = ...) -> None: ...
