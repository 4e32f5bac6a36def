"""When a pipelined draft works beside the target, and when it rests.

What a pipelined draft costs is the target's slowdown while it works (Contention): large on shared
compute, measurable on other cores of one host (caches, memory bandwidth), nil on its own GPU. Only
steps with the draft idle show it, and a draft given work on every step would never show it, so
some decode-only steps rest the draft to keep the measurement current."""

from __future__ import annotations

from collections.abc import Callable

from router.config import RouterConfig
from router.drafting import DraftLane
from router.scheduler import StepPlan
from router.step_costs import Contention

PROBE_EVERY = 32  # steps between draft-idle probes of the target's slowdown while the draft works
SLOWS_TARGET = 1.05  # a measured slowdown above this is contention, not noise
QUIET_PROBES = 8  # a draft that does not slow the target is probed this many times less often
SIZE_PROBE_EVERY = 4  # steps between probes while no idle steps of about the current size are held


class DraftPacing:
    def __init__(self, config: RouterConfig, draft: DraftLane, price: Callable[[int, int], float],
                 target_compute: str = "") -> None:
        self.config = config
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
        take lookup's proposal or run at k = 0), and one in SIZE_PROBE_EVERY while too few idle steps
        of about this one's size are held (a change of load: the contention estimate compares sizes
        alike). On its own device too: a draft quiet beside small steps may not be beside large ones.
        SmolLM2 two-device, c = 16: the target's steps ran 2-12% slower beside the draft's work than
        the same work beside none, where c = 1 and c = 4 had measured nothing (a step there is mostly
        the read of the target's weights), and the estimate, without idle steps of c = 16's size, read
        1.00-1.06. A draft measured not to slow the target is probed QUIET_PROBES times less often: the
        periodic probe only keeps that finding current. A step with prompt chunks never rests it (it
        mirrors them)."""
        if not self.config.pipeline or plan.chunks:
            return False
        if not self.contention.seen(busy=False):
            return True
        if step % SIZE_PROBE_EVERY == 0 and not self.contention.knows(len(plan.sequences)):
            return True
        return step % (PROBE_EVERY if self.slows_target() else PROBE_EVERY * QUIET_PROBES) == 0

    def charges_slowdown(self) -> bool:
        """Whether the policy weighs the draft's work beside a step against the target's slowdown: with
        dynamic k, where the draft slows the target and that slowdown has been measured."""
        return self.config.dynamic_k and self.slows_target() and self.contention.measured

    def branches_pay(self, gain: float, emitted: float) -> bool:
        """Where the draft slows the target, whether branches beside a decode-only step that add `gain`
        expected tokens are worth the stretch they cause: (slowdown - 1) x the `emitted` tokens the step
        yields (its time, at its own tokens per ms). SmolLM2 on shared cores: branches named 7-15% of the
        outcomes while slowing every step 1.1-1.25x, and the policy, pricing the drafts in hand, kept
        drafting for a few sequences: (6) ran at 0.75-0.89x lookup alone (7). Without branches the draft
        is idle beside the step; a miss may still be filled before the next."""
        return not self.charges_slowdown() or gain >= (self.contention.factor - 1) * emitted
