from ampd.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ControlRequest(_message.Message):
    __slots__ = ("id", "local_prefill", "remote_prefill", "turn", "cancel", "close", "stop")
    ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    id: int
    local_prefill: RouteInfo
    remote_prefill: RouteInfo
    turn: TurnRequest
    cancel: CancelRequest
    close: CloseRequest
    stop: StopRoundRequest
    def __init__(self, id: _Optional[int] = ..., local_prefill: _Optional[_Union[RouteInfo, _Mapping]] = ..., remote_prefill: _Optional[_Union[RouteInfo, _Mapping]] = ..., turn: _Optional[_Union[TurnRequest, _Mapping]] = ..., cancel: _Optional[_Union[CancelRequest, _Mapping]] = ..., close: _Optional[_Union[CloseRequest, _Mapping]] = ..., stop: _Optional[_Union[StopRoundRequest, _Mapping]] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("open", "arrival", "resume", "session_secret", "route", "attach_token", "first_seq")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    ATTACH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    open: _common_pb2.OpenSession
    arrival: float
    resume: Resume
    session_secret: str
    route: Route
    attach_token: str
    first_seq: int
    def __init__(self, open: _Optional[_Union[_common_pb2.OpenSession, _Mapping]] = ..., arrival: _Optional[float] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ..., session_secret: _Optional[str] = ..., route: _Optional[_Union[Route, _Mapping]] = ..., attach_token: _Optional[str] = ..., first_seq: _Optional[int] = ...) -> None: ...

class ReattachRequest(_message.Message):
    __slots__ = ("session_id", "session_secret", "after_seq", "attach_token")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    ATTACH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    session_secret: str
    after_seq: int
    attach_token: str
    def __init__(self, session_id: _Optional[str] = ..., session_secret: _Optional[str] = ..., after_seq: _Optional[int] = ..., attach_token: _Optional[str] = ...) -> None: ...

class SessionState(_message.Message):
    __slots__ = ("seq", "history", "turn", "turn_round", "next_round", "round", "round_tokens", "round_ended", "server_calls", "client_calls", "rounds", "first_token_at", "input_ready", "turns", "closing", "unrouted", "limits", "moves", "prefix_scope")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    TURN_ROUND_FIELD_NUMBER: _ClassVar[int]
    NEXT_ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUND_ENDED_FIELD_NUMBER: _ClassVar[int]
    SERVER_CALLS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_CALLS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_AT_FIELD_NUMBER: _ClassVar[int]
    INPUT_READY_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    CLOSING_FIELD_NUMBER: _ClassVar[int]
    UNROUTED_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SCOPE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    history: _containers.RepeatedScalarFieldContainer[int]
    turn: _common_pb2.Turn
    turn_round: int
    next_round: int
    round: int
    round_tokens: int
    round_ended: bool
    server_calls: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolCall]
    client_calls: _containers.RepeatedScalarFieldContainer[str]
    rounds: _containers.RepeatedCompositeFieldContainer[_common_pb2.RoundTiming]
    first_token_at: float
    input_ready: float
    turns: int
    closing: bool
    unrouted: _common_pb2.PrefillTask
    limits: _common_pb2.SessionLimits
    moves: int
    prefix_scope: str
    def __init__(self, seq: _Optional[int] = ..., history: _Optional[_Iterable[int]] = ..., turn: _Optional[_Union[_common_pb2.Turn, _Mapping]] = ..., turn_round: _Optional[int] = ..., next_round: _Optional[int] = ..., round: _Optional[int] = ..., round_tokens: _Optional[int] = ..., round_ended: _Optional[bool] = ..., server_calls: _Optional[_Iterable[_Union[_common_pb2.ToolCall, _Mapping]]] = ..., client_calls: _Optional[_Iterable[str]] = ..., rounds: _Optional[_Iterable[_Union[_common_pb2.RoundTiming, _Mapping]]] = ..., first_token_at: _Optional[float] = ..., input_ready: _Optional[float] = ..., turns: _Optional[int] = ..., closing: _Optional[bool] = ..., unrouted: _Optional[_Union[_common_pb2.PrefillTask, _Mapping]] = ..., limits: _Optional[_Union[_common_pb2.SessionLimits, _Mapping]] = ..., moves: _Optional[int] = ..., prefix_scope: _Optional[str] = ...) -> None: ...

