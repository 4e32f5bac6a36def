"""What a target step's answer does to the books: each sequence's emitted tokens, its acceptance
trackers and the pools new sequences start from, the spec-decode metrics, and where each decoder's
proposal came from (prompt lookup, or the pipeline: hit, late or wrong)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from router.core import TokenLogprob
from router.metrics import Metrics
from router.scheduler import StepPlan
from router.sequence import Sequence
from router.speculator import Speculator
from router.step_entries import logprobs_of, prompt_logprobs_of
from tandem.v1 import target_pb2


class StepResults:
    def __init__(self, spec: Speculator, metrics: Metrics,
                 emit: Callable[[Sequence, list[int], list[TokenLogprob] | None], None]) -> None:
        self.spec = spec
        self.metrics = metrics
        self._emit = emit
        self._accepted_at = functools.cache(lambda pos: metrics.accepted_per_pos.labels(position=str(pos)))

    def apply(self, plan: StepPlan, sent: list[list[int]], response: target_pb2.StepResponse) -> None:
        """Results come in the step's entry order: decodes, prompt chunks, then forked siblings."""
        results = list(response.results)
        siblings = plan.siblings
        assert len(results) == len(plan.decodes) + len(plan.chunks) + len(siblings)
        chunk_results = results[len(plan.decodes):len(results) - len(siblings)]
        for c, res in zip(plan.chunks, chunk_results, strict=True):  # first: siblings echo their parent's
            if res.prompt_logprobs and c.seq.output is not None:
                c.seq.output.scored(c.start + 1, prompt_logprobs_of(res))  # position i scores token i + 1
        for seq, res in zip(siblings, results[len(results) - len(siblings):], strict=True):
            self.metrics.forked_sequences.inc()
            if seq.finished:
                continue
            seq.target_cached = res.cached_len
            if seq.request.prompt_logprobs is not None and seq.fork_parent is not None:
                seq.output.scored(1, seq.fork_parent.output.scored_prompt())
            self.spec.observe_outcome(seq, 0, 0, res.tokens[-1])
            self._emit(seq, list(res.tokens), logprobs_of(res))
        for (seq, _), drafts, res in zip(plan.decodes, sent, results, strict=False):
            self._verified(seq, drafts, res)
        for c, res in zip(plan.chunks, chunk_results, strict=True):
            if c.seq.finished:
                continue
            c.seq.target_cached = res.cached_len
            if c.emit:
                self.spec.observe_outcome(c.seq, 0, 0, res.tokens[-1])
                self._emit(c.seq, list(res.tokens), logprobs_of(res))

    def _verified(self, seq: Sequence, drafts: list[int], res: target_pb2.StepResult) -> None:
        k, by_lookup = len(drafts), seq.seq_id in self.spec.from_lookup
        self.spec.observe_verified(seq, drafts, res.num_accepted)
        (seq.lookup_tracker if by_lookup else seq.tracker).update(k, res.num_accepted)
        (self.spec.lookup_acceptance if by_lookup else self.spec.draft_acceptance).observe(k, res.num_accepted)
        if seq.seq_id in self.spec.lookup_passed:
            self.spec.lookup_acceptance.passed(seq.lookup_tracker)
        seq.stats.verified(k, res.num_accepted)
        if by_lookup and k and seq.lookup.from_prediction:
            seq.output.predicted(k, res.num_accepted)
            self.metrics.prediction_tokens.labels(outcome="accepted").inc(res.num_accepted)
            self.metrics.prediction_tokens.labels(outcome="rejected").inc(k - res.num_accepted)
        if k:
            self.metrics.num_drafts.inc()
            self.metrics.num_draft_tokens.inc(k)
            self.metrics.num_accepted.inc(res.num_accepted)
            for pos in range(res.num_accepted):
                self._accepted_at(pos).inc()
        self.metrics.emitted_per_step.observe(len(res.tokens))
        if seq.finished:
            return
        self.spec.observe_outcome(seq, k, res.num_accepted, res.tokens[-1])
        seq.target_cached = res.cached_len
        self._emit(seq, list(res.tokens), logprobs_of(res))

    def count_outcomes(self, plan: StepPlan, draft_up: bool) -> None:
        """Where this step's proposals came from: lookup, or the pipeline (hit, late or wrong)."""
        if self.spec.from_lookup:
            self.metrics.lookup_proposals.inc(len(self.spec.from_lookup))
        if not draft_up:
            return
        for seq, _ in plan.decodes:
            outcome = self.spec.pipeline_outcome(seq)
            if outcome is None:
                continue
            self.metrics.pipeline_lookups.inc()
            if outcome in ("hit", "wrong"):  # whether prepared branches name the outcome
                self.spec.match_odds.observe(outcome == "hit")
            if outcome == "hit":
                self.metrics.pipeline_hits.inc()
            else:
                self.metrics.pipeline_misses.labels(reason=outcome).inc()
            seq.stats.pipeline[outcome] += 1
