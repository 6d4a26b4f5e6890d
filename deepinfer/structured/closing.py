"""Budget-aware constrained decoding: a short way to finish a grammar from a matcher's state, and the
rule that keeps a constrained output finishable within its remaining token budget.

Invariants:
- `Closer.closing(matcher)` never changes `matcher`; the tokens it returns, accepted in order, complete the
  grammar (they were accepted by a fork of it), and the stop token is allowed after them;
- `ClosingPlan.forced` forces the first closing token exactly when the remaining budget (stop token included)
  is within `margin` tokens of what closing needs, so a request that enters that window with enough budget
  ends with a complete output and its stop token, never by length.
"""

from __future__ import annotations

import numpy as np
import torch

# Characters tried first when searching for a completion: closers, then what ends a value soonest.
_PRIORITY = b'"}])\'`>,:0 \n'
MAX_CLOSING_CHARS = 256  # longest completion searched for (characters)
NODE_BUDGET = 384  # matcher states one search may visit (the priority order rarely needs to backtrack)
FAILED_RECHECK = 32  # after a failed search, the next waits at least this many tokens
SHARED_CLOSINGS = 256  # grammars whose initial-state closing is kept


def closer_for(tokenizer, info, vocab_size: int, stop_token_ids: list[int]) -> Closer:
    """The Closer of a served tokenizer and its xgrammar TokenizerInfo (added tokens are markers)."""
    markers = tokenizer.inner.get_added_tokens_decoder()  # grammars may require these as whole tokens
    return Closer(info.decoded_vocab, vocab_size, list(stop_token_ids), [i for i in markers if i < vocab_size])


class Closer:
    """Per-tokenizer data for closing searches: one token per single byte (the search's steps) and the
    vocabulary's byte strings (to pack a closing string into as few tokens as the vocabulary allows)."""

    def __init__(self, decoded_vocab: list[bytes], vocab_size: int, stop_token_ids: list[int],
                 marker_token_ids=()):
        self.vocab_size, self.stop_token_ids = vocab_size, list(stop_token_ids)
        specials = sorted(set(marker_token_ids) - set(stop_token_ids))  # added tokens, taken whole
        self.by_bytes: dict[bytes, int] = {}
        for i, piece in enumerate(decoded_vocab):
            if piece and i not in specials and i not in self.stop_token_ids:
                self.by_bytes.setdefault(bytes(piece), i)
        self._pieces = {i: p for p, i in self.by_bytes.items()}
        self.max_len = max((len(p) for p in self.by_bytes), default=1)
        singles = {p[0]: i for p, i in self.by_bytes.items() if len(p) == 1}
        self.byte_token = singles
        self.piece_of = {t: bytes([b]) for b, t in singles.items()}
        first = [singles[b] for b in _PRIORITY if b in singles]
        rest = [singles[b] for b in range(256) if b in singles and b not in _PRIORITY]
        # search order: closers, then markers (whole added tokens: a grammar may require one), then bytes
        self.steps = first + specials + rest
        self.special = frozenset(specials)
        self._steps_np = np.array(self.steps, dtype=np.int64)
        self._words, self._shifts = self._steps_np // 32, (self._steps_np % 32).astype(np.int32)
        # one reusable bitmask row and its numpy view (a Closer serves one thread at a time)
        self._mask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
        self._mask_np = self._mask.numpy()[0]

    # --- search ------------------------------------------------------------------------------------
    def closing(self, matcher) -> list[int] | None:
        """Token ids that complete the grammar from `matcher`'s state (empty when already complete), or
        None when the search finds no completion within its bounds."""
        if matcher.is_completed():
            return []
        try:
            path = self._search(matcher.fork(), [], [NODE_BUDGET])
        except _TooLong:
            return None
        return None if path is None else self._pack(matcher, path)

    def _search(self, m, path: list[int], budget: list[int]) -> list[int] | None:
        """Depth-first over single-byte (and marker) tokens in priority order, forced text first; the first
        completion found. On return `m` has accepted `path` (on failure: nothing more than on entry). The
        first path to reach MAX_CLOSING_CHARS ends the whole search (_TooLong): the closing is that long
        along the preferred choices, and backtracking is for dead ends, not for length."""
        if m.is_completed():
            return path
        if len(path) >= MAX_CLOSING_CHARS:
            raise _TooLong
        if budget[0] <= 0:
            return None
        forced = self._forced(m)
        for run in [forced] if forced else ([t] for t in self._allowed(m)):
            budget[0] -= 1
            taken = _accept_all(m, run)
            path += run[:taken]
            if taken == len(run) and self._search(m, path, budget) is not None:
                return path
            del path[len(path) - taken:]
            m.rollback(taken)
        return None

    def _forced(self, m) -> list[int]:
        """Byte tokens of the continuation the grammar forces now (its jump-forward text), or []."""
        forced = m.find_jump_forward_string().encode("utf-8", "surrogatepass")
        tokens = [self.byte_token.get(b) for b in forced[:MAX_CLOSING_CHARS]]
        return tokens[:tokens.index(None)] if None in tokens else tokens

    def _allowed(self, m) -> list[int]:
        """The search steps the grammar allows next, in search order."""
        m.fill_next_token_bitmask(self._mask, 0)
        allowed = ((self._mask_np[self._words] >> self._shifts) & 1).astype(bool)
        return self._steps_np[allowed].tolist()

    def _pack(self, matcher, path: list[int]) -> list[int] | None:
        """The closing path in as few tokens as possible: byte runs become the longest vocabulary pieces
        the grammar accepts; markers stay as they are."""
        m, tokens, run = matcher.fork(), [], b""
        for token in [*path, None]:
            if token is not None and token not in self.special:
                run += self.piece_of[token]
                continue
            if not self._pack_run(m, run, tokens) or (token is not None and not _take(m, token, tokens)):
                return None
            run = b""
        return tokens if m.is_completed() else None

    def _pack_run(self, m, text: bytes, tokens: list[int]) -> bool:
        """Greedy longest match of `text` over the vocabulary, each piece accepted by `m` (advanced)."""
        i = 0
        while i < len(text):
            token = self._longest(m, text, i)
            if token is None:
                return False
            tokens.append(token)
            i += len(self.piece(token))
        return True

    def _longest(self, m, text: bytes, i: int) -> int | None:
        for n in range(min(self.max_len, len(text) - i), 0, -1):
            token = self.by_bytes.get(text[i:i + n])
            if token is not None and m.accept_token(token):
                return token
        return None

    def piece(self, token: int) -> bytes:
        return self._pieces[token]

    @staticmethod
    def still_closes(matcher, tokens: list[int]) -> bool:
        """Whether `tokens` still complete the grammar from `matcher`'s state (state unchanged)."""
        m = matcher.fork()
        return all(m.accept_token(t) for t in tokens) and m.is_completed()


