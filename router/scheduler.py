"""Continuous batching with chunked prefill under a token budget, and KV accounting for both caches.

Each step: running decodes first (each costs 1 + k_i tokens), then prompt chunks with what is
left, oldest first. A sequence reserves KV in both services for its whole history plus the
speculation lookahead; when a step's growth does not fit, the newest running sequence is
preempted (its caches dropped, its history kept for recompute). Admission is FCFS and needs
room in BOTH caches. The scheduler is pure bookkeeping: no I/O, testable without services.

With --scheduling-policy priority, each request's priority (lower first, then arrival) orders the
queue and the prompt chunks, the lowest running sequence is the one preempted, and a waiting one
that finds no room preempts running sequences of strictly lower priority (strictly: a victim never
preempts back the sequence that preempted it).

With prefix caching (router.prefix), a sequence starting at a service attaches the cached blocks of
its history's longest cached prefix: its first chunk starts after them, and they are reserved once
however many running sequences attach them (a sequence's own blocks are counted as its own, even
when another attached them: the accounting may over-count shared blocks, never under-count).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from router.config import RouterConfig
from router.core import SeqStatus
from router.prefix import PrefixCaches
from router.sequence import Sequence


@dataclass(frozen=True)
class CacheGeometry:
    num_blocks: int
    block_size: int

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


@dataclass(frozen=True)
class Chunk:
    seq: Sequence
    start: int  # target_cached before the chunk
    end: int  # exclusive; == len(seq.tokens) on the last chunk, which emits
    attach: tuple[int, ...] = ()  # cached blocks (their hashes) the sequence starts from: start == their length
    # fixed when the chunk is made: once the step's token is applied, end < len(seq.tokens)
    emit: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "emit", self.end == len(self.seq.tokens))


@dataclass
class StepPlan:
    decodes: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, k)
    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    siblings: list[Sequence] = field(default_factory=list)  # n > 1: forked from a prompt the step finishes (loop.py)

    @property
    def sequences(self) -> list[Sequence]:
        """In the order of the Step's entries."""
        return [s for s, _ in self.decodes] + [c.seq for c in self.chunks] + self.siblings

    @property
    def num_tokens(self) -> int:
        return sum(1 + k for _, k in self.decodes) + sum(c.end - c.start for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.chunks

    def dispatched(self) -> None:
        """The step is about to go out: its sequences stop waiting; prompt chunks are counted."""
        now = time.monotonic()
        for seq, _ in self.decodes:
            seq.stats.dispatched(now)
        for c in self.chunks:
            c.seq.stats.dispatched(now)
            c.seq.stats.num_prefill_chunks += 1


class Scheduler:
    def __init__(self, config: RouterConfig, target: CacheGeometry, draft: CacheGeometry | None,
                 budget: int = 0, prefix: PrefixCaches | None = None) -> None:
        self.config = config
        self.budget = budget or config.max_num_batched_tokens  # tokens per step (clamped to the target's limit)
        self.target = target
        self.draft = draft
        self.prefix = prefix
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is the newest

    # ---- KV accounting -------------------------------------------------------------------
    def _reserve(self, seq: Sequence, extra: int = 0) -> tuple[int, int]:
        """Blocks seq may allocate (target, draft) during its next step: history + lookahead, less the
        cached blocks it attached (counted once in usage())."""
        lookahead = self.config.k_max + 1
        n = len(seq.tokens) + extra
        t = self.target.blocks(n + lookahead)
        d = self.draft.blocks(n + 2 * lookahead) if self.draft else 0
        if self.prefix is not None:
            at, ad = self.prefix.attached(seq)
            t, d = t - len(at), d - len(ad)
        return t, d

    def _usage(self, extra: int = 0) -> tuple[int, int, set[int], set[int]]:
        """Blocks the running sequences allocate (target, draft), and the cached ones they attached;
        extra: tokens more per sequence."""
        t = d = 0
        shared_t: set[int] = set()
        shared_d: set[int] = set()
        for seq in self.running:
            rt, rd = self._reserve(seq, extra)
            t, d = t + rt, d + rd
            if self.prefix is not None:
                at, ad = self.prefix.attached(seq)
                shared_t.update(at)
                shared_d.update(ad)
        return t, d, shared_t, shared_d

    def usage(self) -> tuple[int, int]:
        t, d, shared_t, shared_d = self._usage()
        return t + len(shared_t), d + len(shared_d)

    def fits_ahead(self) -> bool:
        """Whether every running sequence also has room for a step after its next one (a chained step
        is planned before the router knows how many tokens the step ahead of it adds)."""
        t, d, shared_t, shared_d = self._usage(extra=self.config.k_max + 1)
        return self._fits(t + len(shared_t), d + len(shared_d))

    def _fits(self, t: int, d: int) -> bool:
        return t <= self.target.num_blocks and (self.draft is None or d <= self.draft.num_blocks)

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether a sequence of num_tokens could ever run alone (else refuse it at the door)."""
        return num_tokens <= self.max_tokens_alone()

    def max_tokens_alone(self) -> int:
        """The longest sequence that fits both caches alone, speculation lookahead included."""
        lookahead = self.config.k_max + 1
        n = self.target.num_blocks * self.target.block_size - lookahead
        if self.draft is not None:
            n = min(n, self.draft.num_blocks * self.draft.block_size - 2 * lookahead)
        return max(0, n)

    # ---- queue -----------------------------------------------------------------------------
    @property
    def by_priority(self) -> bool:
        return self.config.scheduling_policy == "priority"

    @staticmethod
    def rank(seq: Sequence) -> tuple[int, float, int]:
        """Who goes first under the priority policy: lower priority value, then earlier arrival."""
        return seq.request.priority, seq.arrival, seq.seq_id

    def add(self, seq: Sequence) -> None:
        if self.by_priority:
            bisect.insort(self.waiting, seq, key=self.rank)
        else:
            self.waiting.append(seq)

    def requeue(self, seq: Sequence) -> None:
        """A sequence sent back to waiting (preempted, moved from a lost replica): first come, it goes to
        the front; by priority, where its rank puts it."""
        if self.by_priority:
            self.add(seq)
        else:
            self.waiting.appendleft(seq)

    def victim(self) -> Sequence:
        """The running sequence to preempt first: the newest, or the lowest by priority."""
        return max(self.running, key=self.rank) if self.by_priority else self.running[-1]

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.prefix is not None:
            self.prefix.release(seq)

    def preempt(self, seq: Sequence) -> None:
        """Drop seq's caches; it goes back to the front of the queue and recomputes later."""
        self.running.remove(seq)
        if self.prefix is not None:
            self.prefix.release(seq)  # its blocks stay cached: the recompute may attach them
        seq.status = SeqStatus.WAITING
        seq.forget_caches()
        seq.num_preemptions += 1
        self.requeue(seq)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self, choose_ks: Callable[[list[Sequence], int], list[int]],
                 decode_ready: Callable[[Sequence], bool] = lambda s: True, only: Sequence | None = None) -> StepPlan:
        """Build the next step. choose_ks(decoders, prefill_tokens) -> k per decoder (capped later
        by the budget); decode_ready(seq) False keeps a decoder out of this step (it waits for
        its proposal while other work runs); `only`: a step of that one sequence (isolating a fault)."""
        plan = StepPlan()
        if self.prefix is not None:
            for seq in self.running:
                self.prefix.observe(seq)
        self._make_room(plan)
        self._admit(plan)
        if self.prefix is not None:
            self._replan_lost()
        budget = self.budget
        running = self.running if only is None else [s for s in self.running if s is only]
        prefilling = [s for s in running if s.prefilling and not s.waits_for_fork]  # siblings fork (loop.py)
        if self.by_priority:
            prefilling.sort(key=self.rank)
        if prefilling and not self.config.chunked_prefill:
            # prefill-first: whole prompts, no decodes, as many as the budget allows (at least one)
            for seq in prefilling:
                size = len(seq.tokens) - seq.target_cached
                if plan.chunks and plan.num_tokens + size > budget:
                    break
                plan.chunks.append(self._chunk(seq, len(seq.tokens)))
            return plan
        decoders = [s for s in running if not s.prefilling and decode_ready(s)]
        budget -= len(decoders)  # every decode costs at least its one token
        assert budget >= 0, "max_num_seqs <= max_num_batched_tokens guarantees room for every decode"
        prefill_tokens = min(budget, sum(len(s.tokens) - s.target_cached for s in prefilling))
        ks = choose_ks(decoders, prefill_tokens) if decoders else []
        for seq, k in zip(decoders, ks, strict=True):
            k = max(0, min(k, budget, self.config.k_max))  # decodes before prompts: k may use the budget
            plan.decodes.append((seq, k))
            budget -= k
        for seq in prefilling:
            if budget <= 0:
                break
            end = min(len(seq.tokens), seq.target_cached + budget)
            plan.chunks.append(self._chunk(seq, end))
            budget -= end - seq.target_cached
        return plan

    def _chunk(self, seq: Sequence, end: int) -> Chunk:
        a = seq.prefix.target
        pending = self.prefix is not None and a is not None and not a.confirmed and seq.target_cached == a.tokens
        return Chunk(seq, seq.target_cached, end, a.hashes if pending else ())

    def _make_room(self, plan: StepPlan) -> None:
        while self.running and not self._fits(*self.usage()):
            victim = self.victim()
            self.preempt(victim)
            plan.preempted.append(victim)

    def _admit(self, plan: StepPlan) -> None:
        while not self._admit_in_order() and self.by_priority and self.running:
            victim = self.victim()
            if victim.request.priority <= self.waiting[0].request.priority:
                return
            self.preempt(victim)  # the head ranks strictly higher: room for it, whatever the victim had done
            plan.preempted.append(victim)

    def _admit_in_order(self) -> bool:
        """Admit from the head of the queue while it fits; True when the queue emptied."""
        t, d, shared_t, shared_d = self._usage()
        while self.waiting:
            if len(self.running) >= self.config.max_num_seqs:
                return False
            seq = self.waiting[0]
            at: tuple[int, ...] = ()
            ad: tuple[int, ...] = ()
            if self.prefix is not None:
                free_d = self.draft.num_blocks - d - len(shared_d) if self.draft else 0
                self.prefix.plan(seq, self.target.num_blocks - t - len(shared_t), free_d)
                at, ad = self.prefix.attached(seq)
            rt, rd = self._reserve(seq)
            new_t, new_d = len(set(at) - shared_t), len(set(ad) - shared_d)
            if not self._fits(t + len(shared_t) + rt + new_t, d + len(shared_d) + rd + new_d):
                return False
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            t, d = t + rt, d + rd
            shared_t.update(at)
            shared_d.update(ad)
        return True

    def _replan_lost(self) -> None:
        """Running sequences whose target cache is gone (a cache miss, a lost target) start over,
        from what is cached."""
        assert self.prefix is not None
        lost = [s for s in self.running if self.prefix.needs_target_plan(s)]
        if lost:
            free = self.target.num_blocks - self.usage()[0]
            for seq in lost:
                self.prefix.plan_target(seq, free)
