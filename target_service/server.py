"""TargetService: one forward pass over a mixed batch of prompt chunks and draft verifications,
then sampling and the acceptance rule next to the logits (semantics in proto/tandem/v1/target.proto).

A Step is validated completely before the forward, so an invalid request changes no cache.
All model work (validation against cache state included) runs on the ModelWorker's one thread.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import grpc
import torch

from common.protocol import MAX_LOGPROBS
from engine.runner import InvalidInput, ModelRunner, SeqInput
from engine.sampling import logprobs_of
from engine.service import ModelWorker, call_deadline, rpc_errors, sampling_spec, still_wanted
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

SERVICE_NAME = "tandem.v1.TargetService"
_SUM_TOLERANCE = 1e-4  # a sparse q may sum to 1 + float32 rounding


@dataclass(frozen=True)
class _Entry:
    seq: SeqInput
    emit: bool
    k: int
    verification: Verification | None  # None when emit is false
    logprobs: int  # -1: none


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, worker: ModelWorker, fail_on_token: int = -1) -> None:
        self.worker = worker
        self.fail_on_token = fail_on_token  # fault injection for tests: a Step starting a sequence with it fails
        self.runner: ModelRunner = worker.runner

    # ---- RPCs -----------------------------------------------------------------------------
    @rpc_errors
    async def GetInfo(self, request: common_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.ModelInfo:
        return self.worker.info()

    @rpc_errors
    async def Step(self, request: target_pb2.StepRequest, context: grpc.aio.ServicerContext) -> target_pb2.StepResponse:
        self.worker.lease.check(context)
        return await self.worker.run(self.step, request, call_deadline(context))

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
    def step(self, request: target_pb2.StepRequest, deadline: float | None = None) -> target_pb2.StepResponse:
        entries = self.parse(request)
        if self.fail_on_token >= 0 and any(e.seq.start_pos == 0 and e.seq.tokens[0] == self.fail_on_token
                                           for e in entries):
            raise RuntimeError(f"injected fault: a sequence starts with token {self.fail_on_token}")
        still_wanted(deadline)
        t0 = time.perf_counter()
        runner = self.runner
        logits = runner.forward([e.seq for e in entries])  # validates capacity and cache state first
        emitting = [n for n, e in enumerate(entries) if e.emit]
        outcomes = accept([logits[n] for n in emitting], [entries[n].verification for n in emitting])
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
        return target_pb2.StepResponse(results=results, forward_ms=(time.perf_counter() - t0) * 1e3,
                                       free_blocks=runner.blocks.num_free)

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
        if not tokens:
            raise InvalidInput(f"{where}.tokens", "must not be empty")
        field_k = f"{where}.num_draft_tokens"
        if not e.emit and k:
            raise InvalidInput(field_k, f"{k} draft tokens with emit = false: nothing would judge them")
        if k > self.worker.max_draft_tokens:
            raise InvalidInput(field_k, f"{k} exceeds max_draft_tokens {self.worker.max_draft_tokens}")
        if k >= len(tokens):
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
        if not e.emit:
            return _Entry(seq, False, 0, None, -1)
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
        return _Entry(seq, True, k, verification, e.logprobs)

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


def create_servicer(runner: ModelRunner, model_id: str = "", max_draft_tokens: int = 8,
                    fail_on_token: int = -1) -> TargetServicer:
    return TargetServicer(ModelWorker(runner, model_id, max_draft_tokens), fail_on_token)


def register(server: grpc.aio.Server, servicer: TargetServicer) -> None:
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
