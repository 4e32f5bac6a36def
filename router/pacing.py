"""When a pipelined draft works beside the target, and when it rests.

What a pipelined draft costs is the target's slowdown while it works (Contention): large on shared
compute, measurable on other cores of one host (caches, memory bandwidth), nil on its own GPU. Only
steps with the draft idle show it, and a draft given work on every step would never show it, so
some decode-only steps rest the draft to keep the measurement current."""

from __future__ import annotations

from collections.abc import Callable

from router.drafting import DraftLane
from router.scheduler import StepPlan
from router.step_costs import Contention

PROBE_EVERY = 32  # steps between draft-idle probes of the target's slowdown while the draft works
SLOWS_TARGET = 1.05  # a measured slowdown above this is contention, not noise
QUIET_PROBES = 8  # a draft that does not slow the target is probed this many times less often


class DraftPacing:
    def __init__(self, pipeline: bool, draft: DraftLane, price: Callable[[int, int], float],
                 target_compute: str = "") -> None:
        self.pipeline = pipeline
        self.draft = draft
        self.target_compute = target_compute  # ModelInfo.compute_id of the target
        self.contention = Contention(price)  # how much slower the target runs while the draft works

    def shares_compute(self) -> bool:
        """Draft and target on the same cores or GPU: every branch the draft prepares slows the target."""
        info = self.draft.info
        return bool(self.draft.up and info is not None and info.compute_id and info.compute_id == self.target_compute)

    def slows_target(self) -> bool:
        """Whether the draft's work costs the target time: sharing its cores or GPU, or measured to slow
        it (a draft on other cores of one socket still contends for its caches and memory bandwidth)."""
        return self.shares_compute() or self.contention.factor > SLOWS_TARGET

    def rests(self, plan: StepPlan, step: int) -> bool:
        """Whether this step runs without draft work: a decode-only step rests the draft until a few
        idle steps are measured, then one in PROBE_EVERY (its decoders find no branch next step: they
        take lookup's proposal or run at k = 0). A draft measured not to slow the target is probed
        QUIET_PROBES times less often: the probe only keeps that finding current. A step with prompt
        chunks never rests it (it mirrors them)."""
        if not self.pipeline or plan.chunks:
            return False
        every = PROBE_EVERY if self.slows_target() else PROBE_EVERY * QUIET_PROBES
        return not self.contention.seen(busy=False) or step % every == 0