def _accept_all(m, tokens: list[int]) -> int:
    """Accepts `tokens` in order until one is refused; how many were accepted."""
    for i, token in enumerate(tokens):
        if not m.accept_token(token):
            return i
    return len(tokens)


class _TooLong(Exception):
    """A closing search reached MAX_CLOSING_CHARS."""


def _take(m, token: int, tokens: list[int]) -> bool:
    tokens.append(token)
    return m.accept_token(token)


class ClosingPlan:
    """One sample's closing state: the cached closing tokens from its current state (refreshed when the
    output leaves them behind) and the remaining budget below which they are looked at again.

    With `slack` tokens between the remaining budget and the window (need + margin), the closing is looked
    at again after slack // 4 tokens (every token near the window): between two looks the need would have
    to grow by three tokens per generated token to reach past the window unseen. After a failed search (no
    completion within the search's bounds) the next one waits until the remaining budget halved (at least
    FAILED_RECHECK tokens), so a grammar that cannot close soon costs a few searches per request, not one per
    token. Samples of one grammar share the closing of its initial state (`shared`)."""

    def __init__(self, closer: Closer, margin: int, shared: dict | None = None, key=None):
        self.closer, self.margin = closer, margin
        self.tokens: list[int] | None = None
        self.recheck_below: int | None = None  # skip every check while remaining is above this
        self._shared, self._key = (shared if shared is not None else {}), key

    def need(self, matcher, at_start: bool = False) -> int | None:
        """Tokens closing needs from the matcher's state, the stop token included (None: no way found).
        `at_start`: the matcher is in the grammar's initial state (nothing fed yet)."""
        tokens = self._initial(matcher) if at_start else self._current(matcher)
        return None if tokens is None else len(tokens) + 1

    def _current(self, matcher) -> list[int] | None:
        for cached in (self.tokens[1:], self.tokens) if self.tokens else ():
            if Closer.still_closes(matcher, cached):
                self.tokens = cached
                return cached
        self.tokens = self.closer.closing(matcher)
        return self.tokens

    def _initial(self, matcher) -> list[int] | None:
        if self._key not in self._shared or (self._shared[self._key] is not None
                                              and not Closer.still_closes(matcher, self._shared[self._key])):
            self._shared[self._key] = self.closer.closing(matcher)
            while len(self._shared) > SHARED_CLOSINGS:  # oldest first; only the fill thread writes it
                self._shared.pop(next(iter(self._shared)))
        self.tokens = self._shared[self._key]
        return self.tokens

    def forced(self, matcher, remaining: int, at_start: bool = False) -> list[int] | None:
        """The token ids allowed now when closing must start (`remaining` tokens may still be generated,
        this one included), else None (the grammar's own mask applies)."""
        if self.recheck_below is not None and remaining > self.recheck_below:
            return None
        need = self.need(matcher, at_start)
        if need is None:
            self.recheck_below = remaining - max(FAILED_RECHECK, remaining // 2)
            return None
        slack = remaining - need - self.margin
        self.recheck_below = remaining - slack // 4 if slack >= 4 else None
        if slack > 0 or remaining < need:
            return None  # far from the end, or too late to close: the grammar alone decides
        return self.tokens[:1] if self.tokens else list(self.closer.stop_token_ids)
