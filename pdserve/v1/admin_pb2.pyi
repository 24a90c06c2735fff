from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("already_draining",)
    ALREADY_DRAINING_FIELD_NUMBER: _ClassVar[int]
    already_draining: bool
    def __init__(self, already_draining: _Optional[bool] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoraAdapterInfo(_message.Message):
    __slots__ = ("name", "path", "rank", "target_modules", "fingerprint", "resident")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    fingerprint: str
    resident: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ..., fingerprint: _Optional[str] = ..., resident: _Optional[bool] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLoraAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoraAdapterList(_message.Message):
    __slots__ = ("adapters", "num_slots", "max_rank")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_RANK_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapterInfo]
    num_slots: int
    max_rank: int
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoraAdapterInfo, _Mapping]]] = ..., num_slots: _Optional[int] = ..., max_rank: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerStats(_message.Message):
    __slots__ = ("role", "num_blocks", "num_free_blocks", "num_running", "num_waiting", "num_requests_total", "num_incoming", "num_transfers_total", "kv_transfer_seconds_total", "kv_transfer_bytes_total", "num_transfer_failures_total", "num_cached_blocks", "prefix_cache_queries_total", "prefix_cache_hits_total", "prefix_cache_evictions_total", "kv_frames_sent_total", "kv_frames_after_compute_total", "route_expected_hit_tokens_total", "route_actual_hit_tokens_total", "engine", "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total", "spec_decode_accepted_per_position_total", "num_host_blocks", "num_host_cached_blocks", "num_host_staged_blocks", "prefix_cache_host_hits_total", "num_host_offloads_total")
    class EngineEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_INCOMING_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFER_FAILURES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_EVICTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_FRAMES_SENT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_FRAMES_AFTER_COMPUTE_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ROUTE_EXPECTED_HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ROUTE_ACTUAL_HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_ACCEPTED_PER_POSITION_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_STAGED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HOST_HITS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_OFFLOADS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    role: str
    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_requests_total: int
    num_incoming: int
    num_transfers_total: int
    kv_transfer_seconds_total: float
    kv_transfer_bytes_total: int
    num_transfer_failures_total: int
    num_cached_blocks: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    prefix_cache_evictions_total: int
    kv_frames_sent_total: int
    kv_frames_after_compute_total: int
    route_expected_hit_tokens_total: int
    route_actual_hit_tokens_total: int
    engine: _containers.ScalarMap[str, str]
    spec_decode_num_drafts_total: int
    spec_decode_num_draft_tokens_total: int
    spec_decode_num_accepted_tokens_total: int
    spec_decode_accepted_per_position_total: _containers.RepeatedScalarFieldContainer[int]
    num_host_blocks: int
    num_host_cached_blocks: int
    num_host_staged_blocks: int
    prefix_cache_host_hits_total: int
    num_host_offloads_total: int
    def __init__(self, role: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_requests_total: _Optional[int] = ..., num_incoming: _Optional[int] = ..., num_transfers_total: _Optional[int] = ..., kv_transfer_seconds_total: _Optional[float] = ..., kv_transfer_bytes_total: _Optional[int] = ..., num_transfer_failures_total: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., prefix_cache_queries_total: _Optional[int] = ..., prefix_cache_hits_total: _Optional[int] = ..., prefix_cache_evictions_total: _Optional[int] = ..., kv_frames_sent_total: _Optional[int] = ..., kv_frames_after_compute_total: _Optional[int] = ..., route_expected_hit_tokens_total: _Optional[int] = ..., route_actual_hit_tokens_total: _Optional[int] = ..., engine: _Optional[_Mapping[str, str]] = ..., spec_decode_num_drafts_total: _Optional[int] = ..., spec_decode_num_draft_tokens_total: _Optional[int] = ..., spec_decode_num_accepted_tokens_total: _Optional[int] = ..., spec_decode_accepted_per_position_total: _Optional[_Iterable[int]] = ..., num_host_blocks: _Optional[int] = ..., num_host_cached_blocks: _Optional[int] = ..., num_host_staged_blocks: _Optional[int] = ..., prefix_cache_host_hits_total: _Optional[int] = ..., num_host_offloads_total: _Optional[int] = ...) -> None: ...