class Resume(_message.Message):
    __slots__ = ("round", "round_tokens", "rerun_tools", "calls", "attempt", "turns")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RERUN_TOOLS_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    round: int
    round_tokens: int
    rerun_tools: bool
    calls: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolCall]
    attempt: int
    turns: int
    def __init__(self, round: _Optional[int] = ..., round_tokens: _Optional[int] = ..., rerun_tools: _Optional[bool] = ..., calls: _Optional[_Iterable[_Union[_common_pb2.ToolCall, _Mapping]]] = ..., attempt: _Optional[int] = ..., turns: _Optional[int] = ...) -> None: ...

class RouteInfo(_message.Message):
    __slots__ = ("session_id", "round", "reason", "prefill_worker", "session_secret")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    round: int
    reason: str
    prefill_worker: str
    session_secret: str
    def __init__(self, session_id: _Optional[str] = ..., round: _Optional[int] = ..., reason: _Optional[str] = ..., prefill_worker: _Optional[str] = ..., session_secret: _Optional[str] = ...) -> None: ...

class DecodeEvents(_message.Message):
    __slots__ = ("events", "state")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[DecodeEvent]
    state: SessionState
    def __init__(self, events: _Optional[_Iterable[_Union[DecodeEvent, _Mapping]]] = ..., state: _Optional[_Union[SessionState, _Mapping]] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("prefill_task", "tokens", "tool_call", "round_end", "done", "turn_end", "seq")
    PREFILL_TASK_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    ROUND_END_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TURN_END_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    prefill_task: _common_pb2.PrefillTask
    tokens: _common_pb2.Tokens
    tool_call: _common_pb2.ToolCall
    round_end: _common_pb2.RoundEnd
    done: _common_pb2.SessionDone
    turn_end: _common_pb2.TurnEnd
    seq: int
    def __init__(self, prefill_task: _Optional[_Union[_common_pb2.PrefillTask, _Mapping]] = ..., tokens: _Optional[_Union[_common_pb2.Tokens, _Mapping]] = ..., tool_call: _Optional[_Union[_common_pb2.ToolCall, _Mapping]] = ..., round_end: _Optional[_Union[_common_pb2.RoundEnd, _Mapping]] = ..., done: _Optional[_Union[_common_pb2.SessionDone, _Mapping]] = ..., turn_end: _Optional[_Union[_common_pb2.TurnEnd, _Mapping]] = ..., seq: _Optional[int] = ...) -> None: ...

class TurnRequest(_message.Message):
    __slots__ = ("session_id", "turn", "session_secret", "route")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    turn: _common_pb2.Turn
    session_secret: str
    route: Route
    def __init__(self, session_id: _Optional[str] = ..., turn: _Optional[_Union[_common_pb2.Turn, _Mapping]] = ..., session_secret: _Optional[str] = ..., route: _Optional[_Union[Route, _Mapping]] = ...) -> None: ...

class Route(_message.Message):
    __slots__ = ("l_hist", "l_incr", "prefill_worker", "kv_state")
    L_HIST_FIELD_NUMBER: _ClassVar[int]
    L_INCR_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    KV_STATE_FIELD_NUMBER: _ClassVar[int]
    l_hist: int
    l_incr: int
    prefill_worker: str
    kv_state: str
    def __init__(self, l_hist: _Optional[int] = ..., l_incr: _Optional[int] = ..., prefill_worker: _Optional[str] = ..., kv_state: _Optional[str] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("session_id", "session_secret")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    session_secret: str
    def __init__(self, session_id: _Optional[str] = ..., session_secret: _Optional[str] = ...) -> None: ...

class StopRoundRequest(_message.Message):
    __slots__ = ("session_id", "session_secret")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    session_secret: str
    def __init__(self, session_id: _Optional[str] = ..., session_secret: _Optional[str] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("session_id", "reason", "session_secret")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SESSION_SECRET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reason: str
    session_secret: str
    def __init__(self, session_id: _Optional[str] = ..., reason: _Optional[str] = ..., session_secret: _Optional[str] = ...) -> None: ...
