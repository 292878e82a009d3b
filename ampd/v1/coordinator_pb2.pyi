from ampd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Cancel(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Close(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopRound(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClientMessage(_message.Message):
    __slots__ = ("open", "turn", "cancel", "close", "stop", "reattach")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    REATTACH_FIELD_NUMBER: _ClassVar[int]
    open: _common_pb2.OpenSession
    turn: _common_pb2.Turn
    cancel: Cancel
    close: Close
    stop: StopRound
    reattach: ReattachSession
    def __init__(self, open: _Optional[_Union[_common_pb2.OpenSession, _Mapping]] = ..., turn: _Optional[_Union[_common_pb2.Turn, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., close: _Optional[_Union[Close, _Mapping]] = ..., stop: _Optional[_Union[StopRound, _Mapping]] = ..., reattach: _Optional[_Union[ReattachSession, _Mapping]] = ...) -> None: ...

class SessionEvents(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[SessionEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[SessionEvent, _Mapping]]] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("session_id", "tokens", "tool_call", "round_end", "done", "turn_end", "decode_worker", "seq", "reattach_token")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    ROUND_END_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TURN_END_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REATTACH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: _common_pb2.Tokens
    tool_call: _common_pb2.ToolCall
    round_end: _common_pb2.RoundEnd
    done: _common_pb2.SessionDone
    turn_end: _common_pb2.TurnEnd
    decode_worker: str
    seq: int
    reattach_token: str
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[_Union[_common_pb2.Tokens, _Mapping]] = ..., tool_call: _Optional[_Union[_common_pb2.ToolCall, _Mapping]] = ..., round_end: _Optional[_Union[_common_pb2.RoundEnd, _Mapping]] = ..., done: _Optional[_Union[_common_pb2.SessionDone, _Mapping]] = ..., turn_end: _Optional[_Union[_common_pb2.TurnEnd, _Mapping]] = ..., decode_worker: _Optional[str] = ..., seq: _Optional[int] = ..., reattach_token: _Optional[str] = ...) -> None: ...

class ReattachSession(_message.Message):
    __slots__ = ("session_id", "reattach_token", "after_seq", "turns", "turn", "closed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REATTACH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reattach_token: str
    after_seq: int
    turns: int
    turn: _common_pb2.Turn
    closed: bool
    def __init__(self, session_id: _Optional[str] = ..., reattach_token: _Optional[str] = ..., after_seq: _Optional[int] = ..., turns: _Optional[int] = ..., turn: _Optional[_Union[_common_pb2.Turn, _Mapping]] = ..., closed: _Optional[bool] = ...) -> None: ...
