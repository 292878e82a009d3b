from ampd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ToolCallRequest(_message.Message):
    __slots__ = ("session_id", "round", "name", "arguments", "latency_s", "result_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    RESULT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    round: int
    name: str
    arguments: str
    latency_s: float
    result_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., round: _Optional[int] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ..., latency_s: _Optional[float] = ..., result_tokens: _Optional[int] = ...) -> None: ...

class ToolCallResult(_message.Message):
    __slots__ = ("result_tokens", "content", "started", "finished", "error")
    RESULT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    result_tokens: int
    content: str
    started: float
    finished: float
    error: str
    def __init__(self, result_tokens: _Optional[int] = ..., content: _Optional[str] = ..., started: _Optional[float] = ..., finished: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class ListToolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListToolsReply(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...
