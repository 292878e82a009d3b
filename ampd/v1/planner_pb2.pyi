from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PlanRequest(_message.Message):
    __slots__ = ("profile", "trace_jsonl", "gpus", "top", "ttft_slo_s", "itl_slo_s", "policy", "no_colocated", "one_degree", "candidates", "check_sessions", "seed", "all_gpus")
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    TRACE_JSONL_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_S_FIELD_NUMBER: _ClassVar[int]
    ITL_SLO_S_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    NO_COLOCATED_FIELD_NUMBER: _ClassVar[int]
    ONE_DEGREE_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    CHECK_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ALL_GPUS_FIELD_NUMBER: _ClassVar[int]
    profile: str
    trace_jsonl: str
    gpus: int
    top: int
    ttft_slo_s: float
    itl_slo_s: float
    policy: str
    no_colocated: bool
    one_degree: bool
    candidates: int
    check_sessions: int
    seed: int
    all_gpus: bool
    def __init__(self, profile: _Optional[str] = ..., trace_jsonl: _Optional[str] = ..., gpus: _Optional[int] = ..., top: _Optional[int] = ..., ttft_slo_s: _Optional[float] = ..., itl_slo_s: _Optional[float] = ..., policy: _Optional[str] = ..., no_colocated: _Optional[bool] = ..., one_degree: _Optional[bool] = ..., candidates: _Optional[int] = ..., check_sessions: _Optional[int] = ..., seed: _Optional[int] = ..., all_gpus: _Optional[bool] = ...) -> None: ...

class PlannedDeployment(_message.Message):
    __slots__ = ("prefill", "decode", "p95_s", "slo_attainment", "gpus", "policy", "p95_itl_s", "estimated_worst_p95_over_slo")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    P95_S_FIELD_NUMBER: _ClassVar[int]
    SLO_ATTAINMENT_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    P95_ITL_S_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_WORST_P95_OVER_SLO_FIELD_NUMBER: _ClassVar[int]
    prefill: str
    decode: str
    p95_s: float
    slo_attainment: float
    gpus: int
    policy: str
    p95_itl_s: float
    estimated_worst_p95_over_slo: float
    def __init__(self, prefill: _Optional[str] = ..., decode: _Optional[str] = ..., p95_s: _Optional[float] = ..., slo_attainment: _Optional[float] = ..., gpus: _Optional[int] = ..., policy: _Optional[str] = ..., p95_itl_s: _Optional[float] = ..., estimated_worst_p95_over_slo: _Optional[float] = ...) -> None: ...

class PlanReply(_message.Message):
    __slots__ = ("gpus", "seconds", "top", "ttft_slo_s", "itl_slo_s", "candidates_checked", "json")
    GPUS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_S_FIELD_NUMBER: _ClassVar[int]
    ITL_SLO_S_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_CHECKED_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    gpus: int
    seconds: float
    top: _containers.RepeatedCompositeFieldContainer[PlannedDeployment]
    ttft_slo_s: float
    itl_slo_s: float
    candidates_checked: int
    json: str
    def __init__(self, gpus: _Optional[int] = ..., seconds: _Optional[float] = ..., top: _Optional[_Iterable[_Union[PlannedDeployment, _Mapping]]] = ..., ttft_slo_s: _Optional[float] = ..., itl_slo_s: _Optional[float] = ..., candidates_checked: _Optional[int] = ..., json: _Optional[str] = ...) -> None: ...

class ListProfilesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProfileInfo(_message.Message):
    __slots__ = ("name", "model", "hardware", "tps")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    TPS_FIELD_NUMBER: _ClassVar[int]
    name: str
    model: str
    hardware: str
    tps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., model: _Optional[str] = ..., hardware: _Optional[str] = ..., tps: _Optional[_Iterable[int]] = ...) -> None: ...

class ListProfilesReply(_message.Message):
    __slots__ = ("profiles",)
    PROFILES_FIELD_NUMBER: _ClassVar[int]
    profiles: _containers.RepeatedCompositeFieldContainer[ProfileInfo]
    def __init__(self, profiles: _Optional[_Iterable[_Union[ProfileInfo, _Mapping]]] = ...) -> None: ...

class GetProfileRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ProfileReply(_message.Message):
    __slots__ = ("name", "json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    json: str
    def __init__(self, name: _Optional[str] = ..., json: _Optional[str] = ...) -> None: ...
