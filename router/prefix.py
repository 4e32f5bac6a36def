"""Prefix caching, the router's side: what it believes each service has cached, and which cached
prefix a sequence attaches instead of recomputing it when it (re)starts at a service.

The services publish a full KV block under its content hash (common/block_hash.py) once its tokens
are history, and keep released blocks cached until evicted (LRU). The router mirrors that from
what it asked for: a block of a sequence's history is held once the service's cache of it is past
the block, and cached-but-free once the sequence is released. When a sequence starts at a service
(admission, recompute after preemption or a lost cache), its first entry names the longest mirrored
prefix of its history (`prefix_block_hashes`) and starts after it, so the step budget and the KV
reservation count only what is computed:

    history:   [ system prompt . . . . | turn 1 . . . . | turn 2 ...]      full blocks h0 .. h9
    mirror:      h0 .. h7 cached                                            -> attach h0..h7, start at 8 blocks

The mirror is a belief, never needed for correctness: a block the service evicted (or lost in a
restart) makes the entry a cache miss, the router forgets those hashes and recomputes from 0.
Each lane keeps its own mirrors (a draft replica shared by lanes is mirrored by each of them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.block_hash import ROOT, salted_root
from router.prefix_mirror import Attach, PrefixMirror
from router.sequence import Sequence

if TYPE_CHECKING:
    from prometheus_client import Counter


def attachable(seq: Sequence) -> bool:
    """Sequences whose services keep state from position 0 beside the KV (a grammar matcher, the
    history penalties count), that share their prompt by fork (n > 1) or that want every prompt
    token's logprob (echo) compute their prompts in full."""
    r = seq.request
    return not r.grammar and not r.sampling.processed and seq.fork_parent is None and not seq.forks \
        and r.prompt_logprobs is None


class PrefixCaches:
    """One lane's prefix caching: a mirror per service, the attach decisions, the hit counters."""

    def __init__(self, target_block_size: int, queries: Counter, hits: Counter, misses: Counter) -> None:
        self.target = PrefixMirror(target_block_size, adapted=True)
        self.draft: PrefixMirror | None = None  # set once the draft is known to cache prefixes
        self._queries, self._hits, self._misses = queries, hits, misses

    def use_draft(self, block_size: int | None) -> None:
        """The lane's draft caches prefixes with this block size (None: it does not)."""
        if block_size is None:
            self.draft = None
        elif self.draft is None or self.draft.block_size != block_size:
            self.draft = PrefixMirror(block_size)

    # ---- starting a sequence at a service -------------------------------------------------------
    def plan(self, seq: Sequence, target_free: int, draft_free: int) -> None:
        """At admission: the cached prefixes the first entries to both services attach."""
        if seq.prefix.planned:
            return
        seq.prefix.planned = True
        if seq.target_cached == 0:
            self.plan_target(seq, target_free)
        if self.draft is not None and seq.draft_cached == 0:
            self.draft.fit(draft_free)
            attach = self._lookup(seq, self.draft, "draft")
            seq.prefix.draft = attach
            seq.draft_cached, seq.draft_stream = attach.tokens, seq.tokens[:attach.tokens]

    def plan_target(self, seq: Sequence, free_blocks: int) -> None:
        self.target.fit(free_blocks)
        seq.prefix.target = self._lookup(seq, self.target, "target")
        seq.target_cached = seq.prefix.target.tokens
        if seq.output is not None and seq.num_output == 0:  # its usage's cached_tokens (a refused attach replans)
            seq.output.cached_prompt_tokens = min(seq.target_cached, seq.num_prompt)

    def _lookup(self, seq: Sequence, mirror: PrefixMirror, service: str) -> Attach:
        if not attachable(seq):
            return Attach((), 0)
        # the last token is always computed: it yields the first token (the target) or the next draft
        chain = _chain(seq, mirror)[:(len(seq.tokens) - 1) // mirror.block_size]
        n = mirror.match(chain)
        self._queries.labels(service=service).inc(len(seq.tokens))
        return Attach(tuple(chain[:n]), n * mirror.block_size)

    def needs_target_plan(self, seq: Sequence) -> bool:
        """A running sequence whose target cache was lost (a cache miss, a lost target) starts over."""
        a = seq.prefix.target
        return seq.target_cached == 0 and (a is None or a.confirmed)

    # ---- what the services hold ------------------------------------------------------------------
    def observe(self, seq: Sequence) -> None:
        """Bring the mirrors up to date with seq's caches, once per step: attaches confirmed or
        refused, blocks published, caches lost."""
        p = seq.prefix
        p.target = self._settle(p.target, self.target, seq.target_cached, "target")
        if p.target is None or p.target.confirmed:
            self._hold(seq, self.target, seq.target_cached)
        if self.draft is None:
            return
        if p.draft_dropped:  # the draft's cache of seq was reset (a cache miss, an error, the draft lost)
            p.draft_dropped = False
            self.draft.drop(seq.seq_id)
            if p.draft is not None and not p.draft.confirmed:
                self._refused(p.draft, self.draft, "draft")
            p.draft = None
        p.draft = self._settle(p.draft, self.draft, seq.draft_cached, "draft")
        if p.draft is None or p.draft.confirmed:
            self._hold(seq, self.draft, p.draft_committed)

    def _settle(self, a: Attach | None, mirror: PrefixMirror, cached: int, service: str) -> Attach | None:
        """An attach is confirmed once the service's cache grew past it, refused if it was reset first."""
        if a is None or a.confirmed:
            return a
        if cached > a.tokens:
            self._hits.labels(service=service).inc(a.tokens)
            return Attach(a.hashes, a.tokens, confirmed=True)
        if cached == 0 and a.hashes:
            self._refused(a, mirror, service)
            return None
        return a  # its first entry has not run yet

    def _refused(self, a: Attach, mirror: PrefixMirror, service: str) -> None:
        """Not all cached after all (evicted, or the service restarted): never try them again."""
        if a.hashes:
            mirror.forget(a.hashes)
            self._misses.labels(service=service).inc()

    def _hold(self, seq: Sequence, mirror: PrefixMirror, cached: int) -> None:
        n = cached // mirror.block_size
        if n < mirror.holding(seq.seq_id):  # less than before: the service lost it
            mirror.drop(seq.seq_id)
        if n > mirror.holding(seq.seq_id):
            mirror.hold(seq.seq_id, _chain(seq, mirror)[:n])

    def release(self, seq: Sequence) -> None:
        """seq leaves the lane (finished, preempted, moved): its blocks stay cached at the services."""
        self.observe(seq)
        self.target.release(seq.seq_id)
        if self.draft is not None:
            self.draft.release(seq.seq_id)

    # ---- KV accounting -------------------------------------------------------------------------
    @staticmethod
    def attached(seq: Sequence) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Blocks seq holds by reference at (target, draft) without having allocated them."""
        p = seq.prefix
        t = p.target.hashes if p.target and seq.target_cached >= p.target.tokens else ()
        d = p.draft.hashes if p.draft and not p.draft_dropped and seq.draft_cached >= p.draft.tokens else ()
        return t, d


def _chain(seq: Sequence, mirror: PrefixMirror) -> list[int]:
    """seq's block hashes as mirror's service computes them (the draft serves the base model for all)."""
    root = seq.request.block_root if mirror.adapted else salted_root(ROOT, seq.request.salt)
    return seq.prefix.chain(seq.tokens, mirror.block_size, root)
