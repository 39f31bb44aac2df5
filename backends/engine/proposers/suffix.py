"""Suffix decoding (Oliaro et al., arXiv 2411.04975): draft from suffix trees over this request's prompt and
output AND over earlier requests' outputs, proposing the most frequent continuation of the longest match.

The trees are arctic-inference's ``SuffixDecodingCache`` (Snowflake's implementation, the one vLLM's
``suffix`` method uses), built from its source distribution by ``make setup``. specgate adds what a front
door for many applications needs:
- **Scopes.** One cache (so one global tree) per scope; the gateway sends the route's name as the scope, so
  one application's outputs never become another's drafts. ``SuffixStore`` keeps at most ``max_scopes``
  scopes (least recently used evicted; a running request keeps its scope's cache alive until it ends).
- **Bounded memory.** Each scope keeps the responses of its last ``max_cached_requests`` requests (FIFO, the
  library's eviction); a request's prompt tree lives only while it runs.
- **Length by match.** A draft has at most ``max_spec_factor * match_length + max_spec_offset`` tokens (and
  at most k), and stops where the continuation's estimated probability falls below ``min_token_prob``:
  it speculates more where the match is long and the continuation is certain.

Exactness is the proposer contract's (base.py): it only proposes; drafts are deterministic, so q is
one-hot (``draft_probs`` None) and the target's verification decides. A response enters its scope's global
tree token by token as the target commits it (never a rejected draft).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict

import torch

from backends.engine.proposers.base import EMPTY, Proposal, SequenceProposer
from backends.engine.sampling import PenaltyState
from backends.engine.types import SamplingParams, SuffixSettings

try:
    from arctic_inference.suffix_decoding import SuffixDecodingCache
except ImportError as exc:  # pragma: no cover - make setup builds it
    SuffixDecodingCache = None
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None


class _Scope:
    __slots__ = ("cache", "active")

    def __init__(self, settings: SuffixSettings) -> None:
        self.cache = SuffixDecodingCache(max_tree_depth=settings.max_tree_depth,
                                         max_cached_requests=settings.max_cached_requests)
        self.active = 0  # running requests drafting from this scope


class SuffixStore:
    """The engine's suffix trees, one cache per scope. Used from the engine thread only; the lock makes
    ``scopes``/``stats`` safe to read from a server thread."""

    def __init__(self, settings: SuffixSettings = SuffixSettings()) -> None:
        if SuffixDecodingCache is None:
            raise RuntimeError("the suffix proposer needs arctic-inference's suffix tree; `make setup` builds it "
                               f"from its source distribution ({_IMPORT_ERROR})")
        self.settings = settings
        self._scopes: OrderedDict[str, _Scope] = OrderedDict()
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def open(self, scope: str, prompt: list[int]) -> SuffixProposer:
        with self._lock:
            entry = self._scopes.pop(scope, None) or _Scope(self.settings)
            self._scopes[scope] = entry  # most recently used last
            entry.active += 1
            self._evict()
        return SuffixProposer(self, entry, next(self._ids), prompt)

    def _closed(self, entry: _Scope) -> None:
        with self._lock:
            entry.active -= 1
            self._evict()

    def _evict(self) -> None:
        """Drop least recently used idle scopes beyond ``max_scopes`` (a scope in use is kept)."""
        excess = len(self._scopes) - self.settings.max_scopes
        for name in [n for n, e in self._scopes.items() if e.active == 0][:max(0, excess)]:
            del self._scopes[name]

    @property
    def scopes(self) -> list[str]:
        with self._lock:
            return list(self._scopes)

    def forget(self, proposer: SuffixProposer) -> None:
        """Take a released proposer's response out of its scope's global tree (a counterfactual that must not
        leave its answer behind: replay/evidence.py)."""
        with self._lock:
            if proposer.seq_id in proposer.entry.cache.cached_requests:
                proposer.entry.cache.evict_cached_response(proposer.seq_id)

    def remember(self, scope: str, prompt: list[int], output: list[int]) -> None:
        """Add a finished answer to ``scope``'s global tree, as a request drafting from it would have."""
        proposer = self.open(scope, prompt)
        proposer.observe(0, 0, [*prompt, *output])
        proposer.release()

    def cached_requests(self, scope: str) -> int:
        with self._lock:
            entry = self._scopes.get(scope)
            return len(entry.cache.cached_requests) if entry else 0


class SuffixProposer(SequenceProposer):
    name = "suffix"

    def __init__(self, store: SuffixStore, entry: _Scope, seq_id: int, prompt: list[int]) -> None:
        self.store, self.entry, self.seq_id = store, entry, seq_id
        self.settings = store.settings
        entry.cache.start_request(seq_id, list(prompt))
        self._added = len(prompt)  # context tokens already in the trees
        self._open = True

    def _catch_up(self, context: list[int]) -> None:
        if len(context) > self._added:
            self.entry.cache.add_active_response(self.seq_id, context[self._added:])
            self._added = len(context)

    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        penalty: PenaltyState | None,
        generator: torch.Generator,
    ) -> Proposal:
        start = time.perf_counter()
        self._catch_up(context)
        s = self.settings
        draft = self.entry.cache.speculate(
            self.seq_id, context[-s.max_tree_depth:], max_spec_tokens=k, max_spec_factor=s.max_spec_factor,
            max_spec_offset=s.max_spec_offset, min_token_prob=s.min_token_prob)
        if not draft.token_ids:
            return EMPTY
        return Proposal(tokens=list(draft.token_ids[:k]), draft_probs=None, seconds=time.perf_counter() - start,
                        suffix_match=draft.match_len, suffix_score=draft.score)

    def observe(self, proposed: int, accepted: int, context: list[int]) -> None:
        self._catch_up(context)  # committed tokens join this request's tree and the scope's global tree

    def release(self) -> None:
        if self._open:
            self._open = False
            self.entry.cache.stop_request(self.seq_id)
            self.store._closed(self.entry)
