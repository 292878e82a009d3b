"""The host KV tier in the simulator (``SimConfig.kv_host_mb``): the decode cores decide and account
(``ampd.worker.decode_tier``); this mixin of ``_Run`` times the moves they list on each decode
worker's host link with the profile's ``t_kv`` (one move at a time per worker) and holds a round
back until its worker's link has finished the moves issued so far: its own prefetch, or the offloads
that freed the blocks it was admitted into."""
from __future__ import annotations

from ampd.worker import TO_HOST

from .events import TIER_PREFETCH, TIER_READY

__all__ = ["Tiering"]


class Tiering:
    """Host-tier handlers of ``_Run`` (which declares ``dispatch0``, ``tier_to``, ``tier_from``)."""

    __slots__ = ()

    def tier_moves(self, d, now: float) -> None:
        """Put the moves ``d``'s core listed on its host link."""
        for m in d.take_moves():
            start = d.link if d.link > now else now
            d.link = start + m.seconds
            if m.direction == TO_HOST:
                self.tier_to += m.tokens
            else:
                self.tier_from += m.tokens

    def tier_dispatch(self, st, now: float) -> None:
        """An admitted round: routed once its worker's host link is done with the moves so far."""
        d = st.dw
        self.tier_moves(d, now)
        if d.link > now:
            self.push(d.link, TIER_READY, st)
        else:
            self.dispatch0(st, now)

    def tier_pause(self, st, now: float, tool: str | None) -> None:
        """A round ended in a tool call: the core keeps, offloads or drops the session's KV."""
        d = st.dw
        if d.tier_pause(st, now, tool):
            self.tier_moves(d, now)
            self.drain(d, now)
        else:
            self.tier_moves(d, now)
        at = d.tier_prefetch_at(st)
        if at is not None:
            self.push(at, TIER_PREFETCH, st)

    def tier_prefetch(self, st, now: float) -> None:
        """The expected end of the tool call of ``st`` nears: its KV comes back if there is room."""
        d = st.dw
        if d.tier_prefetch(st, now):
            self.tier_moves(d, now)

    def tier_stats(self, stats: dict) -> None:
        bpt = self.sim.profile.kv_bytes_per_token
        decisions: dict[str, int] = {}
        for d in self.decodes:
            for k, v in d.tier.decisions.items():
                decisions[k] = decisions.get(k, 0) + v
        stats["kv_tier"] = {
            "decisions": dict(sorted(decisions.items())),
            "tokens_to_host": self.tier_to, "tokens_from_host": self.tier_from,
            "bytes_to_host": self.tier_to * bpt, "bytes_from_host": self.tier_from * bpt,
            "host_used_end": [d.tier.host.used_blocks for d in self.decodes],
        }
        stats["kv_recomputed_tokens"] = sum(d.kv_recomputed_tokens for d in self.decodes)
