from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerStats(_message.Message):
    __slots__ = ("role", "num_blocks", "num_free_blocks", "num_running", "num_waiting", "num_requests_total", "num_incoming", "num_transfers_total", "kv_transfer_seconds_total", "kv_transfer_bytes_total", "num_transfer_failures_total")
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
    def __init__(self, role: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_requests_total: _Optional[int] = ..., num_incoming: _Optional[int] = ..., num_transfers_total: _Optional[int] = ..., kv_transfer_seconds_total: _Optional[float] = ..., kv_transfer_bytes_total: _Optional[int] = ..., num_transfer_failures_total: _Optional[int] = ...) -> None: ...
