"""What the step loop does when the target fails a step: a lost cache recomputes, a lost service
waits for recovery, a step the service broke on is retried one sequence at a time until the cause is
found (only it fails), a refused step preempts (capacity) or fails the entry it names."""

from __future__ import annotations

import logging
from collections.abc import Callable

from router.clients import CacheMissError, NotOwner, Rejected, ServiceDown, ServiceError
from router.core import FinishReason, InternalError
from router.metrics import Metrics
from router.scheduler import Scheduler, StepPlan
from router.sequence import Sequence

log = logging.getLogger(__name__)


class StepFaults:
    def __init__(self, scheduler: Scheduler, metrics: Metrics,
                 fail: Callable[[Sequence, FinishReason, Exception], None], on_target_lost: Callable[[], None]) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self._fail = fail
        self._on_target_lost = on_target_lost
        self.suspects: list[Sequence] = []  # the sequences of a step the target failed, each retried alone

    def next_suspect(self) -> Sequence | None:
        """The sequence the next step runs alone, if a failed step is being isolated."""
        while self.suspects and (self.suspects[0].finished or self.suspects[0] not in self.scheduler.running):
            self.suspects.pop(0)
        return self.suspects[0] if self.suspects else None

    def cleared(self, seq: Sequence) -> None:
        self.suspects.remove(seq)

    def step_failed(self, plan: StepPlan, only: Sequence | None, err: Exception) -> list[int]:
        """Act on a failed step (`only`: the suspect it ran alone); returns sequences to release."""
        if isinstance(err, CacheMissError):
            log.warning("target lost the cache of %s: recomputing them", err.seq_ids, extra={"seq_ids": err.seq_ids})
            for seq in self.scheduler.running:
                if seq.seq_id in err.seq_ids:
                    seq.target_cached = 0
        elif isinstance(err, ServiceDown | NotOwner):
            log.error("target step failed: %s", err)
            self._on_target_lost()
        elif isinstance(err, ServiceError):
            self._service_error(plan, only, err)
        elif isinstance(err, Rejected):
            return self._reject(plan, err)
        else:
            raise err
        return []

    def _service_error(self, plan: StepPlan, only: Sequence | None, err: ServiceError) -> None:
        """The target failed a step it could read. Resending it as is may fail forever, so each of its
        sequences is retried alone: one that fails alone is the cause and gets an error, the rest go on.
        Every sequence is retried at most once per failure; the target is still up."""
        self.metrics.target_errors.inc()
        if only is not None:
            log.error("target failed seq %d on its own (%s): failing that request", only.seq_id, err)
            self.suspects.remove(only)
            self._fail(only, FinishReason.ERROR, InternalError(f"the target failed this request: {err}"))
            return
        seqs = plan.sequences
        log.warning("target failed a step (%s): retrying its %d sequences one at a time", err, len(seqs))
        self.suspects.extend(s for s in seqs if s not in self.suspects)

    def _reject(self, plan: StepPlan, err: Rejected) -> list[int]:
        """The target refused the step: a capacity mismatch preempts, a bad entry fails its request."""
        log.error("target rejected a step: %s", err)
        if err.code.name == "RESOURCE_EXHAUSTED" and self.scheduler.running:
            victim = self.scheduler.victim()  # the service holds blocks the router did not count
            self.scheduler.preempt(victim)
            self.metrics.preemptions.inc()
            return [victim.seq_id]
        seqs = plan.sequences
        marker = "entries["
        if marker in err.details:
            idx = int(err.details.split(marker, 1)[1].split("]", 1)[0])
            seqs = seqs[idx:idx + 1]
        for seq in seqs:
            self._fail(seq, FinishReason.ERROR, err)
        return []
