"""The router's spans (on only with --otlp-traces-endpoint; otherwise nothing here runs).

One trace per request:

    POST /v1/completions (FastAPI, HTTP door) or the caller's span (traceparent in gRPC metadata)
    └ tandem.request                     finish reason, usage, the request's figures (request_stats)
      ├ queue                            until its first step (again after a preemption)
      ├ prefill_chunk                    one per step carrying a chunk of its prompt
      │ └ tandem.v1.TargetService/Step   CLIENT; the target's SERVER span and its forward below it
      │ └ tandem.v1.DraftService/Propose CLIENT; the draft's spans below it
      └ decode                           one per verification: k, accepted, emitted, pipeline hit/late/wrong

A target Step (and a draft Propose) serves many requests at once. Its CLIENT span is the child
of one of them (the first in the batch: the oldest decode, else the first chunk) and carries a
span link to every other request's step span; each of those links back to it. So from any
request's trace the shared call is one click away, and a request alone in the batch has
router -> target and router -> draft as plain parent/child.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from common.tracing import Metadata, Tracing, inject

if TYPE_CHECKING:
    from router.scheduler import StepPlan
    from router.sequence import Sequence
    from tandem.v1 import target_pb2

TARGET_STEP = "tandem.v1.TargetService/Step"
DRAFT_PROPOSE = "tandem.v1.DraftService/Propose"


def step_trace(tracing: Tracing | None, plan: StepPlan | None, number: int) -> StepTrace | None:
    """plan None: draft calls made outside a step (sequential proposals, a draft catching up while
    nothing else runs), parented by their requests' spans. None when tracing is off."""
    return StepTrace(tracing.tracer, plan, number) if tracing is not None else None


class StepTrace:
    """This step's span in each request's trace, and the batched calls made for it (the request's
    own span: router.request_trace)."""

    def __init__(self, tracer: trace.Tracer, plan: StepPlan | None, number: int) -> None:
        self.tracer = tracer
        self.spans: dict[int, trace.Span] = {}
        self.batch = {"tandem.step": number}  # the batch's figures go on its calls' spans, once
        if plan is None:
            return
        self.batch.update({"tandem.batch.sequences": len(plan.decodes) + len(plan.chunks),
                           "tandem.batch.tokens": plan.num_tokens})
        for seq, _ in plan.decodes:
            self._open(seq, "decode", None)
        for c in plan.chunks:
            self._open(c.seq, "prefill_chunk", {"tandem.chunk.start": c.start, "tandem.chunk.end": c.end,
                                                "tandem.chunk.last": c.emit})

    def _open(self, seq: Sequence, name: str, attributes: dict | None) -> None:
        request = seq.stats.trace
        if request is not None and request.span.is_recording():  # an unsampled request costs nothing per step
            self.spans[seq.seq_id] = self.tracer.start_span(name, context=request.context, attributes=attributes)

    # ---- the batched calls ---------------------------------------------------------------------
    @contextmanager
    def call(self, method: str, seqs: list[Sequence]) -> Iterator[Metadata]:
        """A CLIENT span for one call serving seqs: the child of the first one's step span, linked
        both ways with the others'. Yields the gRPC metadata that carries it to the service."""
        spans = [s for s in (self._span_of(seq) for seq in seqs) if s is not None]
        if not spans:  # no sampled request in the call: the services trace nothing either
            yield ()
            return
        service, rpc_method = method.rsplit("/", 1)
        span = self.tracer.start_span(
            method, context=trace.set_span_in_context(spans[0]), kind=SpanKind.CLIENT,
            links=[Link(s.get_span_context()) for s in spans[1:]],
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc_method, **self.batch,
                        "tandem.call.sequences": len(seqs)})
        for other in spans[1:]:
            other.add_link(span.get_span_context())
        try:
            yield inject(span)
        except BaseException as err:
            span.record_exception(err)
            span.set_status(Status(StatusCode.ERROR, f"{type(err).__name__}: {err}"))
            raise
        finally:
            span.end()

    def _span_of(self, seq: Sequence) -> trace.Span | None:
        """Its step span in this step, else (a sequence the step does not carry, a step that already
        failed) its request span; None when neither is recording (unsampled, or ended)."""
        request = seq.stats.trace
        for span in (self.spans.get(seq.seq_id), request.span if request is not None else None):
            if span is not None and span.is_recording():
                return span
        return None

    @contextmanager
    def target_call(self, plan: StepPlan) -> Iterator[Metadata]:
        """The Step; if it fails, this step's spans end with its error."""
        try:
            with self.call(TARGET_STEP, [s for s, _ in plan.decodes] + [c.seq for c in plan.chunks]) as metadata:
                yield metadata
        except BaseException as err:
            for span in self.spans.values():
                span.set_status(Status(StatusCode.ERROR, f"target step failed: {type(err).__name__}"))
                span.end()
            raise

    def draft_call(self, seqs: list[Sequence]) -> AbstractContextManager[Metadata]:
        """The Propose planned with this step (it may outlive the step: it prepares the next one)."""
        return self.call(DRAFT_PROPOSE, seqs)

    # ---- the outcome -----------------------------------------------------------------------------
    def end(self, plan: StepPlan, sent: list[list[int]], response: target_pb2.StepResponse,
            pipeline_outcome: Callable[[Sequence], str | None] | None) -> None:
        """pipeline_outcome: what the pipeline had prepared for a sequence (hit, late, ...); None: no draft."""
        results = list(response.results)
        for (seq, _), drafts, res in zip(plan.decodes, sent, results, strict=False):
            span = self.spans.get(seq.seq_id)
            if span is not None:
                outcome = pipeline_outcome(seq) if pipeline_outcome is not None else None
                span.set_attributes({"tandem.k": len(drafts), "tandem.accepted": res.num_accepted,
                                     "tandem.emitted": len(res.tokens), "tandem.pipeline": outcome or "none",
                                     "tandem.target.forward_ms": response.forward_ms})
                span.end()
        for c in plan.chunks:
            span = self.spans.get(c.seq.seq_id)
            if span is not None:
                span.set_attribute("tandem.target.forward_ms", response.forward_ms)
                span.end()
