"""The sequence: everything the router knows about one request (one of its n choices). Its history
is the truth; both services' caches are only caches of it. A request's outputs reach its door as a
RequestStream over its sequences."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from router.core import Delta, FinishReason, Request, SeqStatus
from router.lookup import LookupShadow, PromptLookup
from router.output import OutputBuilder
from router.prefix_mirror import SeqPrefix
from router.request_stats import RequestStats
from router.spec_policy import AcceptanceTracker
from router.speculation import Prepared
from router.structured import SeqGrammar

Finisher = Callable[["Sequence", FinishReason, Exception | None], None]  # RouterEngine.finish


class Pin(Protocol):
    """The replica a sequence is pinned to (router.lanes.Lane), as a sequence's owners need it."""

    @property
    def name(self) -> str: ...

    def finished(self, seq: Sequence) -> None:
        """seq ended: out of the replica's scheduler, its KV released in both services."""


@dataclass(eq=False)
class Sequence:
    """The router's truth about one request. Service caches are only caches of `tokens`."""

    seq_id: int
    request: Request
    output: OutputBuilder | None = None  # set by RouterEngine.submit (scheduler tests run without)
    arrival: float = field(default_factory=time.monotonic)
    status: SeqStatus = SeqStatus.WAITING
    tokens: list[int] = field(default_factory=list)  # prompt + output: the history
    num_prompt: int = 0
    lane: Pin | None = None  # the target replica (and its paired draft) this sequence is pinned to
    target_cached: int = 0  # tokens the target's KV holds for this sequence
    draft_cached: int = 0  # tokens the draft's KV holds
    # What the draft's KV holds: draft_stream[:draft_cached] (the history, plus drafts that were being
    # verified when it was fed them; a rejection makes that tail stale).
    draft_stream: list[int] = field(default_factory=list)
    # Proposals prepared for coming steps (router.speculation): the one continuing the history wins.
    prepared: list[Prepared] = field(default_factory=list)
    cache_epoch: int = 0  # bumped whenever the caches are dropped: late draft results for an old epoch are void
    outcome_start: int = -1  # history length before the last verification: its branches start there
    asked_at: int = -1  # history length of the last step the draft was asked to prepare this one's outcomes for
    prefix: SeqPrefix = field(default_factory=SeqPrefix)  # cached prefixes it attaches (router.prefix)
    tracker: AcceptanceTracker = field(default_factory=AcceptanceTracker)  # of the draft's proposals
    lookup_tracker: AcceptanceTracker = field(default_factory=AcceptanceTracker)  # of prompt-lookup proposals
    lookup: PromptLookup = field(default_factory=PromptLookup)  # n-grams of the history (prompt lookup)
    lookup_shadow: LookupShadow | None = None  # lookup alone replayed over its output (router.regime's unit)
    next_k: int = 0  # desired k for this sequence's next proposal
    num_preemptions: int = 0
    stats: RequestStats = field(default_factory=RequestStats)  # its timeline and speculation figures
    first_token_time: float | None = None
    last_token_time: float | None = None
    outputs: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)  # shared by a request's n choices
    finished: bool = False
    grammar: SeqGrammar | None = None  # structured output: the grammar state over the accepted output
    index: int = 0  # choice index (n > 1)
    fork_parent: Sequence | None = None  # choices 1..n-1: the choice-0 sequence whose prompt they share
    forks: list[Sequence] = field(default_factory=list)  # choice 0: its siblings

    @property
    def waits_for_fork(self) -> bool:
        """A sibling whose leader is still computing the shared prompt: it forks from the leader's cache
        in the step that finishes it instead of prefilling (later, or after a preemption, it prefills)."""
        p = self.fork_parent
        return (p is not None and self.num_output == 0 and self.target_cached == 0 and not p.finished
                and p.status is SeqStatus.RUNNING and p.num_output == 0)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def prefilling(self) -> bool:
        """Still feeding history into the target (first prefill, or recompute after preemption)."""
        return self.target_cached < len(self.tokens) - 1 or self.num_output == 0

    def forget_caches(self) -> None:
        """Both services' caches of this sequence are gone (preempted, moved, lost): recompute."""
        self.target_cached = self.draft_cached = 0
        self.draft_stream = []
        self.prepared = []
        self.prefix.reset()
        self.cache_epoch += 1
        self.stats.queued()  # the callers put it back in a queue



class RequestStream:
    """The outputs of one submitted request (its n choices interleaved, each Delta naming its index).
    Closing it before the last Delta aborts the request and frees its KV in both services."""

    def __init__(self, seqs: list[Sequence], finish: Finisher) -> None:
        """finish: ends a sequence from outside its output (RouterEngine.finish)."""
        self.seqs, self._finish = seqs, finish
        self.seq = seqs[0]
        self._running = len(seqs)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        if not self._running:
            raise StopAsyncIteration
        delta = await self.seq.outputs.get()
        if delta.finish_reason is not None:
            self._running -= 1
            if delta.error is not None:  # one choice failed: the request fails, its siblings stop
                self.abort()
        return delta

    async def aclose(self) -> None:
        self.abort()

    def abort(self) -> None:
        self._running = 0
        for seq in self.seqs:
            if not seq.finished:
                self._finish(seq, FinishReason.ABORT, None)


def report(seq: Sequence) -> dict[str, Any]:
    """Its figures (router.request_stats), as a `tandem_metrics` answer and its trace carry them."""
    return seq.stats.report(seq.num_preemptions)


def about(seq: Sequence) -> dict[str, Any]:
    """Log fields of a line about seq (common.logs): log.info(..., extra=about(seq))."""
    return {"request_id": seq.request.request_id, "seq_id": seq.seq_id}
