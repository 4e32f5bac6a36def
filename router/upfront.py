"""Draft calls made before a step, on its critical path: sequential mode's plain proposals
(--no-pipeline), and, pipelined, a short wait for a call about to land with the branches the step
needs (grace_ms), a plain proposal for the decoders whose prepared branches missed their outcome,
where it is worth its time (a fill), and plain proposals for every decoder where branches beside
the step before would have slowed it more than such a call costs (drafts_upfront).

    pipelined, step t answered:  hit   the branch prepared for its outcome is verified at once
                                 miss  k = 0 or a prompt-lookup guess in step t+1 ...
                                       ... or, filled: the draft proposes k now, step t+1 verifies it

A miss left unfilled emits about one token where a hit emits 1 + a + ... + a^k; at acceptance 0.9
and k = 4 that is a step's worth of three tokens, against a k-round draft call that costs a fraction
of a target step. A filled miss still counts as the pipeline's miss (late or wrong): the fill is
drafting in sequence, not a prepared branch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import Counter

from router.draft_work import DraftWork
from router.scheduler import StepPlan
from router.sequence import Sequence
from router.spec_policy import expected_tokens, worth_waiting_ms
from router.tracing import step_trace

if TYPE_CHECKING:
    from router.speculator import Speculator


def misses_worth_filling(spec: Speculator, decoders: list[Sequence]) -> tuple[list[Sequence], float]:
    """The decoders whose miss a plain proposal drafted now should fill: the set that most raises the
    step's expected tokens per ms, its call's time (BranchCost, k rounds per entry) added to the step's;
    and how long that call may take before the step would have done better without it (ms). A miss
    counts at what it emits without a fill (lookup's guess at lookup's acceptance, else one token), a
    fill at the draft's acceptance with the sequence's cap; the rest at what they verify."""
    tokens = 0.0  # expected tokens the step emits without fills
    scored = 0  # tokens the target scores without fills
    missed: list[tuple[float, int, int, Sequence]] = []  # (gain, extra tokens scored, cap, seq)
    for seq in decoders:
        cap = spec.cap(seq)
        drafted = spec.proposal(seq)[0][:cap]
        if cap == 0 or drafted or seq.request.reproducible:  # a seeded one waits for its own (decode_ready)
            tokens += expected_tokens(seq.tracker.rate, len(drafted))
            scored += 1 + len(drafted)
            continue
        looked = spec.lookup(seq)[0][:cap]
        fallback = expected_tokens(seq.lookup_tracker.rate, len(looked))
        tokens += fallback
        scored += 1 + len(looked)
        gain = expected_tokens(seq.tracker.rate, cap) - fallback
        if gain > 0:
            missed.append((gain, cap - len(looked), cap, seq))
    if not missed:
        return [], 0.0
    n = len(decoders)
    unfilled = best = tokens / spec.cost.step_ms(scored, n)
    chosen, worth_ms = 0, 0.0
    gained, extra, k = 0.0, 0, 0
    missed.sort(key=lambda m: m[0], reverse=True)
    for i, (gain, more, cap, _) in enumerate(missed, start=1):
        gained, extra, k = gained + gain, extra + more, max(k, cap)
        step_ms = spec.cost.step_ms(scored + extra, n)
        goodput = (tokens + gained) / (step_ms + spec.branch_cost.call_ms(k * i, 0))
        if goodput > best * 1.0001:
            best, chosen = goodput, i
            worth_ms = (tokens + gained) / unfilled - step_ms  # the call's time at which it stops paying
    return [seq for *_, seq in missed[:chosen]], worth_ms


def grace_ms(spec: Speculator) -> float:
    """How long the next step should wait for the draft call in flight: it carries the branches for
    the outcome some decoders just had, and arriving a moment late it would leave them at k = 0 (or
    a weaker lookup guess) for a whole step. Worth its expected tokens when a branch names the
    outcome (as often as past branches did), at the odds past waits had (worth_waiting_ms), and
    only if the call is due within that time (BranchCost's estimate; an overdue call may be about
    to land too: on shared cores a call slows while the target computes and finishes fast once it
    is done). Once per call; a slow or stuck draft makes the waits time out, and the odds fall
    until no wait is worth it: it never paces the target."""
    work = spec.draft.in_flight
    if not spec.config.pipeline or work is None or spec.draft.waited_for or not spec.draft.up:
        return 0.0
    # the sequences it prepares proposals for, at the history each had when it was sent
    carried = {e.seq_id: len(base) - e.num_verifying for e, base in zip(work.entries, work.bases, strict=True)
               if e.k > 0 or e.branches}
    decoders = spec.decoding()
    waiting = {s.seq_id for s in decoders
               if carried.get(s.seq_id) == s.outcome_start and not spec.prepared_for_outcome(s)}
    if not waiting:
        return 0.0
    tokens = gain = 0.0
    drafted = 0
    for seq in decoders:
        cap = spec.cap(seq)
        drafted += cap
        with_draft = expected_tokens(seq.tracker.rate, cap)
        if seq.seq_id in waiting and cap:
            fallback = expected_tokens(seq.lookup_tracker.rate, len(spec.lookup(seq)[0][:cap]))
            tokens += fallback
            gain += max(0.0, with_draft - fallback) * spec.match_odds.rate  # if a branch names the outcome
        else:
            tokens += with_draft
    if gain == 0:
        return 0.0
    step_ms = spec.cost.step_ms(len(decoders) + drafted, len(decoders)) * spec.pacing.contention.factor
    limit = worth_waiting_ms(step_ms, tokens, gain, spec.wait_odds.rate)
    elapsed = (time.perf_counter() - spec.draft.started) * 1000
    expected = spec.branch_cost.call_ms(work.rounds * len(work.entries), work.branches * max(1, work.rounds - 1))
    return limit if expected - elapsed <= limit else 0.0


def drafts_upfront(spec: Speculator, plan: StepPlan) -> set[int]:
    """The decoders the draft should propose for before the next step (a plain call on
    the critical path, as without pipelining) instead of preparing branches for its outcomes beside
    it. Where it slows the target, branches stretch the step by (slowdown - 1) x its time and hold
    the outcome as often as past branches did (match_odds); drafted upfront, the call's time buys
    the same drafts for sure. Demo pair, shared cores, c=4: steps of 22 ms ran 30 beside the branches
    (1.4x) while a call of 4 rounds for 4 sequences took 10-12 ms, and sequential (4) beat pipelined
    (6). Beside prompt chunks the draft still mirrors them; the branches' stretch there is taken as
    beside a decode-only step of the same decoders (the same call beside the step): demo pair, c=16,
    chunk steps of ~220 tokens took 105-112 ms with branches and mirroring beside them against 76-87
    ms with mirroring alone (sequential (4)), and those steps were 60% of the load's.
    Not for a decoder on prompt lookup whose lookups beat a full proposal of the draft's (SmolLM2
    at c=16: drafting for every decoder with k > 0 put 40 ms of draft a step on the critical path
    for sequences that took lookup's guesses), but for one whose branches missed: left out, such
    decoders stayed off the draft for good on steps drafted upfront (demo c=4: upfront on half the
    steps, no more tokens a step, misses back only through fills). Empty: branches, as pipelined."""
    if not spec.config.pipeline or not spec.pacing.charges_slowdown():
        return set()
    wanting = [seq for seq, k in plan.decodes
               if seq.next_k > 0 and not seq.request.reproducible and not spec.keeps_to_lookup(seq, k)]
    if not wanting:
        return set()
    call_ms = spec.branch_cost.call_ms(max(s.next_k for s in wanting) * len(wanting), 0)
    decode_tokens = sum(1 + k for _, k in plan.decodes)
    stretch_ms = (spec.pacing.contention.factor - 1) * spec.cost.step_ms(decode_tokens, len(plan.decodes))
    return {s.seq_id for s in wanting} if call_ms * spec.match_odds.rate < stretch_ms else set()


async def wait_for_landing(spec: Speculator, waits: Counter) -> float:
    """Wait at most grace_ms for the call in flight, which carries branches this step needs; `waits`
    counts the waits by outcome (arrived, timed_out). Returns the wait (critical path, ms)."""
    wait_ms = grace_ms(spec)
    if wait_ms <= 0:
        return 0.0
    t0 = time.perf_counter()
    spec.draft.waited_for = True
    await spec.draft.wait(wait_ms / 1000)
    spec.wait_odds.observe(spec.draft.idle)
    waits.labels(outcome="arrived" if spec.draft.idle else "timed_out").inc()
    return (time.perf_counter() - t0) * 1000


async def fill_misses(spec: Speculator, filled: Counter | None = None) -> float:
    """Pipelined: fill the misses worth it (misses_worth_filling) with one plain Propose, if the draft
    is idle (a call still in flight had its grace: grace_ms). The step waits for the call
    no longer than it is worth: a slow draft's fill lands after the step went on without it (the
    target never waits for a draft past what its drafts pay for). `filled` counts the misses filled.
    Returns the wait (critical path, ms)."""
    draft = spec.draft
    if not (draft.up and draft.idle):
        return 0.0
    fills, worth_ms = misses_worth_filling(spec, spec.decoding())
    work, kinds = DraftWork(), {}
    for seq in fills:
        kind = spec.miss_kind(seq)  # before this call asks for it
        if work.add(seq, list(seq.tokens), spec.cap(seq), 0, seq.request.sampling_proto, [], draft.budget):
            kinds[seq.seq_id] = kind
    if not work.entries:
        return 0.0
    t0 = time.perf_counter()
    draft.launch(lambda: work, step_trace(spec.config.tracing, None, -1))
    await draft.wait(worth_ms / 1000)
    draft.waited_for = True  # once per call (grace_ms): a fill that did not land is not waited for again
    if draft.idle:
        spec.filled.update(kinds)
        if filled is not None:
            filled.inc(len(kinds))
    return (time.perf_counter() - t0) * 1000


async def sequential_proposals(spec: Speculator, only: set[int] | None = None) -> float:
    """Without pipelining, decoders lacking a proposal get a plain one first (on the critical path);
    pipelined, the decoders `only` that drafts_upfront left to now. The policy sizes the proposals
    before the step is planned, so without its prompt tokens; a decoder drafted upfront keeps at least
    the k it wanted when it was chosen for this (the step's own choice may verify fewer): sized
    afresh, 23 of 202 such decoders at demo c=4 got k = 0 here, and then wanted drafts in the step,
    which ran them at k = 0 for want of a proposal."""
    draft = spec.draft
    if not draft.up:
        return 0.0
    running = [s for s in spec.scheduler.running if not s.prefilling]
    lacking = [s for s in running if spec.cap(s) > 0 and not spec.proposal(s)[0] and (only is None or s.seq_id in only)]
    if not lacking:
        return 0.0  # no draft work: an idle router must be able to tell it did nothing
    t0 = time.perf_counter()
    wanted = {s.seq_id: s.next_k if only is not None else 0 for s in lacking}
    await draft.wait()  # the previous step's prompt mirroring
    spec.choose_ks(running, 0)  # sizes the proposals; a sequence held at k = 0 needs none
    work = DraftWork()
    for seq in lacking:
        k = min(max(seq.next_k, wanted[seq.seq_id]), spec.cap(seq))
        if k > 0:
            work.add(seq, list(seq.tokens), k, 0, seq.request.sampling_proto, [], draft.budget)
    await draft.run(work, step_trace(spec.config.tracing, None, -1) if work.entries else None)
    return (time.perf_counter() - t0) * 1000
