"""The step loop: schedule, send the target one mixed Step, hand the draft its work for the same
step in the background, apply what the target emitted. The target never waits for the draft.

    iteration t:   schedule (decodes use the prepared proposal that continues their history)
                   target.Step(decodes + chunks)   ||   draft.Propose(chunks mirrored; branches for the
                   apply emitted tokens                              likely outcomes of step t), if idle
    sequential mode (--no-pipeline): plain proposals are drafted first, awaited, then the target runs
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from router.clients import CacheMissError, Rejected, ServiceDown, TargetClient
from router.config import RouterConfig
from router.core import FinishReason, Sequence, TokenLogprob
from router.drafting import DraftLane, DraftWork
from router.metrics import Metrics
from router.scheduler import Scheduler, StepPlan
from router.spec_policy import BranchCost, DraftCost, StepCostModel, choose_k
from router.speculation import Candidate, best_proposal, plan_branches, prune
from tandem.v1 import common_pb2, target_pb2

log = logging.getLogger(__name__)
Proposal = tuple[list[int], list[common_pb2.SparseDist]]


class StepLoop:
    def __init__(self, config: RouterConfig, scheduler: Scheduler, target: TargetClient, draft: DraftLane,
                 metrics: Metrics, max_model_len: int,
                 emit: Callable[[Sequence, list[int], list[TokenLogprob] | None], None],
                 fail: Callable[[Sequence, FinishReason, Exception], None],
                 on_target_lost: Callable[[], None], wake: Callable[[], None] = lambda: None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        self.target = target
        self.draft = draft
        self.metrics = metrics
        self._emit = emit
        self._fail = fail
        self._on_target_lost = on_target_lost
        self.cost = StepCostModel()
        self.draft_cost = DraftCost(pipelined=config.pipeline)
        self.branch_cost = BranchCost()
        draft.on_done = wake
        draft.on_cost = self._observe_draft
        self.steps = 0
        self._pending_release: list[int] = []
        self._matched: dict[int, Proposal] = {}
        self._late: set[int] = set()  # decoders without a proposal: the draft had prepared nothing for them yet

    # ---- speculation policy ------------------------------------------------------------------
    def spec_cap(self, seq: Sequence) -> int:
        """Largest k this sequence may use now (0: plain decoding)."""
        if not self.draft.up or self.config.k_max == 0:
            return 0
        cap = min(self.config.k_max, self.draft.max_k)
        if seq.request.max_speculative_tokens is not None:
            cap = min(cap, seq.request.max_speculative_tokens)
        limit = min(self.max_model_len, self.draft.info.max_model_len if self.draft.info else 0)
        if len(seq.tokens) + 2 * cap + 2 > limit:
            return 0
        return max(cap, 0)

    def _proposal(self, seq: Sequence) -> Proposal:
        """Drafts prepared for this sequence's current history, with their q."""
        seq.prepared = prune(seq.prepared, seq.tokens)
        if seq.request.reproducible:  # only a plain proposal made at exactly this history: k never varies
            n = len(seq.tokens)
            plain = [p for p in seq.prepared if p.start == n and not p.prefix]
            return (list(plain[-1].drafts), list(plain[-1].probs)) if plain else ([], [])
        return best_proposal(seq.prepared, seq.tokens)

    def _choose_ks(self, decoders: list[Sequence], prefill_tokens: int) -> list[int]:
        caps = [self.spec_cap(s) for s in decoders]
        if self.config.dynamic_k:
            dyn = [i for i, s in enumerate(decoders) if not s.request.reproducible]
            chosen = choose_k([decoders[i].tracker.rate for i in dyn], [caps[i] for i in dyn], prefill_tokens,
                              self.cost, self.draft_cost)
            for i, k in zip(dyn, chosen, strict=True):
                caps[i] = k
        ks = []
        for seq, k in zip(decoders, caps, strict=True):
            seq.next_k = k
            prepared_for_it = any(p.start == seq.outcome_start for p in seq.prepared)
            drafts, probs = self._matched[seq.seq_id] = self._proposal(seq)
            if not drafts and not prepared_for_it:
                self._late.add(seq.seq_id)
            ks.append(min(k, len(drafts)))
        return ks

    def _decode_ready(self, seq: Sequence) -> bool:
        # Seeded sampling stays reproducible only if its k never depends on timing: it waits
        # for its proposal instead of running at k = 0 while the draft works.
        return not (seq.request.reproducible and self.spec_cap(seq) > 0 and not self._proposal(seq)[0])

    # ---- one iteration ---------------------------------------------------------------------------
    async def release_now(self, seq_ids: list[int]) -> None:
        try:
            await self.target.release(seq_ids)
        except (ServiceDown, Rejected) as err:
            log.warning("target release failed: %s", err)
        self.draft.release(seq_ids)
        await self.draft.flush_releases()

    async def iteration(self) -> bool:
        """Run one step; False when there was nothing to do."""
        t_start = time.perf_counter()
        if self._pending_release:
            ids, self._pending_release = self._pending_release, []
            await self.release_now(ids)
        draft_ms = 0.0 if self.config.pipeline else await self._sequential_proposals()
        self._matched.clear()
        self._late.clear()
        plan = self.scheduler.schedule(self._choose_ks, self._decode_ready)
        if plan.preempted:
            for seq in plan.preempted:
                self.metrics.preemptions.inc()
                log.info("preempted seq %d (%d tokens) for recompute", seq.seq_id, len(seq.tokens))
            await self.release_now([s.seq_id for s in plan.preempted])  # their blocks must be free for this step
        if plan.empty:
            return self._prepare_waiting() or draft_ms > 0
        entries, sent = self._entries(plan)
        if self.draft.up and self.draft.idle:
            self.draft.launch(self._draft_work(plan, sent))
        t_target = time.perf_counter()
        try:
            response = await self.target.step(entries)
        except CacheMissError as err:
            log.warning("target lost the cache of %s: recomputing them", err.seq_ids)
            for seq in self.scheduler.running:
                if seq.seq_id in err.seq_ids:
                    seq.target_cached = 0
            return True
        except ServiceDown as err:
            log.error("target step failed: %s", err)
            self._on_target_lost()
            return True
        except Rejected as err:
            self._reject(plan, err)
            return True
        target_wall_ms = (time.perf_counter() - t_target) * 1000
        self._apply(plan, sent, response)
        self._record(plan, response, draft_ms, target_wall_ms, t_start)
        return True

    def _entries(self, plan: StepPlan) -> tuple[list[target_pb2.StepEntry], list[list[int]]]:
        entries, sent = [], []
        for seq, k in plan.decodes:
            drafts, probs = self._matched.get(seq.seq_id, ([], []))
            drafts = drafts[:k]
            n = len(seq.tokens)
            assert seq.target_cached == n - 1, f"seq {seq.seq_id}: target holds {seq.target_cached}, history {n}"
            greedy = seq.request.sampling.greedy
            entries.append(target_pb2.StepEntry(
                seq_id=seq.seq_id, start_pos=n - 1, tokens=[seq.tokens[-1], *drafts], emit=True,
                num_draft_tokens=len(drafts), draft_probs=[] if greedy else probs[:len(drafts)],
                sampling=seq.request.sampling_proto, logprobs=self._lp(seq)))
            sent.append(drafts)
        for c in plan.chunks:
            entries.append(target_pb2.StepEntry(
                seq_id=c.seq.seq_id, start_pos=c.start, tokens=c.seq.tokens[c.start:c.end], emit=c.emit,
                sampling=c.seq.request.sampling_proto, logprobs=self._lp(c.seq)))
        return entries, sent

    @staticmethod
    def _lp(seq: Sequence) -> int:
        return -1 if seq.request.logprobs is None else seq.request.logprobs

    # ---- the draft's work ------------------------------------------------------------------------
    def _draft_work(self, plan: StepPlan, sent: list[list[int]]) -> DraftWork:
        """Mirror this step's prompt chunks and, pipelined, prepare branches for its likely outcomes."""
        work, budget = DraftWork(), self.draft.budget
        cands: list[tuple[Sequence, list[int], Candidate]] = []
        if self.config.pipeline:
            for (seq, _), drafts in zip(plan.decodes, sent, strict=True):
                if seq.next_k > 0 and not seq.request.reproducible:
                    cands.append((seq, seq.tokens + drafts, Candidate(seq.seq_id, len(drafts), seq.tracker.rate,
                                                                      seq.next_k)))
            for c in plan.chunks:
                cap = self.spec_cap(c.seq)
                if c.emit and cap > 0 and not c.seq.request.reproducible:
                    cands.append((c.seq, list(c.seq.tokens), Candidate(c.seq.seq_id, 0, c.seq.tracker.rate, cap)))
        budget_ms = self.cost.step_ms(plan.num_tokens)
        branches = plan_branches([c for _, _, c in cands], self.draft.stats, self._branch_budget(cands, budget_ms))
        planned = {seq.seq_id for seq, _, _ in cands}
        for c in plan.chunks:  # mirrored first: they are the draft's prefill
            if c.seq.seq_id not in planned:
                work.add(c.seq, c.seq.tokens[:c.end], 0, 0, c.seq.request.sampling_proto, [], budget)
        for seq, base, cand in cands:
            work.add(seq, base, cand.k, cand.v, seq.request.sampling_proto, branches[seq.seq_id], budget)
        self._add_plain(work, budget)
        return work

    def _add_plain(self, work: DraftWork, budget: int) -> None:
        """Plain proposals for seeded sequences waiting for theirs (they never take a guessed branch)."""
        for seq in self.scheduler.running:
            if not seq.prefilling and not self._decode_ready(seq) and seq not in work.seqs:
                work.add(seq, list(seq.tokens), self.spec_cap(seq), 0, seq.request.sampling_proto, [], budget)

    def _prepare_waiting(self) -> bool:
        """Nothing could run: start the draft on what the waiting sequences need."""
        if not (self.draft.up and self.draft.idle):
            return False
        work = DraftWork()
        self._add_plain(work, self.draft.budget)
        self.draft.launch(work)
        return bool(work.entries)

    def _branch_budget(self, cands: list, step_ms: float) -> int:
        """Branches the draft can prepare within about one target step (at least one per sequence)."""
        if not cands:
            return 0
        k = max(c.k for _, _, c in cands)
        by_time = max(len(cands), self.branch_cost.affordable(step_ms, rounds=1 + k, k=k))
        geometry = self.scheduler.draft
        if geometry is None:
            return by_time
        # forks live only during the call, in the draft blocks no sequence has reserved
        spare = geometry.num_blocks - self.scheduler.usage()[1]
        return min(by_time, spare // (1 + geometry.blocks(k)))

    def _observe_draft(self, work: DraftWork, ms: float) -> None:
        if work.rounds:
            self.draft_cost.observe(ms, work.rounds)
            self.branch_cost.observe(ms, work.rounds, work.branches * max(1, work.rounds - 1))

    async def _sequential_proposals(self) -> float:
        """Without pipelining, decoders lacking a proposal get a plain one first (on the critical path)."""
        if not self.draft.up:
            return 0.0
        t0 = time.perf_counter()
        await self.draft.wait()  # the previous step's prompt mirroring
        running = [s for s in self.scheduler.running if not s.prefilling]
        lacking = [s for s in running if self.spec_cap(s) > 0 and not self._proposal(s)[0]]
        if lacking:
            self._choose_ks(running, 0)  # sizes the proposals; a sequence held at k = 0 needs none
            work = DraftWork()
            for seq in lacking:
                if seq.next_k > 0:
                    work.add(seq, list(seq.tokens), seq.next_k, 0, seq.request.sampling_proto, [], self.draft.budget)
            await self.draft.run(work)
        return (time.perf_counter() - t0) * 1000

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
            self._observe_outcome(seq, k, res.num_accepted, res.tokens[-1])
            seq.target_cached = res.cached_len
            self._emit(seq, list(res.tokens), _logprobs(res))
        for c, res in zip(plan.chunks, results[len(plan.decodes):], strict=True):
            if c.seq.finished:
                continue
            c.seq.target_cached = res.cached_len
            if c.emit:
                self._observe_outcome(c.seq, 0, 0, res.tokens[-1])
                self._emit(c.seq, list(res.tokens), _logprobs(res))

    def _observe_outcome(self, seq: Sequence, v: int, accepted: int, token: int) -> None:
        """Which prepared branch (if any) this verification's outcome matched: the rank statistics."""
        n = seq.outcome_start = len(seq.tokens)
        ranks = {p.rank: p.prefix[-1] for p in seq.prepared if p.start == n and p.rank and p.accepted == accepted}
        if ranks:
            hit = next((r for r, t in ranks.items() if t == token), None)
            self.draft.stats.observe(accepted == v, list(ranks), hit)

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
        if self.draft.up:
            for seq, _ in plan.decodes:
                if seq.next_k > 0:
                    self.metrics.pipeline_lookups.inc()
                    if self._matched.get(seq.seq_id, ([], []))[0]:
                        self.metrics.pipeline_hits.inc()
                    else:
                        self.metrics.pipeline_misses.labels(reason="late" if seq.seq_id in self._late
                                                            else "wrong").inc()

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
