from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVDType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_DTYPE_UNSPECIFIED: _ClassVar[KVDType]
    KV_DTYPE_FLOAT32: _ClassVar[KVDType]
    KV_DTYPE_BFLOAT16: _ClassVar[KVDType]
    KV_DTYPE_FLOAT16: _ClassVar[KVDType]
    KV_DTYPE_FLOAT8_E4M3FN: _ClassVar[KVDType]
    KV_DTYPE_FLOAT8_E5M2: _ClassVar[KVDType]
    KV_DTYPE_INT8: _ClassVar[KVDType]
KV_DTYPE_UNSPECIFIED: KVDType
KV_DTYPE_FLOAT32: KVDType
KV_DTYPE_BFLOAT16: KVDType
KV_DTYPE_FLOAT16: KVDType
KV_DTYPE_FLOAT8_E4M3FN: KVDType
KV_DTYPE_FLOAT8_E5M2: KVDType
KV_DTYPE_INT8: KVDType

class KVFrameHeader(_message.Message):
    __slots__ = ("request_id", "seq", "num_frames", "request_num_tokens", "layout_fingerprint", "layer_start", "layer_end", "token_start", "token_end", "block_ids", "shape", "dtype", "payload_bytes", "payload_crc32c", "bucket_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_CRC32C_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq: int
    num_frames: int
    request_num_tokens: int
    layout_fingerprint: str
    layer_start: int
    layer_end: int
    token_start: int
    token_end: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: KVDType
    payload_bytes: int
    payload_crc32c: int
    bucket_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., seq: _Optional[int] = ..., num_frames: _Optional[int] = ..., request_num_tokens: _Optional[int] = ..., layout_fingerprint: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[KVDType, str]] = ..., payload_bytes: _Optional[int] = ..., payload_crc32c: _Optional[int] = ..., bucket_blocks: _Optional[int] = ...) -> None: ...
