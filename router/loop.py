"""The step loop: schedule, send the target one mixed Step while the draft mirrors prompt chunks
and drafts the next proposals, then apply what the target emitted.

    iteration t:   [sequential proposals, only when nothing else could run]
                   target.Step(decodes + chunks)  ||  draft.Sync(chunks) -> draft.Propose(next, optimistic)
                   apply emitted tokens; a proposal whose assumption held is ready for t+1
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from router.clients import CacheMissError, Rejected, ServiceDown, TargetClient
from router.config import RouterConfig
from router.core import FinishReason, Sequence, TokenLogprob
from router.drafting import DraftLane, ProposalRequest
from router.metrics import Metrics
from router.scheduler import Scheduler, StepPlan
from router.spec_policy import DraftCost, StepCostModel, choose_k
from tandem.v1 import target_pb2

log = logging.getLogger(__name__)


class StepLoop:
    def __init__(self, config: RouterConfig, scheduler: Scheduler, target: TargetClient, draft: DraftLane,
                 metrics: Metrics, max_model_len: int,
                 emit: Callable[[Sequence, list[int], list[TokenLogprob] | None], None],
                 fail: Callable[[Sequence, FinishReason, Exception], None],
                 on_target_lost: Callable[[], None]) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self._fail = fail
        self.scheduler = scheduler
        self.target = target
        self.draft = draft
        self.metrics = metrics
        self._emit = emit
        self._on_target_lost = on_target_lost
        self.cost = StepCostModel()
        self.draft_cost = DraftCost(pipelined=config.pipeline)
        self.steps = 0
        self._pending_release: list[int] = []

    # ---- speculation policy ------------------------------------------------------------------
    def spec_cap(self, seq: Sequence) -> int:
        """Largest k this sequence may use now (0: plain decoding)."""
        if not self.draft.up or self.config.k_max == 0:
            return 0
        cap = min(self.config.k_max, self.draft.max_k - 1)  # one proposal slot is the bonus guess
        if seq.request.max_speculative_tokens is not None:
            cap = min(cap, seq.request.max_speculative_tokens)
        limit = min(self.max_model_len, self.draft.info.max_model_len if self.draft.info else 0)
        if len(seq.tokens) + 2 * cap + 2 > limit:
            return 0
        return max(cap, 0)

    def _reproducible(self, seq: Sequence) -> bool:
        s = seq.request.sampling
        return s.seed is not None and s.temperature > 0

    def _choose_ks(self, decoders: list[Sequence], prefill_tokens: int) -> list[int]:
        caps = [self.spec_cap(s) for s in decoders]
        if self.config.dynamic_k:
            dyn = [i for i, s in enumerate(decoders) if not self._reproducible(s)]
            rates = [decoders[i].tracker.rate for i in dyn]
            chosen = choose_k(rates, [caps[i] for i in dyn], prefill_tokens, self.cost, self.draft_cost)
            for i, k in zip(dyn, chosen, strict=True):
                caps[i] = k
        for seq, k in zip(decoders, caps, strict=True):
            seq.next_k = k
        return [min(k, len(s.proposal())) for s, k in zip(decoders, caps, strict=True)]

    def _decode_ready(self, seq: Sequence) -> bool:
        # Seeded sampling stays reproducible only if its k never depends on timing: it waits
        # for its proposal instead of running at k = 0 while the draft works.
        return not (self._reproducible(seq) and self.spec_cap(seq) > 0 and not seq.proposal())

    # ---- one iteration ---------------------------------------------------------------------------
    async def release_now(self, seq_ids: list[int]) -> None:
        try:
            await self.target.release(seq_ids)
        except (ServiceDown, Rejected) as err:
            log.warning("target release failed: %s", err)
        await self.draft.release(seq_ids)

    async def iteration(self) -> bool:
        """Run one step; False when there was nothing to do."""
        t_start = time.perf_counter()
        if self._pending_release:
            ids, self._pending_release = self._pending_release, []
            await self.release_now(ids)
        draft_ms = await self._sequential_proposals()
        plan = self.scheduler.schedule(self._choose_ks, self._decode_ready)
        if plan.preempted:
            for seq in plan.preempted:
                self.metrics.preemptions.inc()
                log.info("preempted seq %d (%d tokens) for recompute", seq.seq_id, len(seq.tokens))
            await self.release_now([s.seq_id for s in plan.preempted])  # their blocks must be free for this step
        if plan.empty:
            return draft_ms > 0
        entries, sent = self._entries(plan)
        draft_task = None
        if self.draft.up:
            chunks = [(c.seq, list(c.seq.tokens), c.end) for c in plan.chunks]
            draft_task = asyncio.create_task(self._draft_during_step(chunks, self._optimistic_requests(plan, sent)))
        t_target = time.perf_counter()
        try:
            response = await self.target.step(entries)
            target_wall_ms = (time.perf_counter() - t_target) * 1000
        except CacheMissError as err:
            log.warning("target lost the cache of %s: recomputing them", err.seq_ids)
            for seq in self.scheduler.running:
                if seq.seq_id in err.seq_ids:
                    seq.target_cached = 0
            response = None
        except ServiceDown as err:
            log.error("target step failed: %s", err)
            self._on_target_lost()
            response = None
        except Rejected as err:
            self._reject(plan, err)
            response = None
        if response is not None:
            self._apply(plan, sent, response)
        if draft_task is not None:
            t_wait = time.perf_counter()
            await draft_task
            draft_ms += (time.perf_counter() - t_wait) * 1000  # the draft outlasted the target: critical path
        if response is not None:
            self._record(plan, response, draft_ms, target_wall_ms, t_start)
        return True

    def _entries(self, plan: StepPlan) -> tuple[list[target_pb2.StepEntry], list[list[int]]]:
        entries, sent = [], []
        for seq, k in plan.decodes:
            drafts = seq.proposal()[:k]
            n = len(seq.tokens)
            assert seq.target_cached == n - 1, f"seq {seq.seq_id}: target holds {seq.target_cached}, history {n}"
            params = seq.request.sampling.to_proto()
            probs = [] if params.temperature == 0 else [seq.draft_probs[n + j] for j in range(len(drafts))]
            entries.append(target_pb2.StepEntry(
                seq_id=seq.seq_id, start_pos=n - 1, tokens=[seq.tokens[-1], *drafts], emit=True,
                num_draft_tokens=len(drafts), draft_probs=probs, sampling=params, logprobs=self._lp(seq)))
            sent.append(drafts)
        for c in plan.chunks:
            entries.append(target_pb2.StepEntry(
                seq_id=c.seq.seq_id, start_pos=c.start, tokens=c.seq.tokens[c.start:c.end], emit=c.emit,
                sampling=c.seq.request.sampling.to_proto(), logprobs=self._lp(c.seq)))
        return entries, sent

    @staticmethod
    def _lp(seq: Sequence) -> int:
        return -1 if seq.request.logprobs is None else seq.request.logprobs

    async def _sequential_proposals(self) -> float:
        """Proposals on the critical path: always without pipelining; with it, only for sequences
        that lack one when nothing else is ready (the target would sit idle anyway)."""
        if not self.draft.up:
            return 0.0
        running = [s for s in self.scheduler.running if not s.prefilling]
        lacking = [s for s in running if self.spec_cap(s) > 0 and not s.proposal()]
        if not lacking:
            return 0.0
        self._choose_ks(running, 0)  # sizes proposals; a sequence the policy holds at k = 0 needs none
        lacking = [s for s in lacking if s.next_k > 0]
        if not lacking:
            return 0.0
        if self.config.pipeline:
            others = any(s.prefilling for s in self.scheduler.running) or len(lacking) < len(running)
            lacking = [s for s in lacking if not others or not self._decode_ready(s)]
            if others and not lacking:
                return 0.0
        requests = [ProposalRequest(s, list(s.tokens), s.next_k) for s in lacking]
        return await self._propose(requests)

    async def _propose(self, requests: list[ProposalRequest]) -> float:
        ms = await self.draft.propose(requests, {r.seq.seq_id: r.seq.request.sampling.to_proto() for r in requests})
        if requests:
            self.draft_cost.observe(ms, max(r.k for r in requests))
        return ms

    def _optimistic_requests(self, plan: StepPlan, sent: list[list[int]]) -> list[ProposalRequest]:
        """Next proposals, drafted while the target scores this step. Bases are captured now,
        before the target's answer changes any history."""
        if not self.config.pipeline:
            return []
        requests = []
        for (seq, _), drafts in zip(plan.decodes, sent, strict=True):
            k_next = seq.next_k
            if k_next > 0:  # optimistic: all of `drafts` accepted; the first proposed token guesses the bonus
                requests.append(ProposalRequest(seq, seq.tokens + drafts, k_next + 1))
        for c in plan.chunks:
            if c.emit and self.spec_cap(c.seq) > 0:  # the first proposed token guesses the first output token
                requests.append(ProposalRequest(c.seq, list(c.seq.tokens), self.spec_cap(c.seq) + 1))
        return requests

    async def _draft_during_step(self, chunks: list[tuple[Sequence, list[int], int]],
                                 requests: list[ProposalRequest]) -> None:
        await self.draft.sync(chunks)
        await self._propose(requests)

    # ---- results -------------------------------------------------------------------------------
    def _apply(self, plan: StepPlan, sent: list[list[int]], response: target_pb2.StepResponse) -> None:
        results = list(response.results)
        assert len(results) == len(plan.decodes) + len(plan.chunks)
        for (seq, _), drafts, res in zip(plan.decodes, sent, results, strict=False):
            k = len(drafts)
            seq.tracker.update(k, res.num_accepted)
            if k:
                self.metrics.num_drafts.inc()
                self.metrics.num_draft_tokens.inc(k)
                self.metrics.num_accepted.inc(res.num_accepted)
                for pos in range(res.num_accepted):
                    self.metrics.accepted_per_pos.labels(position=str(pos)).inc()
            self.metrics.emitted_per_step.observe(len(res.tokens))
            if seq.finished:
                continue
            seq.target_cached = res.cached_len
            self._emit(seq, list(res.tokens), _logprobs(res))
        for c, res in zip(plan.chunks, results[len(plan.decodes):], strict=True):
            if c.seq.finished:
                continue
            c.seq.target_cached = res.cached_len
            if c.emit:
                self._emit(c.seq, list(res.tokens), _logprobs(res))

    def _record(self, plan: StepPlan, response: target_pb2.StepResponse, draft_ms: float, target_wall_ms: float,
                t_start: float) -> None:
        self.steps += 1
        tokens = plan.num_tokens
        self.cost.observe(tokens, target_wall_ms)  # wall time, RPC included: comparable with the draft's
        self.metrics.step_tokens.observe(tokens)
        total_ms = (time.perf_counter() - t_start) * 1000
        self.metrics.step_time.labels(part="target").observe(response.forward_ms / 1000)
        self.metrics.step_time.labels(part="draft").observe(draft_ms / 1000)
        self.metrics.step_time.labels(part="router").observe(max(0.0, total_ms - response.forward_ms - draft_ms) / 1000)
        if self.config.pipeline and self.draft.up:
            for seq, _ in plan.decodes:
                if seq.next_k > 0 and not seq.finished:
                    self.metrics.pipeline_lookups.inc()
                    if seq.proposal():
                        self.metrics.pipeline_hits.inc()

    def _reject(self, plan: StepPlan, err: Rejected) -> None:
        """The target refused the step: a capacity mismatch preempts, a bad entry fails its request."""
        log.error("target rejected a step: %s", err)
        if err.code.name == "RESOURCE_EXHAUSTED" and self.scheduler.running:
            victim = self.scheduler.running[-1]  # the service holds blocks the router did not count
            self.scheduler.preempt(victim)
            self.metrics.preemptions.inc()
            self._pending_release.append(victim.seq_id)
            return
        seqs = [s for s, _ in plan.decodes] + [c.seq for c in plan.chunks]
        marker = "entries["
        if marker in err.details:
            idx = int(err.details.split(marker, 1)[1].split("]", 1)[0])
            seqs = seqs[idx:idx + 1]
        for seq in seqs:
            self._fail(seq, FinishReason.ERROR, err)


def _logprobs(res: target_pb2.EntryResult) -> list[TokenLogprob] | None:
    if not res.logprobs:
        return None
    return [TokenLogprob(lp.token_id, lp.logprob, list(zip(lp.top_token_ids, lp.top_logprobs, strict=True)))
            for lp in res.logprobs]

