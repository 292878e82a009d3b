from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Segment(_message.Message):
    __slots__ = ("block", "offset", "tokens")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    block: int
    offset: int
    tokens: int
    def __init__(self, block: _Optional[int] = ..., offset: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class ToolSpec(_message.Message):
    __slots__ = ("name", "latency_s", "client_side", "arguments")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    CLIENT_SIDE_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    latency_s: float
    client_side: bool
    arguments: str
    def __init__(self, name: _Optional[str] = ..., latency_s: _Optional[float] = ..., client_side: _Optional[bool] = ..., arguments: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "seed", "stop_token_ids", "stop", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class ScriptedCall(_message.Message):
    __slots__ = ("tool", "result_tokens", "sampling")
    TOOL_FIELD_NUMBER: _ClassVar[int]
    RESULT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    tool: ToolSpec
    result_tokens: int
    sampling: SamplingParams
    def __init__(self, tool: _Optional[_Union[ToolSpec, _Mapping]] = ..., result_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class TurnHints(_message.Message):
    __slots__ = ("priority", "expected_output_tokens", "expected_tool_s")
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TOOL_S_FIELD_NUMBER: _ClassVar[int]
    priority: int
    expected_output_tokens: int
    expected_tool_s: float
    def __init__(self, priority: _Optional[int] = ..., expected_output_tokens: _Optional[int] = ..., expected_tool_s: _Optional[float] = ...) -> None: ...

class Turn(_message.Message):
    __slots__ = ("token_ids", "sampling", "server_tools", "script", "keep_tokens", "tool_call_id", "hints")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SERVER_TOOLS_FIELD_NUMBER: _ClassVar[int]
    SCRIPT_FIELD_NUMBER: _ClassVar[int]
    KEEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    HINTS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    server_tools: _containers.RepeatedScalarFieldContainer[str]
    script: _containers.RepeatedCompositeFieldContainer[ScriptedCall]
    keep_tokens: int
    tool_call_id: str
    hints: TurnHints
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., server_tools: _Optional[_Iterable[str]] = ..., script: _Optional[_Iterable[_Union[ScriptedCall, _Mapping]]] = ..., keep_tokens: _Optional[int] = ..., tool_call_id: _Optional[str] = ..., hints: _Optional[_Union[TurnHints, _Mapping]] = ...) -> None: ...

class SessionLimits(_message.Message):
    __slots__ = ("max_rounds", "max_output_tokens")
    MAX_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_rounds: int
    max_output_tokens: int
    def __init__(self, max_rounds: _Optional[int] = ..., max_output_tokens: _Optional[int] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("session_id", "limits", "turn", "prefix_scope")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SCOPE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    limits: SessionLimits
    turn: Turn
    prefix_scope: str
    def __init__(self, session_id: _Optional[str] = ..., limits: _Optional[_Union[SessionLimits, _Mapping]] = ..., turn: _Optional[_Union[Turn, _Mapping]] = ..., prefix_scope: _Optional[str] = ...) -> None: ...

class RoundTiming(_message.Message):
    __slots__ = ("round", "input_ready", "first_token", "last_token", "tokens", "local", "prefill_worker", "route_reason", "l_hist", "l_incr", "finish_reason", "recovered", "kv_recomputed_tokens", "prefix_shared_tokens")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    INPUT_READY_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LAST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    ROUTE_REASON_FIELD_NUMBER: _ClassVar[int]
    L_HIST_FIELD_NUMBER: _ClassVar[int]
    L_INCR_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_FIELD_NUMBER: _ClassVar[int]
    KV_RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SHARED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    round: int
    input_ready: float
    first_token: float
    last_token: float
    tokens: int
    local: bool
    prefill_worker: str
    route_reason: str
    l_hist: int
    l_incr: int
    finish_reason: str
    recovered: bool
    kv_recomputed_tokens: int
    prefix_shared_tokens: int
    def __init__(self, round: _Optional[int] = ..., input_ready: _Optional[float] = ..., first_token: _Optional[float] = ..., last_token: _Optional[float] = ..., tokens: _Optional[int] = ..., local: _Optional[bool] = ..., prefill_worker: _Optional[str] = ..., route_reason: _Optional[str] = ..., l_hist: _Optional[int] = ..., l_incr: _Optional[int] = ..., finish_reason: _Optional[str] = ..., recovered: _Optional[bool] = ..., kv_recomputed_tokens: _Optional[int] = ..., prefix_shared_tokens: _Optional[int] = ...) -> None: ...

class Tokens(_message.Message):
    __slots__ = ("round", "position", "token_ids", "times")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TIMES_FIELD_NUMBER: _ClassVar[int]
    round: int
    position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    times: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, round: _Optional[int] = ..., position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., times: _Optional[_Iterable[float]] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("round", "call_id", "name", "arguments", "client_side")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_SIDE_FIELD_NUMBER: _ClassVar[int]
    round: int
    call_id: str
    name: str
    arguments: str
    client_side: bool
    def __init__(self, round: _Optional[int] = ..., call_id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ..., client_side: _Optional[bool] = ...) -> None: ...

class TurnEnd(_message.Message):
    __slots__ = ("round", "finish_reason", "history_tokens", "kv_state", "kv_fetch_s")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    HISTORY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_STATE_FIELD_NUMBER: _ClassVar[int]
    KV_FETCH_S_FIELD_NUMBER: _ClassVar[int]
    round: int
    finish_reason: str
    history_tokens: int
    kv_state: str
    kv_fetch_s: float
    def __init__(self, round: _Optional[int] = ..., finish_reason: _Optional[str] = ..., history_tokens: _Optional[int] = ..., kv_state: _Optional[str] = ..., kv_fetch_s: _Optional[float] = ...) -> None: ...

class RoundEnd(_message.Message):
    __slots__ = ("timing",)
    TIMING_FIELD_NUMBER: _ClassVar[int]
    timing: RoundTiming
    def __init__(self, timing: _Optional[_Union[RoundTiming, _Mapping]] = ...) -> None: ...

class SessionDone(_message.Message):
    __slots__ = ("rounds",)
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    rounds: _containers.RepeatedCompositeFieldContainer[RoundTiming]
    def __init__(self, rounds: _Optional[_Iterable[_Union[RoundTiming, _Mapping]]] = ...) -> None: ...

class PrefillTask(_message.Message):
    __slots__ = ("session_id", "round", "l_hist", "l_incr", "input_ready", "decode_worker", "decode_tp", "history", "dest", "token_ids", "sampling", "history_token_ids", "task_token", "kv_state", "kv_fetch_s", "prefix_tokens", "history_on_host", "queue_yield_s", "kv_fetch_first")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    L_HIST_FIELD_NUMBER: _ClassVar[int]
    L_INCR_FIELD_NUMBER: _ClassVar[int]
    INPUT_READY_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_TP_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    DEST_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    HISTORY_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TASK_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_STATE_FIELD_NUMBER: _ClassVar[int]
    KV_FETCH_S_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_ON_HOST_FIELD_NUMBER: _ClassVar[int]
    QUEUE_YIELD_S_FIELD_NUMBER: _ClassVar[int]
    KV_FETCH_FIRST_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    round: int
    l_hist: int
    l_incr: int
    input_ready: float
    decode_worker: str
    decode_tp: int
    history: _containers.RepeatedCompositeFieldContainer[Segment]
    dest: _containers.RepeatedCompositeFieldContainer[Segment]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    history_token_ids: _containers.RepeatedScalarFieldContainer[int]
    task_token: str
    kv_state: str
    kv_fetch_s: float
    prefix_tokens: int
    history_on_host: bool
    queue_yield_s: float
    kv_fetch_first: bool
    def __init__(self, session_id: _Optional[str] = ..., round: _Optional[int] = ..., l_hist: _Optional[int] = ..., l_incr: _Optional[int] = ..., input_ready: _Optional[float] = ..., decode_worker: _Optional[str] = ..., decode_tp: _Optional[int] = ..., history: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., dest: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., history_token_ids: _Optional[_Iterable[int]] = ..., task_token: _Optional[str] = ..., kv_state: _Optional[str] = ..., kv_fetch_s: _Optional[float] = ..., prefix_tokens: _Optional[int] = ..., history_on_host: _Optional[bool] = ..., queue_yield_s: _Optional[float] = ..., kv_fetch_first: _Optional[bool] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MetricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MetricsReply(_message.Message):
    __slots__ = ("worker_id", "values", "labels")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    values: _containers.ScalarMap[str, float]
    labels: _containers.ScalarMap[str, str]
    def __init__(self, worker_id: _Optional[str] = ..., values: _Optional[_Mapping[str, float]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CallReply(_message.Message):
    __slots__ = ("id", "code", "error")
    ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    id: int
    code: int
    error: str
    def __init__(self, id: _Optional[int] = ..., code: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...
