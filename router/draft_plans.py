"""The draft's work for each step, planned while the target's Step is sent: prompt chunks mirrored
(the draft's prefill), pipelined branches for the likely outcomes of the step's verifications (the
speculation cache, router.speculation), and plain proposals for seeded sequences waiting for theirs.
router.upfront has the draft calls made before a step instead."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from router.draft_work import DraftWork
from router.scheduler import StepPlan
from router.sequence import Sequence
from router.spec_policy import expected_tokens
from router.speculation import Candidate, plan_branches

if TYPE_CHECKING:
    from router.speculator import Speculator


def step_work(spec: Speculator, plan: StepPlan, sent: list[list[int]], upfront: set[int] | None = None) -> DraftWork:
    """Mirror this step's prompt chunks and, pipelined, prepare branches for its likely outcomes (but
    not the decoders `upfront`: the next iteration drafts for them, upfront.drafts_upfront)."""
    work, budget = DraftWork(), spec.draft.budget
    cands: list[tuple[Sequence, list[int], Candidate]] = []
    # Where it slows the target, a draft whose proposals no decoder took this step is pure cost: it
    # prepares nothing for sequences on prompt lookup whose lookups beat even a full proposal of its
    # own. A sequence on lookup only because the draft had nothing ready for it (late) is not one:
    # resting the draft for it would keep it late, and on lookup, for as long as lookup has offers.
    idle_draft = spec.pacing.slows_target() and not spec.from_draft
    dormant = bool(plan.chunks) and idle_draft and spec.draft_dormant()  # (only chunks are mirrored)
    if spec.config.pipeline:
        for (seq, _), drafts in zip(plan.decodes, sent, strict=True):
            if upfront and seq.seq_id in upfront:
                continue
            if idle_draft and spec.keeps_to_lookup(seq, len(drafts)):
                continue
            if seq.next_k > 0 and not seq.request.reproducible:
                cands.append((seq, seq.tokens + drafts,
                              Candidate(seq.seq_id, len(drafts), spec.verify_rate(seq), seq.next_k,
                                        seq.tracker.rate, spec.acceptance_of(seq, drafts))))
        for c in plan.chunks:
            cap = spec.cap(c.seq)
            if c.emit and cap > 0 and not c.seq.request.reproducible and not dormant:
                cands.append((c.seq, list(c.seq.tokens), Candidate(c.seq.seq_id, 0, c.seq.tracker.rate, cap)))
        if cands and not plan.chunks and not branches_pay(spec, plan, [c for _, _, c in cands]):
            cands = []
    budget_ms = spec.cost.step_ms(plan.num_tokens, len(plan.sequences))
    branches = plan_branches([c for _, _, c in cands], spec.draft.stats, branch_budget(spec, cands, budget_ms))
    planned = {seq.seq_id for seq, _, _ in cands}
    for c in plan.chunks:  # mirrored first: they are the draft's prefill
        if c.seq.seq_id not in planned and not dormant:
            work.add(c.seq, c.seq.tokens[:c.end], 0, 0, c.seq.request.sampling_proto, [], budget)
    for seq, base, cand in cands:
        work.add(seq, base, cand.k, cand.v, seq.request.sampling_proto, branches[seq.seq_id], budget)
    add_plain(spec, work, budget)
    # Due a step's time from now, a moment after it began: counted from its start, twice the calls at demo
    # c=1 stopped early for no gain (a call a little late is still waited for, grace_ms). Never seeded ones.
    if cands and not any(s.request.reproducible for s in work.seqs):
        work.due = time.perf_counter() + budget_ms * spec.draft_cost.slowdown / 1000
    return work


def branches_pay(spec: Speculator, plan: StepPlan, cands: list[Candidate]) -> bool:
    """Whether branches for a decode-only step's outcomes pay for the stretch they cause
    (DraftPacing.branches_pay): they name the outcome as often as past branches did (match_odds),
    each hit worth its drafts' expected tokens beyond a plain decode's one (at the draft's acceptance)."""
    gain = spec.match_odds.rate * sum(c.gain for c in cands)
    emitted = sum(expected_tokens(spec.verify_rate(seq), k) for seq, k in plan.decodes)
    return spec.pacing.branches_pay(gain, emitted)


def waiting_work(spec: Speculator) -> DraftWork:
    """Nothing could run: what the sequences waiting for the draft need."""
    work = DraftWork()
    add_plain(spec, work, spec.draft.budget)
    return work


def add_plain(spec: Speculator, work: DraftWork, budget: int) -> None:
    """Plain proposals for seeded sequences waiting for theirs (they never take a guessed branch)."""
    for seq in spec.scheduler.running:
        if not seq.prefilling and not spec.decode_ready(seq) and seq not in work.seqs:
            work.add(seq, list(seq.tokens), spec.cap(seq), 0, seq.request.sampling_proto, [], budget)


def branch_budget(spec: Speculator, cands: list[tuple[Sequence, list[int], Candidate]], step_ms: float) -> int:
    """Branches the draft can prepare within about one target step (at least one per sequence)."""
    if not cands:
        return 0
    k = max(c.k for _, _, c in cands)
    if spec.pacing.slows_target():  # every branch delays the target: only each sequence's likeliest outcome
        return len(cands)
    by_time = max(len(cands), spec.branch_cost.affordable(step_ms, len(cands) * (1 + k), k))
    geometry = spec.scheduler.draft
    if geometry is None:
        return by_time
    # forks live only during the call, in the draft blocks no sequence has reserved
    spare = geometry.num_blocks - spec.scheduler.usage()[1]
    return min(by_time, spare // (1 + geometry.blocks(k)))
