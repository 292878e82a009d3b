from ampd.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillDone(_message.Message):
    __slots__ = ("session_id", "round", "first_token", "prefill_worker", "kv_bytes", "error", "started", "finished", "task_token")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    TASK_TOKEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    round: int
    first_token: int
    prefill_worker: str
    kv_bytes: int
    error: str
    started: float
    finished: float
    task_token: str
    def __init__(self, session_id: _Optional[str] = ..., round: _Optional[int] = ..., first_token: _Optional[int] = ..., prefill_worker: _Optional[str] = ..., kv_bytes: _Optional[int] = ..., error: _Optional[str] = ..., started: _Optional[float] = ..., finished: _Optional[float] = ..., task_token: _Optional[str] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("id", "task")
    ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    id: int
    task: _common_pb2.PrefillTask
    def __init__(self, id: _Optional[int] = ..., task: _Optional[_Union[_common_pb2.PrefillTask, _Mapping]] = ...) -> None: ...
