from pdserve.v1 import generation_pb2 as _generation_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MigrationHello(_message.Message):
    __slots__ = ("layout_json",)
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    layout_json: str
    def __init__(self, layout_json: _Optional[str] = ...) -> None: ...

class MigrationHelloReply(_message.Message):
    __slots__ = ("layout_json", "server_id", "accepting")
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTING_FIELD_NUMBER: _ClassVar[int]
    layout_json: str
    server_id: str
    accepting: bool
    def __init__(self, layout_json: _Optional[str] = ..., server_id: _Optional[str] = ..., accepting: _Optional[bool] = ...) -> None: ...

class MigrateHeader(_message.Message):
    __slots__ = ("request", "lora_fingerprint", "layout_json", "kv_digest", "index")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    LORA_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    KV_DIGEST_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request: _generation_pb2.GenerateRequest
    lora_fingerprint: str
    layout_json: str
    kv_digest: bytes
    index: int
    def __init__(self, request: _Optional[_Union[_generation_pb2.GenerateRequest, _Mapping]] = ..., lora_fingerprint: _Optional[str] = ..., layout_json: _Optional[str] = ..., kv_digest: _Optional[bytes] = ..., index: _Optional[int] = ...) -> None: ...

class MigrateReady(_message.Message):
    __slots__ = ("first_block", "num_tokens")
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_block: int
    num_tokens: int
    def __init__(self, first_block: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class MigrateTrailer(_message.Message):
    __slots__ = ("num_frames", "num_bytes")
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_frames: int
    num_bytes: int
    def __init__(self, num_frames: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class MigrateMessage(_message.Message):
    __slots__ = ("header", "kv_frame", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    KV_FRAME_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: MigrateHeader
    kv_frame: bytes
    trailer: MigrateTrailer
    def __init__(self, header: _Optional[_Union[MigrateHeader, _Mapping]] = ..., kv_frame: _Optional[bytes] = ..., trailer: _Optional[_Union[MigrateTrailer, _Mapping]] = ...) -> None: ...

class MigrateReply(_message.Message):
    __slots__ = ("ready", "output")
    READY_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ready: MigrateReady
    output: _generation_pb2.GenerateResponse
    def __init__(self, ready: _Optional[_Union[MigrateReady, _Mapping]] = ..., output: _Optional[_Union[_generation_pb2.GenerateResponse, _Mapping]] = ...) -> None: ...
