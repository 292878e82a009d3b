"""The host KV tier in the simulator (``SimConfig.kv_host_mb``): the decode cores decide and account
(``ampd.worker.decode_tier``); this mixin of ``_Run`` times the moves they list on each decode
worker's host link with the profile's ``t_kv`` (one move at a time per worker).

An admitted round is routed at once with its KV's location (``PrefillTask.kv_state``: resident, on
host, gone) and the time until its KV and its blocks are on the device (``kv_fetch_s``: its own fetch
back, and the offloads in flight whose blocks it was admitted into: ``tier_room_at``): routed
locally, its prefill is queued then; remotely, the prefill worker reads the history from the host
copy meanwhile, and its first token waits for it. As live, a round on host cannot have its host copy
read remotely (``kv_fetch_first``: fetch, then prefill, here or remote) when the live worker could
not claim it (services/decode/hostread.py): a pinned shared prefix, a prefetch listed before the
round (early) still moving, or no device room until offloads in flight end; the simulator has no
rewound turns. With control-path latencies (``PathLatency``) the
round is held until the link has finished every move so far and then routed as before.

With prefix sharing (``ampd.sim.prefixing``) a session's pinned prefix, its blocks others also hold,
stays on the device: the core's moves, and so the link's time and ``bytes_to_host``, are its own KV
only; ``Prefixing.prefix_sync`` runs after each core call, before its moves are taken here."""
from __future__ import annotations


from ampd.policy.cost import remote_prefill_s
from ampd.policy.types import KV_GONE, KV_HOST, KV_RESIDENT, PrefillTask
from ampd.worker import IDLE, STEPPING, TO_HOST

from .events import TIER_PREFETCH, TIER_READY, TIER_REMOTE
from .prefixing import Prefixing
from .workers import Decode, Prefill, Sess

__all__ = ["Tiering"]


