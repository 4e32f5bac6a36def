"""Per-request figures: where one request's time and speculation went. Counted for every request
(a few integer additions per step), reported only to requests that ask (`tandem_metrics`).

Each figure is counted at the same place as its aggregate counter in router.metrics, so over any
load the per-request figures add up to the counters' increase:

    num_spec_steps             tandem:spec_decode_num_drafts_total
    num_draft_tokens           tandem:spec_decode_num_draft_tokens_total
    num_accepted_draft_tokens  tandem:spec_decode_num_accepted_tokens_total
    num_accepted_tokens_per_pos[i]  tandem:spec_decode_num_accepted_tokens_per_pos_total{position="i"}
    num_decode_steps           tandem:spec_decode_emitted_tokens_per_step_count
    pipeline_lookups, _hits    tandem:pipeline_lookups_total, tandem:pipeline_hits_total
    pipeline_misses_late/wrong/unasked tandem:pipeline_misses_total{reason="late"|"wrong"|"unasked"}
    num_preemptions            tandem:num_preemptions_total
    queued_seconds             tandem:request_queue_time_seconds_sum

Names follow vLLM's per-request speculative decoding metrics (vllm#48915) where they overlap:
acceptance_histogram[j] counts the verifications that accepted exactly j draft tokens, and
mean_acceptance_length is the tokens a verification emitted on average (accepted + 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.request_trace import RequestTrace


@dataclass(eq=False)
class RequestStats:
    queued_since: float | None = field(default_factory=time.monotonic)  # None: not waiting now
    queued_seconds: float = 0.0
    num_prefill_chunks: int = 0
    num_decode_steps: int = 0
    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    acceptance_histogram: list[int] = field(default_factory=list)
    pipeline: dict[str, int] = field(default_factory=lambda: {"hit": 0, "late": 0, "wrong": 0, "unasked": 0})
    trace: RequestTrace | None = None  # its spans, when tracing is on (router.request_trace)

    # ---- the request's timeline ---------------------------------------------------------------
    def queued(self) -> None:
        """Back in the queue (preempted, moved to another replica): waiting again."""
        if self.queued_since is None:
            self.queued_since = time.monotonic()
            if self.trace is not None:
                self.trace.queued()

    def dispatched(self, now: float) -> None:
        if self.queued_since is not None:
            self.queued_seconds += now - self.queued_since
            self.queued_since = None
            if self.trace is not None:
                self.trace.dispatched()

    def verified(self, k: int, accepted: int) -> None:
        """One decode step: k drafts sent, `accepted` of them accepted."""
        self.num_decode_steps += 1
        if not k:
            return
        self.num_spec_steps += 1
        self.num_draft_tokens += k
        self.num_accepted_draft_tokens += accepted
        _add_upto(self.num_draft_tokens_per_pos, k)
        _add_upto(self.num_accepted_tokens_per_pos, accepted)
        if len(self.acceptance_histogram) <= accepted:
            self.acceptance_histogram.extend([0] * (accepted + 1 - len(self.acceptance_histogram)))
        self.acceptance_histogram[accepted] += 1

    def finished(self) -> float:
        """Close a wait still open (a request ended while queued); the total seconds queued."""
        self.dispatched(time.monotonic())
        return self.queued_seconds

    # ---- the report ---------------------------------------------------------------------------
    def report(self, num_preemptions: int) -> dict[str, Any]:
        """The figures as the client gets them (usage.tandem_metrics; tandem.v1.RequestMetrics)."""
        drafted, accepted, steps = self.num_draft_tokens, self.num_accepted_draft_tokens, self.num_spec_steps
        return {
            "queued_seconds": self.queued_seconds, "num_prefill_chunks": self.num_prefill_chunks,
            "num_preemptions": num_preemptions, "num_decode_steps": self.num_decode_steps,
            "num_spec_steps": steps, "num_draft_tokens": drafted, "num_accepted_draft_tokens": accepted,
            "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_acceptance_length": 1 + accepted / steps if steps else 0.0,
            "acceptance_histogram": list(self.acceptance_histogram),
            "num_draft_tokens_per_pos": list(self.num_draft_tokens_per_pos),
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "acceptance_rate_per_pos": [a / d for a, d in zip(self.num_accepted_tokens_per_pos,
                                                               self.num_draft_tokens_per_pos, strict=False)],
            "pipeline_lookups": sum(self.pipeline.values()), "pipeline_hits": self.pipeline["hit"],
            "pipeline_misses_late": self.pipeline["late"], "pipeline_misses_wrong": self.pipeline["wrong"],
            "pipeline_misses_unasked": self.pipeline["unasked"],
        }


def _add_upto(counts: list[int], n: int) -> None:
    """counts[i] += 1 for every i < n, growing the list as needed."""
    if len(counts) < n:
        counts.extend([0] * (n - len(counts)))
    for i in range(n):
        counts[i] += 1
