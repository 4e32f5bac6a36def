"""The step loop: schedule, send the target one mixed Step, hand the draft its work for the same
step in the background, apply what the target emitted. The target never waits for the draft, except
for a call due within what its proposals are worth (upfront.grace_ms), once per call.

    iteration t:   schedule (decodes use the prepared proposal that continues their history)
                   target.Step(decodes + chunks)   ||   draft.Propose(chunks mirrored; branches for the
                   apply emitted tokens                              likely outcomes of step t), if idle
    sequential mode (--no-pipeline): plain proposals are drafted first, awaited, then the target runs

Where step t needs no decision from its own outcome (decodes only), the draft's branches landing
before its answer are sent at once as step t+1, chained (router.chain): the target runs it right
after step t, and the loop books both a step behind.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import grpc

from router.chain import ChainedStep, chainable, chained_entries, lookup_beats_chaining
from router.clients import CacheMissError, NotOwner, Rejected, ServiceDown, ServiceError, TargetClient
from router.config import RouterConfig
from router.core import FinishReason, TokenLogprob
from router.draft_plans import step_work, waiting_work
from router.drafting import DraftLane
from router.metrics import Metrics
from router.regime import DraftRegime
from router.scheduler import Scheduler, StepPlan
from router.sequence import Sequence, about
from router.speculator import Speculator
from router.step_entries import step_entries
from router.step_faults import StepFaults
from router.step_record import StepRecorder
from router.step_results import StepResults
from router.tracing import step_trace
from router.upfront import drafts_upfront, fill_misses, sequential_proposals, wait_for_landing
from tandem.v1 import target_pb2

if TYPE_CHECKING:
    from router.tracing import StepTrace

log = logging.getLogger(__name__)

class StepLoop:
    def __init__(self, config: RouterConfig, scheduler: Scheduler, target: TargetClient, draft: DraftLane,
                 metrics: Metrics, max_model_len: int, target_max_k: int,
                 emit: Callable[[Sequence, list[int], list[TokenLogprob] | None], None],
                 fail: Callable[[Sequence, FinishReason, Exception], None],
                 on_target_lost: Callable[[], None], wake: Callable[[], None] = lambda: None,
                 target_compute: str = "") -> None:
        self.config = config
        self.scheduler = scheduler
        self.target = target
        self.draft = draft
        self.metrics = metrics
        self.spec = Speculator(config, scheduler, draft, max_model_len, target_max_k, target_compute)
        self.results = StepResults(self.spec, metrics, emit)
        self.faults = StepFaults(scheduler, metrics, fail, on_target_lost)
        draft.on_done = wake
        self.steps = 0
        self._pending_release: list[int] = []
        self._chained: ChainedStep | None = None  # the step sent behind the one running (router.chain)
        self.regime = DraftRegime()  # whether the draft pays at all, measured (dynamic k, shared compute)
        self._upfront: set[int] = set()  # decoders whose next proposals are drafted before the next step
        self._answered_at = 0.0  # perf_counter() when the target's last answer came
        self.recorder = StepRecorder(self.spec, metrics, target.address)
        self._unchained = metrics.unchained_steps
        self._rests = metrics.draft_rests

    # ---- one iteration ---------------------------------------------------------------------------
    async def release_now(self, seq_ids: list[int]) -> None:
        if self._chained is not None:  # the target runs its chained entries first: release them after
            busy = self._chained.seq_ids
            self._pending_release.extend(i for i in seq_ids if i in busy)
            seq_ids = [i for i in seq_ids if i not in busy]
            if not seq_ids:
                return
        try:
            await self.target.release(seq_ids)
        except (ServiceDown, Rejected, ServiceError, NotOwner) as err:
            log.warning("target release failed: %s", err)
        self.draft.release(seq_ids)
        await self.draft.flush_releases()

    async def iteration(self) -> bool:
        """Run one step; False when there was nothing to do."""
        t_start = time.perf_counter()
        if self._pending_release:
            ids, self._pending_release = self._pending_release, []
            await self.release_now(ids)
        if self._chained is not None:
            return await self._chained_iteration(t_start)
        upfront, self._upfront = self._upfront, set()  # the last step left these decoders' proposals to now
        self.spec.drafting = drafting = self._drafting()
        if not drafting:
            upfront = set()
        self.spec.drafting_upfront = bool(upfront)  # priced as without pipelining: call, then step
        if not self.config.pipeline:
            draft_ms = await sequential_proposals(self.spec) if drafting else 0.0
        elif upfront:
            draft_ms = await sequential_proposals(self.spec, only=upfront)
            self.metrics.upfront_steps.inc()
        else:
            draft_ms = await wait_for_landing(self.spec, self.metrics.pipeline_waits)
        self.spec.new_step(upfront=upfront)
        if self.config.pipeline and drafting:
            draft_ms += await fill_misses(self.spec, self.metrics.pipeline_fills)
        only = self.faults.next_suspect()
        plan = self.scheduler.schedule(self.spec.choose_ks, self.spec.decode_ready, only)
        if plan.preempted:
            for seq in plan.preempted:
                self.metrics.preemptions.inc()
                log.info("preempted seq %d (%d tokens) for recompute", seq.seq_id, len(seq.tokens), extra=about(seq))
            await self.release_now([s.seq_id for s in plan.preempted])  # their blocks must be free for this step
        if plan.empty and only is not None:
            self.faults.cleared(only)  # it cannot run now (preempted, waiting): it is no longer a suspect
            return True
        if plan.empty:
            self.target.idle()
            self.draft.rest()
            if self.draft.up and self.draft.idle:
                work = waiting_work(self.spec)
                self.draft.launch(lambda: work, step_trace(self.config.tracing, None, self.steps))
                return bool(work.entries) or draft_ms > 0
            return draft_ms > 0
        entries, sent = step_entries(plan, self.spec.matched, self.metrics)
        plan.dispatched()
        trace = step_trace(self.config.tracing, plan, self.steps)
        launched = self._launch_draft(plan, sent, trace)
        t_target = time.perf_counter()
        with trace.target_call(plan) if trace is not None else nullcontext(None) as metadata:
            response = await self._target_step(plan, only, self._send(plan, sent, entries, metadata, launched))
        if response is None:
            return True
        if only is not None:
            self.faults.cleared(only)  # it ran alone without fault: another sequence caused it
        self._done(plan, sent, response, draft_ms, t_start, t_target, trace, chained=False)
        return True

    async def _chained_iteration(self, t_start: float) -> bool:
        """The step sent behind the last one, which the target is running (or ran): await its answer,
        chaining the next one the same way (_begin_chained prepared it when the step ahead answered).
        Its time counts from this iteration's start, like any step's (the target went on with it when
        the last one answered, but the router's work on that answer is the last step's time)."""
        chained, self._chained = self._chained, None
        assert chained is not None and chained.plan is not None, "begun when the step ahead answered"
        self.spec.drafting = self._drafting()  # for its draft call and the step after (booked already)
        self.metrics.chained_steps.inc()
        plan, sent = chained.plan, chained.sent
        t_target = self._answered_at  # the target went on with this step when the last one answered
        may_chain = self._may_chain(plan, chained.launched)
        response = await self._target_step(plan, None, self._receive(chained.ticket, plan, sent, may_chain))
        if response is None:
            return True
        for res, chosen in zip(response.results, chained.chosen, strict=True):
            assert res.alternative == chosen, f"seq {res.seq_id}: the target verified alternative {res.alternative}, " \
                                              f"the router booked {chosen}"
        self._done(plan, sent, response, 0.0, t_start, t_target, None, chained=True)
        return True

    def _begin_chained(self, chained: ChainedStep) -> None:
        """The step ahead of `chained` was applied: book what each sequence verifies in it (the
        alternative its outcome selects) and hand the draft that step's outcomes at once."""
        assert chained.proposals is not None
        self.spec.new_step()
        chained.plan = StepPlan(decodes=[(s, len(p[0])) for s, p in zip(chained.seqs, chained.proposals, strict=True)])
        chained.sent = [p[0] for p in chained.proposals]
        for seq, k, chosen, proposal, looked in zip(chained.seqs, chained.ks, chained.chosen, chained.proposals,
                                                    chained.looked, strict=True):
            seq.next_k = 0 if seq.finished else k
            self.spec.matched[seq.seq_id] = proposal
            if chosen in looked:
                self.spec.from_lookup.add(seq.seq_id)
                if looked[chosen]:  # the draft had prepared the outcome too (not a miss)
                    self.spec.lookup_over_draft.add(seq.seq_id)
            elif chosen:
                self.spec.from_draft.add(seq.seq_id)
        live = [i for i, s in enumerate(chained.seqs) if not s.finished]
        chained.launched = self._launch_draft(StepPlan(decodes=[chained.plan.decodes[i] for i in live]),
                                              [chained.sent[i] for i in live], None)

    def _drafting(self) -> bool:
        """Whether the draft works this step (router.regime): with dynamic k, on compute it shares with the
        target, while it pays. On its own device its cost is its call's time, which the policy prices
        (demo pair, two-device: the regime's noisy probes rested it at c = 4, where it made 1.17x lookup
        alone). A seeded request needs its proposals from the draft (its k may not depend on timing): it
        keeps it at work."""
        running = self.scheduler.running
        if not (self.config.dynamic_k and self.draft.up and self.spec.pacing.shares_compute()) \
                or any(s.request.reproducible for s in running):
            self.regime.unmeasured()
            return True
        return self.regime.drafting(len(running))

    def _launch_draft(self, plan: StepPlan, sent: list[list[int]], trace: StepTrace | None) -> bool:
        """Hand the draft this step's work (its chunks mirrored, branches for its outcomes), if it is idle;
        no branches for the decoders whose proposals are better drafted before the next step
        (upfront.drafts_upfront), and no work at all where that leaves it nothing to mirror. Resting
        (router.regime), it does nothing: on the cores it shares with the target even mirroring prompts
        slowed the target (it catches up when back at work)."""
        self._upfront = upfront = drafts_upfront(self.spec, plan) if self.spec.drafting else set()
        rest = "regime" if not self.spec.drafting else "upfront" if upfront and not plan.chunks \
            else "down" if not self.draft.up else "busy" if not self.draft.idle \
            else "probe" if self.spec.pacing.rests(plan, self.steps) else None
        if rest is not None:
            if rest == "busy":  # it cannot keep up: a miss of these decoders next step is late, not unasked
                self.spec.asked_for(plan)
            if self.config.pipeline and self.draft.client is not None:
                self._rests.labels(reason=rest).inc()
            return False
        self.draft.launch(lambda: step_work(self.spec, plan, sent, upfront), trace)  # planned while the Step is sent
        return True

    async def _target_step(self, plan: StepPlan, only: Sequence | None,
                           call: Coroutine[Any, Any, target_pb2.StepResponse]) -> target_pb2.StepResponse | None:
        """The target's answer to plan's step, or None when it failed (handled here). A failed step
        takes the step chained behind it along (the target's stream ends with it)."""
        try:
            response = await call
        except (CacheMissError, ServiceDown, NotOwner, ServiceError, Rejected) as err:
            self._chained = None
            if all(seq.finished for seq in plan.sequences):  # a chained step past its sequences' end
                log.info("a step of finished sequences only failed: %s", err)  # the next step tells if it matters
                return None
            self._pending_release += self.faults.step_failed(plan, only, err)
            return None
        self._answered_at = time.perf_counter()
        if self._chained is not None:
            self._chained.resolve(response)
        return response

    async def _send(self, plan: StepPlan, sent: list[list[int]], entries: list[target_pb2.StepEntry],
                    metadata: tuple[tuple[str, str], ...] | None, launched: bool) -> target_pb2.StepResponse:
        if metadata is not None or not self._may_chain(plan, launched):
            return await self.target.step(entries, metadata)
        return await self._receive(await self.target.send_step(entries), plan, sent, True)

    async def _receive(self, ticket: grpc.aio.StreamStreamCall, plan: StepPlan, sent: list[list[int]],
                       may_chain: bool) -> target_pb2.StepResponse:
        """The step's answer; if the draft's branches for its outcomes land first, the next step is sent
        (chained) before it comes."""
        receiving = asyncio.ensure_future(self.target.receive_step(ticket))
        try:
            if may_chain:
                call = self.draft.call
                if call is not None:
                    await asyncio.wait((receiving, call), return_when=asyncio.FIRST_COMPLETED)
                if not receiving.done():
                    await self._chain(plan, sent)
                else:
                    self._unchained.labels(reason="draft_late").inc()
            return await receiving
        finally:
            if not receiving.done():
                receiving.cancel()

    def _may_chain(self, plan: StepPlan, launched: bool) -> bool:
        """Whether the step after plan's may be chained behind it: the draft has a call for its outcomes
        (launched), or it would decode every sequence at k = 0 anyway (Speculator.plain_next_step): then
        the router's work between two steps overlaps the target's, as in a target-only router."""
        if not (self.config.pipeline and self.config.chain_steps and self.config.tracing is None):
            return False
        if self.faults.suspects or not chainable(plan, self.scheduler.running, bool(self.scheduler.waiting)) \
                or not self.scheduler.fits_ahead():
            self._unchained.labels(reason="plan").inc()
            return False
        if launched or self.spec.plain_next_step([s for s, _ in plan.decodes]):
            return True
        self._unchained.labels(reason="no_draft_call").inc()
        return False

    async def _chain(self, plan: StepPlan, sent: list[list[int]]) -> None:
        """Send the step after plan's, each sequence's proposals keyed by plan's outcome (router.chain)."""
        seqs = [s for s, _ in plan.decodes]
        ks = self.spec.chain_ks(seqs)
        if lookup_beats_chaining(self.spec, seqs, ks, self.recorder.round_trip_ms):
            self._unchained.labels(reason="lookup").inc()
            return
        built = chained_entries(seqs, sent, ks, self.spec.max_model_len, self.config.prompt_lookup)
        if built is None:
            self._unchained.labels(reason="no_proposal").inc()
            return
        entries, alts, looked = built
        try:
            ticket = await self.target.send_step(entries)
        except (ServiceDown, Rejected, ServiceError, NotOwner, CacheMissError) as err:
            log.debug("chained step not sent: %s", err)  # the step ahead of it reports what happened
            return
        self._chained = ChainedStep(seqs, alts, ks, ticket, looked)

    # ---- results -------------------------------------------------------------------------------
    def _done(self, plan: StepPlan, sent: list[list[int]], response: target_pb2.StepResponse, draft_ms: float,
              t_start: float, t_target: float, trace: StepTrace | None, chained: bool) -> None:
        target_wall_ms = (self._answered_at - t_target) * 1000
        draft_busy = self.draft.busy_since(t_target)  # worked alongside this step: the target may run slower
        self.results.apply(plan, sent, response)
        self.results.count_outcomes(plan, self.draft.up)
        if trace is not None:
            trace.end(plan, sent, response, self.spec.pipeline_outcome if self.draft.up else None)
        progress = self.recorder.lookup_steps(plan, response, self.regime.measuring)
        if self._chained is not None:  # the target runs it now: the draft's work for its outcomes goes first
            self._begin_chained(self._chained)
        self._record(plan, response, draft_ms, target_wall_ms, t_start, draft_busy, chained, progress)

    def _record(self, plan: StepPlan, response: target_pb2.StepResponse, draft_ms: float, target_wall_ms: float,
                t_start: float, draft_busy: bool, chained: bool, progress: float | None) -> None:
        self.steps += 1
        self.regime.observe(progress, self.recorder.record(plan, response, draft_ms, target_wall_ms, t_start,
                                                           draft_busy, chained))
