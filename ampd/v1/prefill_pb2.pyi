from ampd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillTask(_message.Message):
    __slots__ = ("session_id", "round", "l_hist", "l_incr", "input_ready", "decode_worker", "decode_tp", "history", "dest")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    L_HIST_FIELD_NUMBER: _ClassVar[int]
    L_INCR_FIELD_NUMBER: _ClassVar[int]
    INPUT_READY_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_TP_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    DEST_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    round: int
    l_hist: int
    l_incr: int
    input_ready: float
    decode_worker: str
    decode_tp: int
    history: _containers.RepeatedCompositeFieldContainer[_common_pb2.Segment]
    dest: _containers.RepeatedCompositeFieldContainer[_common_pb2.Segment]
    def __init__(self, session_id: _Optional[str] = ..., round: _Optional[int] = ..., l_hist: _Optional[int] = ..., l_incr: _Optional[int] = ..., input_ready: _Optional[float] = ..., decode_worker: _Optional[str] = ..., decode_tp: _Optional[int] = ..., history: _Optional[_Iterable[_Union[_common_pb2.Segment, _Mapping]]] = ..., dest: _Optional[_Iterable[_Union[_common_pb2.Segment, _Mapping]]] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("session_id", "round", "first_token", "prefill_worker", "kv_bytes", "error", "started", "finished")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    round: int
    first_token: int
    prefill_worker: str
    kv_bytes: int
    error: str
    started: float
    finished: float
    def __init__(self, session_id: _Optional[str] = ..., round: _Optional[int] = ..., first_token: _Optional[int] = ..., prefill_worker: _Optional[str] = ..., kv_bytes: _Optional[int] = ..., error: _Optional[str] = ..., started: _Optional[float] = ..., finished: _Optional[float] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("id", "task")
    ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    id: int
    task: PrefillTask
    def __init__(self, id: _Optional[int] = ..., task: _Optional[_Union[PrefillTask, _Mapping]] = ...) -> None: ...
