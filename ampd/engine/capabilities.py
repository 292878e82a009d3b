"""What each engine does beyond the Engine protocol's calls, declared once per engine.

The workers, the profiler, the launcher and the front read an engine's `EngineCapabilities` (an
engine object's ``capabilities``, or ``ampd.engine.capabilities_of(name)`` where only the engine's
name is known); none of them compares engine names or probes an engine with getattr/hasattr.
This module imports nothing heavy, so the front and the launcher read it without loading torch.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineCapabilities", "MOCK", "TORCH", "SGLANG"]


@dataclass(frozen=True, slots=True)
class EngineCapabilities:
    """Each field is False for an engine that lacks the feature; a True one promises what it says."""

    # It attends to the history's KV in the worker's pool: the workers pass where it lies
    # (DecodeSeq.history_kv, prefill's history_kv). An engine without it is passed none.
    reads_history_kv: bool = False
    # Its KV bytes are ampd.kv.kv_pattern(session, position) (the mock): the workers check every byte
    # that crossed a KV transfer against it.
    patterned_kv: bool = False
    # It keeps the KV itself and needs every session's token ids from the workers
    # (DecodeSeq.token_ids, prefill's history_ids); it has ``forget(session_id)``.
    needs_token_ids: bool = False
    # It keeps a decoding round's KV beside the pool (torch): the decode worker calls
    # ``forget(session_id)`` when the round ends, so a later prefill's KV is read from the pool.
    keeps_round_kv: bool = False
    # It decodes a whole round as one request of its own and batches the rounds itself (sglang): it
    # has ``open_round`` and ``end_round``, and its prefill takes the round's ``stops``
    # (ampd.engine.base.RoundStops; services/decode/streamed.py).
    streams_rounds: bool = False
    # Cancelling its prefill stops it at once (the mock's is a sleep after the KV write); another
    # engine's prefill finishes its pass before a cancelled session's blocks are freed.
    cancellable_prefill: bool = False
    # It cuts the worker's pool in its model's KV layout: ``make_pool(capacity_tokens, block_tokens)``.
    cuts_pool: bool = False
    # It has ``kv_bytes_per_token``, its model's KV bytes per token; without it a worker's pool keeps
    # the configured --kv-bytes-per-token (the mock's KV is only checkable bytes).
    model_kv_bytes: bool = False
    # It computes on the CPU even where a GPU is (torch): the profiler names the CPU as its hardware.
    cpu_only: bool = False
    # Its output ids are text of the model's tokenizer: the decode worker finds stop strings and tool
    # calls in them, and the front may add a forced stop string. The mock's ids are not text.
    text_output: bool = False
    # It is timed by a performance profile (it sleeps the modelled times, the mock): the profiler
    # reads its timings from the profile instead of measuring it.
    timed_by_profile: bool = False


MOCK = EngineCapabilities(patterned_kv=True, cancellable_prefill=True, timed_by_profile=True)
TORCH = EngineCapabilities(reads_history_kv=True, keeps_round_kv=True, cuts_pool=True, model_kv_bytes=True,
                           cpu_only=True, text_output=True)
# SGLang keeps the KV (its own pool, fed by ampd.engine.sglang_linker), so it reads no history from
# the worker's pool; it needs the token ids instead.
SGLANG = EngineCapabilities(needs_token_ids=True, streams_rounds=True, model_kv_bytes=True, text_output=True)
