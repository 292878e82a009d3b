"""Where a round's output ends: end of turn, a stop token or string, or max_tokens.

`StopChecker` sees the output one token at a time, as the decode worker produces it, and keeps
the output text up to date by decoding only a short tail of tokens per step. The finish reasons
are OpenAI's: "stop" (an end-of-turn id, a stop token id or a stop string) and "length"
(max_tokens). As OpenAI does, the text excludes what stopped it: the stop token, the end-of-turn
token and the stop string (and anything decoded after the stop string within the same token).
Pure: the detokenizer is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence

__all__ = ["StopChecker", "FINISH_STOP", "FINISH_LENGTH"]

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
_PARTIAL = "\ufffd"  # what a decoder gives for an incomplete UTF-8 sequence


@dataclass
class StopChecker:
    max_tokens: int
    detokenize: Callable[[Sequence[int]], str]
    eos_token_ids: Collection[int] = ()
    stop_token_ids: Collection[int] = ()
    stop: Sequence[str] = ()
    ignore_eos: bool = False  # end-of-turn ids do not stop; stop_token_ids still do

    tokens: list[int] = field(default_factory=list, init=False)
    text: str = field(default="", init=False)  # the output so far, without what stopped it
    finish_reason: str | None = field(default=None, init=False)
    stop_reason: int | str | None = field(default=None, init=False)  # the id or string that stopped
    _prefix: int = field(default=0, init=False)  # tokens before it only give context to decoding
    _read: int = field(default=0, init=False)  # tokens before it are in `text`
    _sent: int = field(default=0, init=False)  # characters of `text` handed out by `delta`
    _new_from: int = field(default=0, init=False)  # where the last decoded piece starts in `text`

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop: stop strings must not be empty")
        self._ends = frozenset(self.stop_token_ids) | (
            frozenset() if self.ignore_eos else frozenset(self.eos_token_ids))
        self._hold = max((len(s) for s in self.stop), default=1) - 1  # a stop's start, unfinished

    def add(self, token_id: int) -> str | None:
        """Takes the next output token; the finish reason once the output is over, else None."""
        if self.finish_reason is not None:
            raise RuntimeError(f"the output already finished ({self.finish_reason})")
        self.tokens.append(token_id)
        if token_id in self._ends:
            self._decode_tail(len(self.tokens) - 1, final=True)  # the text before it, not the token
            return self._finish(FINISH_STOP, token_id)
        last = len(self.tokens) >= self.max_tokens
        if self._decode_tail(len(self.tokens), final=last) and self._find_stop():
            return self.finish_reason
        return self._finish(FINISH_LENGTH, None) if last else None

    def extend(self, token_ids) -> str | None:
        """`add` for several tokens at once, decoding their text once (a consumer that falls behind
        the output catches up at the cost of one decode); the same text and finish as adding them one
        by one, up to where the output finished."""
        if self.finish_reason is not None:
            raise RuntimeError(f"the output already finished ({self.finish_reason})")
        last = False
        for token_id in token_ids:
            self.tokens.append(token_id)
            if token_id in self._ends:
                self._decode_tail(len(self.tokens) - 1, final=True)
                if self._find_stop():  # a stop string before the end token
                    return self.finish_reason
                return self._finish(FINISH_STOP, token_id)
            if len(self.tokens) >= self.max_tokens:
                last = True
                break
        if self._decode_tail(len(self.tokens), final=last) and self._find_stop():
            return self.finish_reason
        return self._finish(FINISH_LENGTH, None) if last else None

    def delta(self) -> str:
        """Text not handed out before that no later token can take back: while the output runs,
        a tail that could be the start of a stop string is held back."""
        end = len(self.text)
        if self.finish_reason is None:
            end = max(self._sent, end - self._partial_stop_len())
        out = self.text[self._sent:end]
        self._sent = end
        return out

    # --- internals ------------------------------------------------------------------------------
    def _finish(self, reason: str, why: int | str | None) -> str:
        self.finish_reason, self.stop_reason = reason, why
        return reason

    def _decode_tail(self, end: int, final: bool) -> bool:
        """Appends the text of tokens [_read, end) to `text`; False (nothing appended) while they
        end inside a character, unless `final`. Decoding from `_prefix` rather than from `_read`
        gives the decoder the context it needs (a leading space, the rest of a character)."""
        if end <= self._read:
            return False
        before = self.detokenize(self.tokens[self._prefix:self._read])
        now = self.detokenize(self.tokens[self._prefix:end])
        if len(now) <= len(before) or (now.endswith(_PARTIAL) and not final):
            return False
        self._new_from = len(self.text)
        self.text += now[len(before):]
        self._prefix, self._read = self._read, end
        return True

    def _find_stop(self) -> bool:
        """The earliest stop string in the part of the text that can hold a new one."""
        lo = max(0, self._new_from - self._hold)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, lo)) >= 0]
        if not hits:
            return False
        at, s = min(hits)
        self.text = self.text[:at]
        self._finish(FINISH_STOP, s)
        return True

    def _partial_stop_len(self) -> int:
        """The longest tail of `text` that is a proper prefix of some stop string."""
        for n in range(min(self._hold, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
