"""TargetService: one forward pass over a mixed batch of prompt chunks and draft verifications,
then sampling and the acceptance rule next to the logits (semantics in proto/tandem/v1/target.proto).

A Step is validated completely before the forward, so an invalid request changes no cache.
All model work (validation against cache state included) runs on the ModelWorker's one thread.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import grpc
import torch

from common.protocol import MAX_LOGPROBS
from common.sampling import InvalidField
from common.tracing import Tracing
from engine.logits import Context, Processors, TokenHistory
from engine.runner import CacheMiss, InvalidInput, ModelRunner, SeqInput
from engine.sampling import logprobs_of
from engine.service import ModelWorker, call_deadline, rpc_errors, sampling_spec, still_wanted
from engine.streams import CallStreams, request_deadline
from engine.transfer import to_lists
from tandem.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.acceptance import (
    DEFAULT_TYPICAL_DELTA,
    DEFAULT_TYPICAL_EPSILON,
    Rule,
    SparseDist,
    Verification,
    accept,
)
from target_service.chaining import Chain, remember, resolve_chained

SERVICE_NAME = "tandem.v1.TargetService"
_SUM_TOLERANCE = 1e-4  # a sparse q may sum to 1 + float32 rounding


@dataclass(frozen=True)
class _Entry:
    seq: SeqInput
    emit: bool
    k: int
    verification: Verification | None  # None when emit is false
    logprobs: int  # -1: none
    processors: Processors | None = None
    masks: tuple[bytes, ...] = ()
    fork_of: int = 0

    @property
    def sibling(self) -> bool:
        """n choices: a fork sampled from its parent's last logits in this step (no tokens of its own)."""
        return not self.seq.tokens

    @property
    def needs_history(self) -> bool:
        return self.processors is not None and self.processors.penalized


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    rpc_service = SERVICE_NAME

    def __init__(self, worker: ModelWorker, tracing: Tracing | None = None, fail_on_token: int = -1) -> None:
        self.worker = worker
        self.fail_on_token = fail_on_token  # fault injection for tests: a Step starting a sequence with it fails
        self.runner: ModelRunner = worker.runner
        self.tracing = tracing  # spans for calls that carry a trace context (engine.rpc_trace)
        self.history = TokenHistory()  # token ids of sequences with penalties (engine/logits.py)
        self.streams = CallStreams()  # the open StepStreams
        self._chains: dict[int, Chain] = {}  # per open StepStream: what its last step emitted (chained steps)
        worker.on_release.append(self.history.release)

    # ---- RPCs -----------------------------------------------------------------------------
    @rpc_errors
    async def GetInfo(self, request: common_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.ModelInfo:
        return self.worker.info()

    @rpc_errors
    async def Step(self, request: target_pb2.StepRequest, context: grpc.aio.ServicerContext) -> target_pb2.StepResponse:
        self.worker.lease.check(context)
        return await self.worker.run(self.step, request, call_deadline(context), tokens=_tokens(request))

    async def StepStream(self, requests: AsyncIterator[target_pb2.StepRequest],
                         context: grpc.aio.ServicerContext) -> None:
        """Steps over one long-lived stream (engine/streams.py); a step may chain to the one before it."""
        self._chains[id(context)] = {}
        try:
            await self.streams.serve(requests, context, self._streamed_step)
        finally:
            del self._chains[id(context)]

    @rpc_errors(name="StepStream")
    async def _streamed_step(self, request: target_pb2.StepRequest,
                             context: grpc.aio.ServicerContext) -> target_pb2.StepResponse:
        self.worker.lease.check(context)
        return await self.worker.run(self.step, request, request_deadline(request), self._chains[id(context)],
                                     tokens=_tokens(request))

    def close_streams(self) -> None:
        """Shutdown began: no step stream is kept open for a next step (serve()'s on_shutdown)."""
        self.streams.close()

    @rpc_errors
    async def Release(self, request: common_pb2.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.ReleaseResponse:
        self.worker.lease.check(context)
        free = await self.worker.run(self.worker.release, list(request.seq_ids))
        return common_pb2.ReleaseResponse(free_blocks=free)

    @rpc_errors
    async def Lease(self, request: common_pb2.LeaseRequest,
                    context: grpc.aio.ServicerContext) -> common_pb2.LeaseResponse:
        return await self.worker.lease_rpc(request)

    # ---- the step (model thread) ----------------------------------------------------------
    @torch.inference_mode()
    def step(self, request: target_pb2.StepRequest, deadline: float | None = None,
             chain: Chain | None = None) -> target_pb2.StepResponse:
        """chain: the stream's record of its last step (None for a unary Step, which cannot chain)."""
        chosen = resolve_chained(request, chain)
        entries = self.parse(request)
        if self.fail_on_token >= 0 and any(e.seq.start_pos == 0 and e.seq.tokens[0] == self.fail_on_token
                                           for e in entries):
            raise RuntimeError(f"injected fault: a sequence starts with token {self.fail_on_token}")
        still_wanted(deadline)
        t0 = time.perf_counter()
        runner = self.runner
        siblings = self._check_siblings(entries)
        self._mirror(entries)
        computed = [n for n, e in enumerate(entries) if not e.sibling]
        out = runner.forward([entries[n].seq for n in computed])  # validates capacity and cache state first
        logits: list[torch.Tensor] = [torch.empty(0)] * len(entries)
        for n, rows in zip(computed, out, strict=True):
            logits[n] = rows
        for n, parent in siblings.items():  # the parent's prompt is cached now: fork it, share its last logits
            e = entries[n]
            runner.release([e.seq.seq_id])
            runner.fork(e.fork_of, e.seq.seq_id, e.seq.start_pos)
            self.history.fork(e.fork_of, e.seq.seq_id, e.seq.start_pos)
            logits[n] = logits[parent][-1:]
        emitting = [n for n, e in enumerate(entries) if e.emit]
        outcomes = accept([logits[n] for n in emitting], [self._judged(entries[n]) for n in emitting])
        results = [target_pb2.EntryResult(seq_id=e.seq.seq_id) for e in entries]
        for n, out in zip(emitting, outcomes, strict=True):
            e = entries[n]
            runner.trim(e.seq.seq_id, e.seq.start_pos + len(e.seq.tokens) - e.k + out.num_accepted)
            results[n].tokens.extend(out.tokens)
            results[n].num_accepted = out.num_accepted
        self._add_logprobs(entries, logits, emitting, [o.tokens for o in outcomes], results)
        for e, r in zip(entries, results, strict=True):
            r.cached_len = runner.cached_len(e.seq.seq_id)
            runner.commit(e.seq.seq_id, r.cached_len)  # rejected drafts are trimmed: the rest is history
        for n, alternative in chosen.items():
            results[n].alternative = alternative
        if chain is not None:
            remember(chain, entries, results)
        return target_pb2.StepResponse(results=results, forward_ms=(time.perf_counter() - t0) * 1e3,
                                       free_blocks=runner.blocks.num_free)

    def _check_siblings(self, entries: list[_Entry]) -> dict[int, int]:
        """Sibling entry -> its parent's entry, all checked (capacity of the forks included) before anything changes."""
        if not any(e.sibling for e in entries):
            return {}
        index = {e.seq.seq_id: n for n, e in enumerate(entries) if not e.sibling}
        siblings: dict[int, int] = {}
        for n, e in enumerate(entries):
            if not e.sibling:
                continue
            parent = index.get(e.fork_of)
            if parent is None or not entries[parent].emit or entries[parent].k or \
                    entries[parent].seq.start_pos + len(entries[parent].seq.tokens) != e.seq.start_pos:
                raise InvalidInput(f"entries[{n}].fork_of", f"sequence {e.fork_of} must be in this step, emitting its "
                                                            f"first token after position {e.seq.start_pos}")
            siblings[n] = parent
        resize = {e.seq.seq_id: (e.seq.start_pos, e.seq.start_pos + len(e.seq.tokens))
                  for e in entries if not e.sibling}
        partial = sum(1 for n in siblings if entries[n].seq.start_pos % self.runner.blocks.block_size)
        self.runner.blocks.check_capacity(resize, extra=partial)
        return siblings

    def _mirror(self, entries: list[_Entry]) -> None:
        """Keep the token history of sequences with penalties (a gap means the service lost it: recompute)."""
        missing = [e.seq.seq_id for e in entries if e.needs_history and not e.sibling
                   and not self.history.covers(e.seq.seq_id, e.seq.start_pos)]
        if missing:
            raise CacheMiss(missing)
        for e in entries:
            if e.needs_history and not e.sibling:
                self.history.put(e.seq.seq_id, e.seq.start_pos, e.seq.tokens)

    def _judged(self, e: _Entry) -> Verification:
        v = e.verification
        assert v is not None
        if e.processors is None and not e.masks:
            return v
        history = self.history.get(e.seq.seq_id, v.position) if e.needs_history else ()
        return replace(v, context=Context(e.processors, history, v.draft, e.masks, v.position))

    def _add_logprobs(self, entries: list[_Entry], logits: list[torch.Tensor], emitting: list[int],
                      emitted: list[list[int]], results: list[target_pb2.EntryResult]) -> None:
        """Raw-distribution logprobs of the emitted tokens: one logprobs_of call for the batch."""
        wanted = [(n, toks) for n, toks in zip(emitting, emitted, strict=True) if entries[n].logprobs >= 0]
        if not wanted:
            return
        rows = torch.cat([logits[n][:len(toks)] for n, toks in wanted])
        tokens = torch.tensor([t for _, toks in wanted for t in toks], device=rows.device)
        top_n = max(entries[n].logprobs for n, _ in wanted)
        chosen, top_ids, top_lp = logprobs_of(rows, tokens, top_n)
        chosen_l, ids_l, lp_l = to_lists(chosen, top_ids, top_lp)
        row = 0
        for n, toks in wanted:
            m = entries[n].logprobs
            for t in toks:
                results[n].logprobs.append(common_pb2.TokenLogprob(
                    token_id=t, logprob=chosen_l[row], top_token_ids=ids_l[row][:m], top_logprobs=lp_l[row][:m]))
                row += 1

    # ---- validation (no side effects) -----------------------------------------------------
    def parse(self, request: target_pb2.StepRequest) -> list[_Entry]:
        """The request as engine inputs, or InvalidInput naming the first bad field.
        Cache state, capacity, duplicates and token ids are checked by runner.forward before it
        changes anything; everything only the target knows about is checked here."""
        if not request.entries:
            raise InvalidInput("entries", "empty batch")
        return [self._parse_entry(n, e) for n, e in enumerate(request.entries)]

    def _parse_entry(self, n: int, e: target_pb2.StepEntry) -> _Entry:
        where = f"entries[{n}]"
        tokens = list(e.tokens)
        k = e.num_draft_tokens
        if not tokens and not (e.fork_of and e.emit and not k):
            raise InvalidInput(f"{where}.tokens", "must not be empty (but in fork_of's sibling form)")
        field_k = f"{where}.num_draft_tokens"
        if not e.emit and k:
            raise InvalidInput(field_k, f"{k} draft tokens with emit = false: nothing would judge them")
        if k > self.worker.max_draft_tokens:
            raise InvalidInput(field_k, f"{k} exceeds max_draft_tokens {self.worker.max_draft_tokens}")
        if k >= len(tokens) and tokens:
            raise InvalidInput(field_k, f"{k} draft tokens need {k + 1} tokens (the last emitted one first), "
                                        f"got {len(tokens)}")
        max_len = self.runner.max_model_len
        if e.emit and e.start_pos + len(tokens) >= max_len:
            raise InvalidInput(f"{where}.start_pos", f"{e.start_pos} + {len(tokens)} tokens leaves no room under "
                                                     f"max_model_len {max_len} for the emitted token")
        if not -1 <= e.logprobs <= MAX_LOGPROBS:
            raise InvalidInput(f"{where}.logprobs", f"must be -1 (none) or in [0, {MAX_LOGPROBS}], got {e.logprobs}")
        seq = SeqInput(e.seq_id, e.start_pos, tokens, num_logits=k + 1 if e.emit else 0,
                       prefix=list(e.prefix_block_hashes))
        processors = self._processors(e, where)
        if e.token_masks and (not e.emit or len(e.token_masks) != k + 1):
            raise InvalidInput(f"{where}.token_masks", f"{len(e.token_masks)} masks: an emitting entry needs one per "
                                                       f"decided position ({k + 1})")
        try:
            masks = tuple(zlib.decompress(m) for m in e.token_masks)
        except zlib.error as err:
            raise InvalidInput(f"{where}.token_masks", f"not a zlib-compressed bitmask: {err}") from None
        if any(not m.strip(b"\0") for m in masks):
            raise InvalidInput(f"{where}.token_masks", "a mask allows no token at all")
        if not e.emit:
            return _Entry(seq, False, 0, None, -1, processors, fork_of=e.fork_of)
        spec = sampling_spec(e.sampling, f"{where}.sampling")
        rule = self._rule(e.sampling, f"{where}.sampling")
        draft = tokens[len(tokens) - k:]
        dists = self._draft_dists(e, draft, where)
        if rule == Rule.STRICT and not spec.greedy and k and not dists:
            raise InvalidInput(f"{where}.draft_probs", f"strict sampling (temperature > 0) needs the draft's "
                                                       f"distribution at each of the {k} draft positions")
        eps, delta = self._typical_params(e.sampling, f"{where}.sampling")
        verification = Verification(draft=draft, spec=spec, position=e.start_pos + len(tokens) - k,
                                    draft_dists=dists, rule=rule, typical_epsilon=eps, typical_delta=delta)
        return _Entry(seq, True, k, verification, e.logprobs, processors, masks, e.fork_of)

    def _processors(self, e: target_pb2.StepEntry, where: str) -> Processors | None:
        try:
            p = Processors.from_proto(e.sampling, e.prompt_len)
        except InvalidField as err:
            raise InvalidInput(f"{where}.sampling.{err.field}", str(err).split(": ", 1)[-1]) from None
        vocab = self.runner.model_config.vocab_size
        if p is not None and any(not 0 <= t < vocab for t in [t for t, _ in p.bias] + list(p.held_back)):
            raise InvalidInput(f"{where}.sampling", f"logit_bias and stop_token_ids ids must be in [0, {vocab})")
        return p

    @staticmethod
    def _rule(params: common_pb2.SamplingParams, field: str) -> Rule:
        try:
            return Rule(params.acceptance)
        except ValueError:
            raise InvalidInput(f"{field}.acceptance", f"unknown acceptance rule {params.acceptance}") from None

    @staticmethod
    def _typical_params(params: common_pb2.SamplingParams, field: str) -> tuple[float, float]:
        eps = params.typical_epsilon or DEFAULT_TYPICAL_EPSILON
        delta = params.typical_delta or DEFAULT_TYPICAL_DELTA
        if not 0.0 < eps <= 1.0:
            raise InvalidInput(f"{field}.typical_epsilon", f"must be in (0, 1] (0 = default), got {eps}")
        if not (0.0 < delta and math.isfinite(delta)):
            raise InvalidInput(f"{field}.typical_delta", f"must be > 0 (0 = default), got {delta}")
        return eps, delta

    def _draft_dists(self, e: target_pb2.StepEntry, draft: list[int], where: str) -> list[SparseDist]:
        """The draft's sparse q per draft position; [] when none were sent (greedy, typical)."""
        if not e.draft_probs:
            return []
        if len(e.draft_probs) != len(draft):
            raise InvalidInput(f"{where}.draft_probs",
                               f"{len(e.draft_probs)} distributions for {len(draft)} draft tokens")
        vocab = self.runner.model_config.vocab_size
        dists = []
        for i, (d, token) in enumerate(zip(e.draft_probs, draft, strict=True)):
            field = f"{where}.draft_probs[{i}]"
            ids, probs = list(d.token_ids), list(d.probs)
            if len(ids) != len(probs):
                raise InvalidInput(field, f"{len(ids)} token_ids but {len(probs)} probs")
            if any(not 0 <= t < vocab for t in ids):
                raise InvalidInput(f"{field}.token_ids", f"token id outside [0, {vocab})")
            if len(set(ids)) != len(ids):
                raise InvalidInput(f"{field}.token_ids", "ids must be distinct")
            if any(not 0.0 <= p <= 1.0 for p in probs):  # NaN fails too
                raise InvalidInput(f"{field}.probs", "each probability must be in [0, 1]")
            if sum(probs) > 1.0 + _SUM_TOLERANCE:
                raise InvalidInput(f"{field}.probs", f"sum {sum(probs):.6f} exceeds 1")
            if token not in ids or probs[ids.index(token)] <= 0.0:
                raise InvalidInput(field, f"draft token {token} has no probability in its own distribution")
            dists.append(SparseDist(ids, probs))
        return dists


def _tokens(request: target_pb2.StepRequest) -> int:
    """A step's size: the tokens it scores (a sibling entry forks, computing nothing; a chained one
    at most its longest alternative)."""
    return sum(1 + max((len(a.drafts) for a in e.alternatives), default=0) if e.chained else len(e.tokens)
               for e in request.entries)


def create_servicer(runner: ModelRunner, model_id: str = "", max_draft_tokens: int = 8,
                    tracing: Tracing | None = None, fail_on_token: int = -1) -> TargetServicer:
    return TargetServicer(ModelWorker(runner, model_id, max_draft_tokens), tracing, fail_on_token)


def register(server: grpc.aio.Server, servicer: TargetServicer) -> None:
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
