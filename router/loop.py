"""The step loop: schedule, send the target one mixed Step, hand the draft its work for the same
step in the background, apply what the target emitted. The target never waits for the draft, except
for a call due within what its proposals are worth (Speculator.grace_ms), once per call.

    iteration t:   schedule (decodes use the prepared proposal that continues their history)
                   target.Step(decodes + chunks)   ||   draft.Propose(chunks mirrored; branches for the
                   apply emitted tokens                              likely outcomes of step t), if idle
    sequential mode (--no-pipeline): plain proposals are drafted first, awaited, then the target runs
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext

from router.clients import CacheMissError, NotOwner, Rejected, ServiceDown, ServiceError, TargetClient
from router.config import RouterConfig
from router.core import FinishReason, InternalError, SeqStatus, Sequence, TokenLogprob
from router.drafting import DraftLane
from router.metrics import Metrics
from router.request_stats import about, dispatched
from router.scheduler import Scheduler, StepPlan
from router.speculator import Speculator
from tandem.v1 import target_pb2

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
        self._emit = emit
        self._fail = fail
        self._on_target_lost = on_target_lost
        draft.on_done = wake
        self.steps = 0
        self._pending_release: list[int] = []
        self._suspects: list[Sequence] = []  # the sequences of a step the target failed, each retried alone
        self._parts = {part: metrics.step_time.labels(part=part) for part in ("target", "draft", "router")}
        self._busy = metrics.target_busy.labels(replica=target.address)
        self.tracer = config.tracer

    # ---- one iteration ---------------------------------------------------------------------------
    async def release_now(self, seq_ids: list[int]) -> None:
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
        draft_ms = await self._grace() if self.config.pipeline else await self.spec.sequential_proposals()
        self.spec.new_step()
        only = self._next_suspect()
        plan = self.scheduler.schedule(self.spec.choose_ks, self.spec.decode_ready, only)
        if plan.preempted:
            for seq in plan.preempted:
                self.metrics.preemptions.inc()
                log.info("preempted seq %d (%d tokens) for recompute", seq.seq_id, len(seq.tokens), extra=about(seq))
            await self.release_now([s.seq_id for s in plan.preempted])  # their blocks must be free for this step
        if plan.empty and only is not None:
            self._suspects.remove(only)  # it cannot run now (preempted, waiting): it is no longer a suspect
            return True
        if plan.empty:
            self.target.idle()
            self.draft.rest()
            if self.draft.up and self.draft.idle:
                work = self.spec.waiting_work()
                self.draft.launch(lambda: work, self.tracer.step(None, self.steps) if self.tracer is not None else None)
                return bool(work.entries) or draft_ms > 0
            return draft_ms > 0
        entries, sent = self._entries(plan)
        dispatched(plan)
        trace = self.tracer.step(plan, self.steps) if self.tracer is not None else None
        if self.draft.up and self.draft.idle and not self.spec.rests_draft(plan, self.steps):
            self.draft.launch(lambda: self.spec.step_work(plan, sent), trace)  # planned while the Step is sent
        t_target = time.perf_counter()
        try:
            with trace.target_call(plan) if trace is not None else nullcontext(None) as metadata:
                response = await self.target.step(entries, metadata)
        except CacheMissError as err:
            log.warning("target lost the cache of %s: recomputing them", err.seq_ids, extra={"seq_ids": err.seq_ids})
            for seq in self.scheduler.running:
                if seq.seq_id in err.seq_ids:
                    seq.target_cached = 0
            return True
        except (ServiceDown, NotOwner) as err:
            log.error("target step failed: %s", err)
            self._on_target_lost()
            return True
        except ServiceError as err:
            self._service_error(plan, only, err)
            return True
        except Rejected as err:
            self._reject(plan, err)
            return True
        if only is not None:
            self._suspects.remove(only)  # it ran alone without fault: another sequence caused it
        target_wall_ms = (time.perf_counter() - t_target) * 1000
        draft_busy = self.draft.busy_since(t_target)  # worked alongside this step: the target may run slower
        self._apply(plan, sent, response)
        self._record(plan, response, draft_ms, target_wall_ms, t_start, draft_busy)
        if trace is not None:
            trace.end(plan, sent, response, self.spec, self.draft.up)
        return True

    async def _grace(self) -> float:
        """Wait briefly for a draft call about to land with proposals this step needs (Speculator.grace_ms)."""
        grace_ms = self.spec.grace_ms()
        if grace_ms <= 0:
            return 0.0
        t0 = time.perf_counter()
        self.draft.waited_for = True
        await self.draft.wait(grace_ms / 1000)
        self.spec.wait_odds.observe(self.draft.idle)
        self.metrics.pipeline_waits.labels(outcome="arrived" if self.draft.idle else "timed_out").inc()
        return (time.perf_counter() - t0) * 1000

    def _entries(self, plan: StepPlan) -> tuple[list[target_pb2.StepEntry], list[list[int]]]:
        """The Step's entries: decodes, prompt chunks, then the siblings (n > 1) forked from a prompt it finishes."""
        entries, sent = [], []
        siblings = plan.siblings
        for seq, k in plan.decodes:
            drafts, probs = self.spec.matched.get(seq.seq_id, ([], []))
            drafts = drafts[:k]
            masks: list[bytes] = []
            if seq.grammar is not None:
                drafts, masks = seq.grammar.masks(drafts)
            n = len(seq.tokens)
            assert seq.target_cached == n - 1, f"seq {seq.seq_id}: target holds {seq.target_cached}, history {n}"
            greedy = seq.request.sampling.greedy
            entries.append(target_pb2.StepEntry(
                seq_id=seq.seq_id, start_pos=n - 1, tokens=[seq.tokens[-1], *drafts], emit=True,
                num_draft_tokens=len(drafts), draft_probs=[] if greedy else probs[:len(drafts)],
                sampling=seq.request.sampling_proto, logprobs=self._lp(seq), token_masks=masks,
                prompt_len=seq.num_prompt))
            sent.append(drafts)
        for c in plan.chunks:
            entries.append(target_pb2.StepEntry(
                seq_id=c.seq.seq_id, start_pos=c.start, tokens=c.seq.tokens[c.start:c.end], emit=c.emit,
                sampling=c.seq.request.sampling_proto, logprobs=self._lp(c.seq), prompt_len=c.seq.num_prompt,
                prefix_block_hashes=c.attach,
                token_masks=c.seq.grammar.masks([])[1] if c.emit and c.seq.grammar is not None else []))
            self.metrics.prompt_tokens_computed.inc(c.end - c.start)
            if c.emit:
                siblings.extend(s for s in c.seq.forks if s.waits_for_fork and s.status is SeqStatus.RUNNING)
        for s in siblings:  # the prompt is computed once: each sibling forks it and samples its own first token
            entries.append(target_pb2.StepEntry(
                seq_id=s.seq_id, start_pos=s.num_prompt, emit=True, fork_of=s.fork_parent.seq_id,  # type: ignore[union-attr]
                sampling=s.request.sampling_proto, logprobs=self._lp(s), prompt_len=s.num_prompt,
                token_masks=s.grammar.masks([])[1] if s.grammar is not None else []))
        self.metrics.grammar_mask_bytes.inc(sum(len(m) for e in entries for m in e.token_masks))
        return entries, sent

    @staticmethod
    def _lp(seq: Sequence) -> int:
        return -1 if seq.request.logprobs is None else seq.request.logprobs

    # ---- results -------------------------------------------------------------------------------
    def _apply(self, plan: StepPlan, sent: list[list[int]], response: target_pb2.StepResponse) -> None:
        results = list(response.results)
        siblings = plan.siblings
        assert len(results) == len(plan.decodes) + len(plan.chunks) + len(siblings)
        for seq, res in zip(siblings, results[len(results) - len(siblings):], strict=True):
            self.metrics.forked_sequences.inc()
            if seq.finished:
                continue
            seq.target_cached = res.cached_len
            self.spec.observe_outcome(seq, 0, 0, res.tokens[-1])
            self._emit(seq, list(res.tokens), _logprobs(res))
        for (seq, _), drafts, res in zip(plan.decodes, sent, results, strict=False):
            k = len(drafts)
            tracker = seq.lookup_tracker if seq.seq_id in self.spec.from_lookup else seq.tracker
            tracker.update(k, res.num_accepted)
            seq.stats.verified(k, res.num_accepted)
            if k:
                self.metrics.num_drafts.inc()
                self.metrics.num_draft_tokens.inc(k)
                self.metrics.num_accepted.inc(res.num_accepted)
                for pos in range(res.num_accepted):
                    self.metrics.accepted_per_pos.labels(position=str(pos)).inc()
            self.metrics.emitted_per_step.observe(len(res.tokens))
            if seq.finished:
                continue
            self.spec.observe_outcome(seq, k, res.num_accepted, res.tokens[-1])
            seq.target_cached = res.cached_len
            self._emit(seq, list(res.tokens), _logprobs(res))
        for c, res in zip(plan.chunks, results[len(plan.decodes):len(results) - len(siblings)], strict=True):
            if c.seq.finished:
                continue
            c.seq.target_cached = res.cached_len
            if c.emit:
                self.spec.observe_outcome(c.seq, 0, 0, res.tokens[-1])
                self._emit(c.seq, list(res.tokens), _logprobs(res))

    def _record(self, plan: StepPlan, response: target_pb2.StepResponse, draft_ms: float, target_wall_ms: float,
                t_start: float, draft_busy: bool) -> None:
        self.steps += 1
        tokens = plan.num_tokens
        self.spec.observe_step(plan, target_wall_ms, draft_busy)  # wall time, RPC included: like the draft's
        self.metrics.step_tokens.observe(tokens)
        total_ms = (time.perf_counter() - t_start) * 1000
        self._parts["target"].observe(response.forward_ms / 1000)
        self._busy.inc(response.forward_ms / 1000)
        self._parts["draft"].observe(draft_ms / 1000)
        self._parts["router"].observe(max(0.0, total_ms - response.forward_ms - draft_ms) / 1000)
        if self.spec.from_lookup:
            self.metrics.lookup_proposals.inc(len(self.spec.from_lookup))
        if self.draft.up:
            for seq, _ in plan.decodes:
                outcome = self.spec.pipeline_outcome(seq)
                if outcome is None:
                    continue
                self.metrics.pipeline_lookups.inc()
                if outcome != "late":
                    self.spec.match_odds.observe(outcome == "hit")
                if outcome == "hit":
                    self.metrics.pipeline_hits.inc()
                else:
                    self.metrics.pipeline_misses.labels(reason=outcome).inc()
                seq.stats.pipeline[outcome] += 1

    def _next_suspect(self) -> Sequence | None:
        while self._suspects and (self._suspects[0].finished or self._suspects[0] not in self.scheduler.running):
            self._suspects.pop(0)
        return self._suspects[0] if self._suspects else None

    def _service_error(self, plan: StepPlan, only: Sequence | None, err: ServiceError) -> None:
        """The target failed a step it could read. Resending it as is may fail forever, so each of its
        sequences is retried alone: one that fails alone is the cause and gets an error, the rest go on.
        Every sequence is retried at most once per failure; the target is still up."""
        self.metrics.target_errors.inc()
        if only is not None:
            log.error("target failed seq %d on its own (%s): failing that request", only.seq_id, err)
            self._suspects.remove(only)
            self._fail(only, FinishReason.ERROR, InternalError(f"the target failed this request: {err}"))
            return
        seqs = plan.sequences
        log.warning("target failed a step (%s): retrying its %d sequences one at a time", err, len(seqs))
        self._suspects.extend(s for s in seqs if s not in self._suspects)

    def _reject(self, plan: StepPlan, err: Rejected) -> None:
        """The target refused the step: a capacity mismatch preempts, a bad entry fails its request."""
        log.error("target rejected a step: %s", err)
        if err.code.name == "RESOURCE_EXHAUSTED" and self.scheduler.running:
            victim = self.scheduler.running[-1]  # the service holds blocks the router did not count
            self.scheduler.preempt(victim)
            self.metrics.preemptions.inc()
            self._pending_release.append(victim.seq_id)
            return
        seqs = plan.sequences
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