class Tiering(Prefixing):
    """Host-tier handlers of ``_Run`` (they sync prefix sharing: ``Prefixing``)."""

    __slots__ = ("open_s", "dispatch_s", "delayed", "tier_to", "tier_from")
    open_s: float
    dispatch_s: float
    delayed: bool  # the control path has a latency (open_s or dispatch_s)
    tier_to: int
    tier_from: int

    # _Run's methods these handlers call (typed here; _Run's own override them)
    def push(self, t: float, code: int, obj: object) -> None: ...

    def route(self, st: Sess, now: float, kv: tuple | None) -> None: ...

    def dispatch0(self, st: Sess, now: float) -> None: ...

    def decode_next(self, d: Decode, now: float) -> None: ...

    def interrupt(self, d: Decode, now: float) -> None: ...

    def drain(self, d: Decode, now: float) -> None: ...

    def tier_moves(self, d: Decode, now: float) -> None:
        """Put the moves ``d``'s core listed on its host link."""
        for m in d.take_moves():
            start = d.link if d.link > now else now
            d.link = start + m.seconds
            if m.direction == TO_HOST:
                self.tier_to += m.tokens
                d.offloads.append((d.link, m.tokens))
            else:
                self.tier_from += m.tokens
                st = self.live.get(m.session_id)
                if st is not None:
                    st.kv_back = d.link

    def tier_dispatch(self, st: Sess, now: float) -> None:
        """An admitted round: routed now with its KV's location (see the module doc)."""
        d = st.dw
        early = st.kv_early > now  # its early prefetch (before the round) still moves its KV
        self.tier_moves(d, now)
        if self.open_s or self.dispatch_s:
            if d.link > now:
                self.push(d.link, TIER_READY, st)
            else:
                self.dispatch0(st, now)
            return
        at = self.tier_room_at(d, now)
        short = at > now  # the device has no room for it until offloads in flight end
        if st.kv_back > at:  # its own history comes back from the host
            at = st.kv_back
        wait = at - now if at > now else 0.0
        state = KV_GONE if st.round and not st.l_hist else KV_HOST if st.kv_back > now else KV_RESIDENT
        # the live worker's unclaimed rounds (services/decode/hostread.py): fetch first, then prefill
        first = state == KV_HOST and (early or short or st.pinned > 0)
        self.route(st, now, (state, wait, first) if wait or state != KV_RESIDENT else None)

    @staticmethod
    def tier_room_at(d: Decode, now: float) -> float:
        """When the device blocks the core counts as free are free indeed: an offload frees its
        blocks in the accounting at once, but they hold its KV until the copy ends. While the KV of
        offloads in flight is no more than what the accounting leaves spare, nobody waits; else the
        round just admitted waits for the first offloads that cover the difference."""
        q = d.offloads
        while q and q[0][0] <= now:
            q.popleft()
        if not q:
            return now
        short = sum(t for _, t in q) - (d.kv_cap - d.kv_used)  # in-flight KV the rounds admitted need
        if short <= 0:
            return now
        for end, tokens in q:  # (the link is serial: by end)
            short -= tokens
            if short <= 0:
                return end
        return q[-1][0]

    def tier_remote_later(self, st: Sess, p: Prefill, task: PrefillTask, now: float, wait: float) -> bool:
        """A round routed to prefill worker ``p`` while its KV comes back (``wait`` seconds): its
        first token waits for the KV (``kv_ready``), so its prefill is submitted to end then, not
        earlier (its compute would take the prefill worker's turn from rounds that can use it now);
        one that fetches first (``PrefillTask.kv_fetch_first``) is submitted once the KV is back.
        True when it was put off (a TIER_REMOTE event submits it)."""
        st.kv_ready = now + wait
        at = st.kv_ready
        if not task.kv_fetch_first:
            at -= remote_prefill_s(self.sim.profile, task.l_hist, task.l_incr, task.decode_tp, p.tp)
        if at <= now:
            return False
        self.push(at, TIER_REMOTE, (p, task))
        return True

    def tier_local(self, obj: tuple[Sess, PrefillTask], now: float) -> None:
        """A round routed locally while its KV was coming back: its prefill joins the local queue."""
        st, task = obj
        d = st.dw
        d.submit_local(task)
        if d.state == IDLE:
            self.decode_next(d, now)
        elif d.state == STEPPING:
            self.interrupt(d, now)

    def tier_pause(self, st: Sess, now: float, tool: str | None, hint_s: float | None = None) -> None:
        """A round ended in a tool call: the core keeps, offloads or drops the session's KV, by the
        tool's windowed duration or the round's ``expected_tool_s`` hint (``hint_s``) when given."""
        d = st.dw
        freed = d.tier_pause(st, now, tool, hint_s)
        if self.prefix_kv:  # (before its moves are taken)
            self.prefix_sync(d, st)
        if freed:
            self.tier_moves(d, now)
            self.drain(d, now)
        else:
            self.tier_moves(d, now)
        at = d.tier_prefetch_at(st)
        if at is not None:
            self.push(at, TIER_PREFETCH, st)

    def tier_prefetch(self, st: Sess, now: float) -> None:
        """The expected end of the tool call of ``st`` nears: its KV comes back if there is room."""
        d = st.dw
        if d.tier_prefetch(st, now):
            self.tier_moves(d, now)
            st.kv_early = st.kv_back

    def tier_stats(self, stats: dict) -> None:
        bpt = self.sim.profile.kv_bytes_per_token
        decisions: dict[str, int] = {}
        for d in self.decodes:
            for k, v in d.tier.decisions.items():  # type: ignore[union-attr]  # (self.tier: every worker has one)
                decisions[k] = decisions.get(k, 0) + v
        stats["kv_tier"] = {
            "decisions": dict(sorted(decisions.items())),
            "tokens_to_host": self.tier_to, "tokens_from_host": self.tier_from,
            "bytes_to_host": self.tier_to * bpt, "bytes_from_host": self.tier_from * bpt,
            "host_used_end": [d.tier.host.used_blocks for d in self.decodes],  # type: ignore[union-attr]  # (as above)
        }
        stats["kv_recomputed_tokens"] = sum(d.kv_recomputed_tokens for d in self.decodes)
