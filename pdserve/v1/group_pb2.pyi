from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FollowRequest(_message.Message):
    __slots__ = ("process_id", "engine_fingerprint")
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    process_id: int
    engine_fingerprint: str
    def __init__(self, process_id: _Optional[int] = ..., engine_fingerprint: _Optional[str] = ...) -> None: ...

class HostArray(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class DeviceOp(_message.Message):
    __slots__ = ("seq", "kind", "arrays", "args_json")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ARRAYS_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: str
    arrays: _containers.RepeatedCompositeFieldContainer[HostArray]
    args_json: str
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[str] = ..., arrays: _Optional[_Iterable[_Union[HostArray, _Mapping]]] = ..., args_json: _Optional[str] = ...) -> None: ...
