"""KV admission and eviction of a decode worker: the half of ``DecodeCore`` that decides whose round
gets KV, and whose idle KV goes (the module docstring of ``ampd.worker.decode`` gives the rules)."""
from __future__ import annotations

from typing import Final
from .decode_tier import TierMixin

__all__ = ["KvAdmission", "DecodeSession", "ADMITTED", "WAITING", "FAILED", "KV_ADMISSION", "KV_EXHAUSTED"]

# round_ready outcomes
ADMITTED: Final = 0
WAITING: Final = 1
FAILED: Final = 2

KV_ADMISSION = ("wait", "fail")
KV_EXHAUSTED: Final = "KV exhausted"


class DecodeSession:
    """What a decode worker keeps of one session: its KV, and its current round's progress.

    A driver sets ``round``, ``l_incr`` (new input tokens) and ``out`` (output tokens the round
    makes; live: its upper bound) before ``round_ready``. The core keeps the rest."""

    __slots__ = ("session_id", "round", "l_hist", "l_incr", "out", "first", "lo", "ctx_join", "in_tool",
                 "evicted", "error", "fetch", "shared", "pinned", "pin_own", "due")

    def __init__(self, session_id: str):
        self.session_id = session_id
        self.round = 0
        self.l_hist = 0  # KV tokens held before this round
        self.l_incr = 0
        self.out = 0
        self.first = 0.0  # first-token time of the current round
        self.lo = 0  # global index of the round's first decode step on this worker
        self.ctx_join = 0  # context the session brought into the batch
        self.in_tool = False
        self.evicted = False
        self.error = ""
        self.fetch = 0  # host tier: history tokens whose KV is on host, not on the device
        self.shared = 0  # live prefix sharing: history tokens in shared blocks, charged at admission
        # prefix sharing: leading history tokens in blocks the prefix index holds, set by the driver
        # as a round ends in a tool call. With the host tier (before ``tier_pause``) they stay on the
        # device when the rest goes to host; without it (the simulator's --kv-evict or expired pins)
        # they are all its index-held blocks, so an eviction knows what it frees (``pin_own``)
        self.pinned = 0
        # of them, the tokens in blocks no other session holds, set by the driver from the index's
        # reference counts at each sync: dropping the session frees only these (``TierMixin._unpin``)
        self.pin_own = 0
        # host tier: output tokens of the current round charged at admission and not made yet, as of
        # its first token (in the batch, ``KvAdmission.output_due`` takes off the steps run since)
        self.due = 0


