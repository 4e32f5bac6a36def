"""DraftService over gRPC: proto <-> Proposer, on engine/service.py's worker thread and error mapping."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from common.checked import CheckedOnce
from common.sampling import InvalidField
from common.tracing import Tracing
from draft_service.drafts import BranchSpec, DraftRequest, SparseQ
from draft_service.proposer import SPARSE_Q_MASS, SPARSE_TOP_N, Proposer
from engine.logits import Processors
from engine.rpc import call_deadline, check_deadline, rpc_errors, sampling_spec, still_wanted
from engine.runner import InvalidInput, ModelRunner, SeqInput
from engine.sampling import SamplingSpec
from engine.service import ModelWorker
from engine.streams import CallStreams, request_deadline
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc

SERVICE_NAME = "tandem.v1.DraftService"


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    rpc_service = SERVICE_NAME

    def __init__(self, runner: ModelRunner, model_id: str = "", max_draft_tokens: int = 8,
                 sparse_top_n: int = SPARSE_TOP_N, sparse_q_mass: float = SPARSE_Q_MASS,
                 tracing: Tracing | None = None, thread: ThreadPoolExecutor | None = None) -> None:
        self.worker = ModelWorker(runner, model_id, max_draft_tokens, thread)
        self.proposer = Proposer(runner, max_draft_tokens, sparse_top_n, sparse_q_mass, self.worker.eos_ids)
        self.worker.on_release.append(self.proposer.constraints.release)
        self.tracing = tracing  # spans for calls that carry a trace context (engine.rpc_trace)
        self.streams = CallStreams()  # the open ProposeStreams
        self._sampling = CheckedOnce(functools.partial(_check_sampling, vocab=runner.model_config.vocab_size))

    @rpc_errors
    async def GetInfo(self, request: common_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.ModelInfo:
        check_deadline(context)
        return await self.worker.run(self.worker.info)  # on the model thread: a stuck draft does not answer

    @rpc_errors
    async def Sync(self, request: draft_pb2.SyncRequest, context: grpc.aio.ServicerContext) -> draft_pb2.SyncResponse:
        self.worker.lease.check(context)
        return await self.worker.run(self._sync, request, call_deadline(context))

    @rpc_errors
    async def Propose(self, request: draft_pb2.ProposeRequest,
                      context: grpc.aio.ServicerContext) -> draft_pb2.ProposeResponse:
        self.worker.lease.check(context)
        return await self.worker.run(self._propose, request, call_deadline(context), tokens=_tokens(request))

    async def ProposeStream(self, requests: AsyncIterator[draft_pb2.ProposeRequest],
                            context: grpc.aio.ServicerContext) -> None:
        """Proposals over one long-lived stream (engine/streams.py)."""
        await self.streams.serve(requests, context, self._streamed_propose)

    @rpc_errors(name="ProposeStream")
    async def _streamed_propose(self, request: draft_pb2.ProposeRequest,
                                context: grpc.aio.ServicerContext) -> draft_pb2.ProposeResponse:
        self.worker.lease.check(context)
        return await self.worker.run(self._propose, request, request_deadline(request), tokens=_tokens(request))

    def close_streams(self) -> None:
        """Shutdown began: no proposal stream is kept open for a next call (serve()'s on_shutdown)."""
        self.streams.close()

    @rpc_errors
    async def Release(self, request: common_pb2.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.ReleaseResponse:
        check_deadline(context)
        self.worker.lease.check(context)
        free = await self.worker.run(self.worker.release, list(request.seq_ids))
        return common_pb2.ReleaseResponse(free_blocks=free)

    @rpc_errors
    async def Lease(self, request: common_pb2.LeaseRequest,
                    context: grpc.aio.ServicerContext) -> common_pb2.LeaseResponse:
        return await self.worker.lease_rpc(request)

    # ---- on the model thread -----------------------------------------------------------------
    def _sync(self, request: draft_pb2.SyncRequest, deadline: float | None) -> draft_pb2.SyncResponse:
        still_wanted(deadline)
        chunks = [SeqInput(c.seq_id, c.start_pos, list(c.tokens), num_logits=0, prefix=list(c.prefix_block_hashes),
                           salt=c.cache_salt) for c in request.chunks]
        cached = self.proposer.sync(chunks)
        return draft_pb2.SyncResponse(cached_len=cached, free_blocks=self.worker.runner.blocks.num_free)

    def _propose(self, request: draft_pb2.ProposeRequest, deadline: float | None) -> draft_pb2.ProposeResponse:
        still_wanted(deadline)
        stop_at = _stop_at(request)
        requests = []
        for n, e in enumerate(request.entries):
            spec, processors = self._sampling.get((e.sampling.SerializeToString(deterministic=True), e.prompt_len),
                                                  e, f"entries[{n}].sampling")
            requests.append(DraftRequest(e.seq_id, e.start_pos, list(e.tokens), e.k, spec, e.num_verifying,
                                         [BranchSpec(b.accepted, b.rank) for b in e.branches], processors, e.grammar,
                                         e.prompt_len, e.fork_of, list(e.prefix_block_hashes), e.cache_salt))
        out = self.proposer.propose(requests, stop_at)
        return draft_pb2.ProposeResponse(
            proposals=[
                draft_pb2.Proposal(
                    seq_id=r.seq_id, tokens=r.plain.drafts, probs=_dists(r.plain.probs), cached_len=r.cached_len,
                    confidence=r.plain.confidence,
                    branches=[draft_pb2.BranchProposal(accepted=b.accepted, token=b.token, drafts=b.drafts,
                                                       probs=_dists(b.probs), confidence=b.confidence)
                              for b in r.branches],
                )
                for r in out.results
            ],
            forward_ms=out.forward_ms, forwards=out.forwards,
        )


def _stop_at(request: draft_pb2.ProposeRequest) -> float | None:
    """The perf_counter() time stop_after_ms names (None: no time to stop by)."""
    ms = request.stop_after_ms
    if not (math.isfinite(ms) and ms >= 0.0):
        raise InvalidInput("stop_after_ms", f"{ms} is not a finite number of milliseconds >= 0")
    return time.perf_counter() + ms / 1000 if ms > 0 else None


def _tokens(request: draft_pb2.ProposeRequest) -> int:
    """A call's size in tokens computed: what each entry feeds, then its rounds over its branches."""
    return sum(len(e.tokens) + e.k * (1 + len(e.branches)) for e in request.entries)


def _check_sampling(e: draft_pb2.ProposeEntry, field: str, vocab: int) -> tuple[SamplingSpec, Processors | None]:
    """What e.sampling samples with (checked once per distinct message and prompt length)."""
    spec = sampling_spec(e.sampling, field)
    try:
        processors = Processors.from_proto(e.sampling, e.prompt_len, vocab)
    except InvalidField as err:
        raise InvalidInput(f"{field}.{err.field}", str(err).split(": ", 1)[-1]) from None
    return spec, processors


def _dists(qs: list[SparseQ]) -> list[common_pb2.SparseDist]:
    return [common_pb2.SparseDist(token_ids=q.token_ids, probs=q.probs) for q in qs]


def create_servicer(runner: ModelRunner, model_id: str = "", max_draft_tokens: int = 8,
                    sparse_top_n: int = SPARSE_TOP_N, sparse_q_mass: float = SPARSE_Q_MASS,
                    tracing: Tracing | None = None, thread: ThreadPoolExecutor | None = None) -> DraftServicer:
    """thread: the model thread the runner loaded on (engine.service.model_thread), if any."""
    return DraftServicer(runner, model_id, max_draft_tokens, sparse_top_n, sparse_q_mass, tracing, thread)


def register(server: grpc.aio.Server, servicer: DraftServicer) -> None:
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
