"""Whether the draft model pays here at all, measured rather than modelled: the step loop's pace with
the draft at work, against the same with the draft resting (prompt lookup alone), each tried in turn
now and then. Resting, the draft does nothing, not even mirror prompts, and catches up when back at
work. The step loop asks only where the draft shares the target's compute.

The policy (spec_policy.choose_k, upfront, pacing) prices the draft's work from fitted models of what
steps and calls cost. Where those miss, drafting can cost more than it yields and nothing in the
models says so: on two shared cores a 4-round demo draft call took 4.7-5.2 ms, more than the target's
3.6 ms decode, and doubled the step it ran beside; the defaults (6) made 0.66-0.75x of prompt lookup
alone (7) there, and two fixes to the pricing lost (docs/benchmarks-history.md). This watches the
outcome instead, as a user's benchmark would:

    [ preferred ......... probe_after ][ the other, WINDOW ][ preferred ........ probe_after ][ ...
                      PAIRED steps ^^^  vs  ^^^ the probe's  vs  ^^^ PAIRED steps -> one paired sample

The pace is text per ms, the text counted in steps of prompt lookup alone: each sequence's output
replayed through lookup alone as it grows (router.lookup.LookupShadow), in both regimes. Tokens per
ms, compared window against window, swung with the text (lookup finds repeated blocks or none): one
load's samples read 0.3-1.8x (demo pair, shared cores), as a 16-step window at c = 1 is half a
request. Counted this way the text's yield cancels, and what windows compare is what a step costs in
each regime. (Estimated per drafting step from lookup's one proposal at its start, the count read
1.15x the replayed one on the demo pair's prompts, 0.89-1.41x per prompt: drafting was credited with
steps lookup alone would not have needed, and on two shared cores the regime drafted at c = 4 and 16
where lookup alone (7) made 1.05-1.28x the defaults' tokens per second.) A probe is still compared
with the preferred regime's steps just before and just after it (drift in the machine's speed and the
batch's contexts), and the median of the last EVIDENCE paired samples decides: the preference turns
when it favours the other regime by MARGIN. Probes come PROBE_AFTER steps apart, and further (up to
SPACED times) while the evidence is CLEAR: at least CLEAR_AFTER samples, the last one agreeing. One
sample alone never spaces them out. The first SETTLE steps of a run are not measured: proposals
prepared before it still land in it, and a draft back at work first catches up on what it missed.

A stack starts resting (PRIOR): a draft on the target's compute must be measured to pay, by the
median of TURN_AFTER samples at least. Where it does, as speculation on one GPU usually does, the
first two probes say so; where it did not, starting at work cost the probes of resting and noisy
readings that kept it at work: demo pair on two shared cores, four runs each side by side, (6) made
0.78-0.83 / 0.87-0.94 / 0.64-1.04x of prompt lookup alone (7) at c = 1 / 4 / 16 starting at work,
0.90-0.98 / 0.85-0.96 / 0.95-1.02x starting at rest; on SmolLM2, where the two regimes make about the
same, 0.97-1.01 / 0.96 at c = 1 / 16 either way, and 0.98-1.01 against 0.93-0.94x at c = 4 (133 steps).

The preference is kept per size of load (running sequences; sizes 1, 2, 3-5, 6-11, 12-23, ...: a
closed loop of c clients dips below c between requests, and c = 4 or 16 should not cross a bound each
time), and a size starts from the evidence of the size before it until it has measured a sample of its
own: the bench's c = 16 loads are 100-150 steps, shorter than a probe's gap, and a size first seen in
a warm-up's few steps had started c = 4 from no evidence (and the c = 16 after it from what c = 4's
first readings said).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

WINDOW = 16  # steps a probe of the other regime runs
PROBE_AFTER = 96  # steps of the preferred regime between probes (a probe costs 1/7 of the gap, if any)
FIRST_PROBE = 16  # ... before the first probe of a stack
SETTLE = 3  # first steps of a run not measured
PAIRED = WINDOW - SETTLE  # measured steps of the preferred regime paired with a probe, before it and after it
EVIDENCE = 5  # the last paired samples whose median decides
MARGIN = 0.03  # the other regime must make this much more per ms to be preferred ...
TURN_AFTER = 2  # ... in the median of at least this many samples
CLEAR = math.log(1.2)  # evidence this clear (the median of CLEAR_AFTER samples or more, the last one agreeing) ...
CLEAR_AFTER = 3
SPACED = 8  # ... doubles the gap between probes with each sample, up to SPACED * PROBE_AFTER
PRIOR = False  # resting, until the draft is measured to pay


def _pace(steps: list[tuple[float, float]]) -> float:
    """Text per ms, in steps of prompt lookup alone."""
    ms = sum(m for _, m in steps)
    return sum(s for s, _ in steps) / ms if ms > 0 else 0.0


@dataclass
class _Size:
    prefer: bool = PRIOR  # True: drafting
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=EVIDENCE))  # log(resting / drafting)
    current: bool = PRIOR  # the regime running now
    spacing: int = 1  # probes PROBE_AFTER * spacing steps apart
    own: int = 0  # samples this size measured (the rest came from the size before it)
    run: int = 0  # steps of the current run
    before: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=PAIRED))  # preferred: (steps, ms)
    probe: list[tuple[float, float]] = field(default_factory=list)  # the probe's measured steps
    after: list[tuple[float, float]] | None = None  # preferred steps after a probe, until PAIRED of them

    @property
    def evidence(self) -> float:
        return statistics.median(self.samples) if self.samples else 0.0

    def add(self, steps: float, ms: float) -> None:
        if self.current != self.prefer:
            self.probe.append((steps, ms))
            return
        if self.after is None:
            self.before.append((steps, ms))
            return
        self.after.append((steps, ms))
        if len(self.after) >= PAIRED:
            self._paired()

    def begin_probe(self) -> None:
        if self.after is not None:  # the last probe's after-steps were cut short by this one
            self._paired()
        self.probe, self.after = [], None
        self.current, self.run = not self.prefer, 0

    def end_probe(self) -> None:
        self.after = [] if len(self.probe) >= PAIRED // 2 and self.before else None
        self.current, self.run = self.prefer, 0

    def _paired(self) -> None:
        """One sample: the probe against the preferred regime's steps around it (before and after cancel
        a drift in the machine's speed and the batch's contexts)."""
        assert self.after is not None
        around, probe = _pace(list(self.before) + self.after), _pace(self.probe)
        self.before.extend(self.after)
        self.after = None
        if probe <= 0 or around <= 0:
            return
        ratio = math.log(probe / around)  # the probe's regime over the preferred one
        self.samples.append(ratio if self.prefer else -ratio)
        self.own += 1
        evidence = self.evidence
        favour = -1.0 if self.prefer else 1.0  # the sign of a log(resting / drafting) that favours the preference
        clear = len(self.samples) >= CLEAR_AFTER and favour * evidence > CLEAR and favour * self.samples[-1] > 0
        self.spacing = min(2 * self.spacing, SPACED) if clear else 1
        if len(self.samples) >= TURN_AFTER and abs(evidence) > math.log(1 + MARGIN) and (evidence < 0) != self.prefer:
            self.prefer = evidence < 0
            self.current, self.run, self.before = self.prefer, 0, deque(maxlen=PAIRED)
            log.info("draft regime: %s (pace resting / drafting %.3f, median of %d probes)",
                     "drafting" if self.prefer else "the draft rests, prompt lookup alone", math.exp(evidence),
                     len(self.samples))


class DraftRegime:
    def __init__(self) -> None:
        self.sizes: dict[int, _Size] = {}
        self._last: _Size | None = None  # the size of the last step decided
        self._measured: _Size | None = None  # ... while that step is to be measured

    @staticmethod
    def size_of(running: int) -> int:
        return 0 if running < 2 else int(math.log2(running / 1.5)) + 1

    def drafting(self, running: int) -> bool:
        """The regime of the next step, with `running` sequences: True to draft. A step of no sequences
        (the loop found nothing to do) is no step of a run."""
        if running == 0:
            self._measured = None
            return self._last.current if self._last is not None else PRIOR
        key, last = self.size_of(running), self._last
        size = self.sizes.get(key)
        if size is None or (not size.own and last is not None and last is not size and last.samples):
            # a size that has measured nothing itself follows the last one's evidence: one first seen in a
            # warm-up's few steps would otherwise start a later load of its size from nothing
            size = self.sizes[key] = _Size() if last is None else \
                _Size(last.prefer, deque(last.samples, maxlen=EVIDENCE), last.prefer, last.spacing)
        self._last = size
        if size.current != size.prefer and size.run >= WINDOW:
            size.end_probe()
        elif size.current == size.prefer and size.run >= (PROBE_AFTER * size.spacing if size.samples else FIRST_PROBE):
            size.begin_probe()
        size.run += 1
        self._measured = size if size.run > SETTLE else None
        return size.current

    @property
    def measuring(self) -> bool:
        """Whether the step drafting() decided last is a sample (settled, in a size's run)."""
        return self._measured is not None

    def unmeasured(self) -> None:
        """The next step is decided elsewhere (no draft, a seeded request): it is not a sample."""
        self._measured = None

    def observe(self, steps: float | None, ms: float) -> None:
        """The step drafting() decided last: how far its decoders got, in steps of prompt lookup alone
        (the replays' steps it resolved, averaged over them: maybe 0, a replay waits for the tokens that
        resolve its step; None without decoders), and the loop's time for it (ms, prompt chunks' own
        share taken out). Only settled steps with decoders count."""
        size, self._measured = self._measured, None
        if size is not None and steps is not None and ms > 0:
            size.add(steps, ms)