class KvAdmission(TierMixin):
    """KV admission, eviction and the KV accounting of rounds (a part of ``DecodeCore``; its slots
    are ``TierMixin``'s and these)."""

    __slots__ = ("worker_id", "admitted", "kv_evict", "kv_overcommits", "exit_at", "step_idx")
    worker_id: str
    admitted: int
    kv_evict: bool
    kv_overcommits: int
    exit_at: dict[int, list[DecodeSession]]
    step_idx: int

    def round_ready(self, s: DecodeSession, now: float) -> int:
        """A round's input is ready (``s.round``, ``s.l_incr``, ``s.out`` set): reserve its KV.
        ADMITTED: route it now. WAITING: it waits (then loop on ``admit_next``). FAILED: the session
        failed (``s.error``) and released its KV."""
        if s.in_tool:
            s.in_tool = False
            self._not_evictable(s)
        if s.evicted:
            s.evicted = False
            if self.tier is not None:
                self._tier_reprefilled(s)
            back = s.shared  # shared again (``shared_history``): history, charged when admitted
            self.kv_recomputed_tokens += s.l_hist - back
            s.l_incr += s.l_hist - back
            s.l_hist = back
        need = self._round_need(s)
        if self.kv_admission == "fail":
            if self.kv_cap - self.kv_used < need and not self._make_room(need):
                return self._fail(s)
            if s.session_id not in self.sessions:
                self.admitted += 1
                self.sessions[s.session_id] = s
        elif s.session_id not in self.sessions:
            # a new session starts only when its first input fits (after evictions); running sessions
            # go first
            if self.kv_wait or self.new_wait or (self.kv_cap - self.kv_used < need and not self._make_room(need)):
                self.new_wait.append(s)
                self.wait_need += need
                return WAITING
            self.admitted += 1
            self.sessions[s.session_id] = s
        elif self.kv_wait or (self.kv_cap - self.kv_used < need and not self._make_room(need)):
            self.kv_wait.append(s)
            self.wait_need += need
            return WAITING
        self._charge(s, need)
        if s.fetch:
            self._tier_fetched(s)
        return ADMITTED

    def _round_need(self, s: DecodeSession) -> int:
        """The KV a round reserves when it is admitted: its input, and a host copy coming back (into
        blocks reserved with the input's). With the host tier, also its whole output (``s.out``: the
        simulator's exact length, live its bound): admission may promise more than the device holds
        (``ampd.policy.admit.promise_room``), so the outputs of the rounds running at once must be
        counted before they are made, or decoding could overfill the device pool. Without the tier
        output tokens are charged as they are made (promises never exceed the device)."""
        if self.tier is None:
            return s.l_incr + s.fetch
        return s.l_incr + s.fetch + s.out

    def _charge(self, s: DecodeSession, need: int) -> None:
        """The round of ``s`` is admitted: its ``need`` is charged, and a shared prefix
        (--prefix-sharing; else 0) with it: the live pool's free space, which the core admits by, no
        longer counts its blocks. With the tier its whole output is charged now and made later
        (``output_due``)."""
        self.kv_used += need + s.shared
        s.shared = 0
        if self.tier is not None:
            s.due = s.out

    def output_due(self, s: DecodeSession) -> int:
        """With the host tier: the output tokens of the round of ``s`` charged at its admission and
        not made yet (0 between rounds, or without the tier: output is then charged as it is made).
        A live pool reserves them a token a step, so its free space still holds them: a driver that
        admits by that space takes them off (``sync_kv_free``), or another round gets their room and a
        decode token later finds the pool full."""
        d = s.due
        if d and s in self.exit_at.get(s.lo + s.out - 2, ()):  # in the batch: one a step since it joined
            return s.lo + s.out - 1 - self.step_idx
        return d

    def output_tokens_due(self) -> int:
        """With the host tier: the output tokens every running round was charged at admission and
        has not made yet (``output_due`` summed; 0 without the tier). ``kv_used`` less these is the
        KV written: cached prefix blocks may stay in the rest of the device until it is written.
        Tokens, as the simulator counts KV; the live worker's ``KvSync.outputs_due`` counts the same
        in the pool's blocks (net of each round's partly filled last block)."""
        if self.tier is None:
            return 0
        return sum(self.output_due(s) for s in self.sessions.values() if s.due)

    def revive_cut(self, revived: int, cached: int) -> int:
        """Prefix sharing with the host tier: before a session revives ``revived`` tokens of cached
        blocks (released, still indexed; ``cached`` tokens of them in all), the cached tokens to let
        go first, least recently released first. A cached block may sit in room charged to output
        not made yet (``output_tokens_due``: the pool reclaims it only when a token is written into it),
        and reviving it there would leave that output no room. 0 when the revived tokens fit the
        room not charged (less what waiting rounds need); else the cache is cut to that room, as the
        pool would cut it while the outputs are made, and what is still indexed then fits."""
        room = self.kv_cap - self.kv_used - self.wait_need
        if self.tier is None or revived <= room:
            return 0
        return max(0, cached - max(room, 0))

    def _fail(self, s: DecodeSession) -> int:
        s.error = f"{KV_EXHAUSTED} on {self.worker_id}: {s.l_incr} tokens needed, {self.kv_cap - self.kv_used} free"
        if s.session_id in self.sessions:
            self.kv_used -= s.l_hist - s.fetch - s.shared  # (a prefix shared again is not charged yet)
            s.shared = 0
            self.admitted -= 1
            self.sessions.pop(s.session_id, None)
        self.tier_release(s)
        return FAILED

    def admit_next(self, now: float) -> DecodeSession | None:
        """The first waiting round whose KV fits now (evicting expired pins as needed), admitted;
        None when none fits. Running sessions' rounds go first; see the no-deadlock rule above."""
        w = self.kv_wait
        if w:
            s = w[0]
            need = self._round_need(s)
            if not self._make_room(need):
                if len(w) < self.admitted:
                    return None
                # every running session on this worker waits for KV: nobody will free any, so the
                # head goes ahead over capacity rather than deadlock (with the host tier, the other
                # waiting sessions' KV makes room first: tier_unblock)
                if self.tier is None or not self._tier_unblock(need):
                    self.kv_overcommits += 1
            w.popleft()
            self.wait_need -= need
            self._charge(s, need)  # (with a prefix shared again after an eviction)
            if s.fetch:
                self._tier_fetched(s)
            return s
        nw = self.new_wait
        if nw:
            s = nw[0]
            need = self._round_need(s)
            if not self._make_room(need):
                if self.admitted != 0:
                    return None
                self.kv_overcommits += 1  # a single session larger than the whole worker
            nw.popleft()
            self.wait_need -= need
            self.admitted += 1
            self.sessions[s.session_id] = s
            self._charge(s, need)  # with a shared prefix (--prefix-sharing)
            return s
        return None

    def _make_room(self, need: int, last_resort: bool | None = None) -> bool:
        """Evict idle sessions until ``need`` fits; True when it does. With the host tier the order
        is ``TierMixin._tier_make_room``'s (``last_resort``: see there)."""
        if self.victims:
            self.victims.clear()
        if self.kv_cap - self.kv_used + self.evictable_kv < need and (self.kv_evict or self.tier is not None):
            # evicting every idle session would not make the room: none loses its KV (vLLM's block
            # allocator checks the same before it evicts cached blocks). Without kv_evict (the
            # simulator's Continuum pins alone) expired pins go anyway, as they always have there:
            # its shipped results stay comparable.
            return False
        if self.tier is not None:
            return self._tier_make_room(need, last_resort)
        ev = self.evictable
        while ev and self.kv_cap - self.kv_used < need:
            # the least recently used idle session loses its KV (its next round re-prefills the
            # whole context)
            v, r = ev.popitem(last=False)
            self.kv_used -= r
            self.evictable_kv -= r
            v.evicted = True
            self._unpin(v)  # (--prefix-sharing: its blocks others still read stay, ``pinned``)
            self.kv_evictions += 1
            self.victims.append(v)
        return self.kv_cap - self.kv_used >= need

    def make_room(self, tokens: int) -> bool:
        """Live: evict idle sessions (``take_victims``) until ``tokens`` more fit; False when they do
        not. A driver whose pool frees a victim's blocks, not the tokens the core charged it, calls
        it right before reserving, after ``sync_kv_free`` with the pool's real free space. The round
        is admitted already, so the tier's last resort applies (a call drops at most one session
        whose pinned prefix others hold: sync and call again while victims come)."""
        return self._make_room(tokens, True)

    def take_victims(self) -> list[DecodeSession]:
        """The sessions whose KV the last admission (``round_ready``, ``admit_next``, ``make_room``)
        evicted; a live driver frees their blocks. Each is returned once."""
        v = self.victims
        if not v:
            return []
        self.victims = []
        return v

    def sync_kv_free(self, free_tokens: int) -> None:
        """Live: the pool has ``free_tokens`` free; the core admits by it (its capacity becomes what
        it has charged plus that). A driver passes the pool's free space less what the core has
        charged and the pool not reserved yet: with the tier, every running round's ``output_due``."""
        self.kv_cap = self.kv_used + free_tokens

    def shared_history(self, s: DecodeSession, tokens: int) -> None:
        """Before its first round is ready: the new session holds ``tokens`` tokens of KV it shares
        with other sessions (--prefix-sharing; ``ampd.policy.prefixindex``). They are its history,
        charged like one when it is admitted (released with it), so its round needs KV only for the
        rest. A session whose KV was dropped (``evicted``) may share again before its next round:
        those tokens of its history are then not prefilled again (``round_ready``)."""
        if s.session_id in self.sessions:
            if not s.evicted or tokens > s.l_hist:
                raise ValueError(f"{self.worker_id}: session {s.session_id!r} shares a prefix after its start")
            s.shared = tokens
            return
        s.l_hist += tokens
        s.shared = tokens

    def first_token(self, s: DecodeSession, now: float, last: bool = False) -> bool:
        """The round's first token is made (here or by a remote prefill). False: the round ended
        with it (``round_end`` next); True: the session joins the batch at the next run. ``last``
        (live: EOS or a stop at the first token): the round ends with it whatever ``s.out`` planned."""
        s.first = now
        if last and s.out > 1:
            if self.tier is not None:  # the output reserved at admission beyond this token frees
                self.kv_used -= s.out - 1
            s.out = 1
        if self.tier is None:  # (with the tier, the round's output was reserved when it was admitted)
            self.kv_used += 1
        else:
            s.due = s.out - 1
        if s.out <= 1:
            return False
        self.pending.append(s)
        return True

    def round_end(self, s: DecodeSession, last: bool) -> None:
        """The round's last token is made: its input and output join the session's history; the
        last round releases the session's KV (then loop on ``admit_next``)."""
        s.l_hist += s.l_incr + s.out
        s.due = 0
        if last:
            self.kv_used -= s.l_hist
            self.admitted -= 1
            del self.sessions[s.session_id]
            self.tier_release(s)

    def tool_call(self, s: DecodeSession, pin: bool = False) -> bool:
        """The session waits for a tool result (or its client's next turn). ``pin``: its KV stays
        pinned until ``pin_expired`` (Continuum's TTL starts); else with ``kv_evict`` it is evictable
        now. True when it is and a round waits for KV (loop on ``admit_next``)."""
        s.in_tool = True
        if self.kv_evict and not pin and not s.evicted:
            self._evictable(s)
            return bool(self.kv_wait or self.new_wait)
        return False

    def rewind(self, s: DecodeSession, tokens: int) -> None:
        """Between rounds: the session keeps only ``tokens`` of its history (an edited conversation);
        the KV charged for the rest is released (then loop on ``admit_next``)."""
        if not s.in_tool:
            raise ValueError(f"{self.worker_id}: session {s.session_id!r} is in a round")
        drop = s.l_hist - tokens
        if drop > 0:
            if s.fetch:  # on host: the host copy keeps the prefix (less a pinned prefix on the device)
                pinned = min(s.pinned, tokens)
                self.kv_used -= s.pinned - pinned
                self._resize_evictable(s, pinned)
                s.pinned, s.fetch = pinned, tokens - pinned
                if not s.fetch:  # nothing kept is on host: the copy goes
                    self.tier_release(s)
            elif not s.evicted:
                self.kv_used -= drop
                self._resize_evictable(s, tokens)
            s.l_hist = tokens

    def _resize_evictable(self, s: DecodeSession, tokens: int) -> None:
        r = self.evictable.get(s)
        if r is not None:
            self.evictable[s] = tokens
            self.evictable_kv += tokens - r

    def pin_expired(self, s: DecodeSession) -> bool:
        """The session's KV pin expired during its tool call: its KV may be evicted. True when a
        waiting round may now fit (loop on ``admit_next``)."""
        if s.in_tool and not s.evicted:
            self._evictable(s)
            return bool(self.kv_wait or self.new_wait)
        return False
