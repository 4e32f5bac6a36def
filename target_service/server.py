"""TargetService: one forward pass over a mixed batch of prompt chunks and draft verifications,
then sampling and the acceptance rule next to the logits (semantics in proto/tandem/v1/target.proto).

A Step is validated completely before the forward, so an invalid request changes no cache.
All model work (validation against cache state included) runs on the ModelWorker's one thread.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import grpc
import torch

from common.tracing import Tracing
from engine.logits import Context, TokenHistory
from engine.rpc import call_deadline, rpc_errors, still_wanted
from engine.runner import CacheMiss, InvalidInput, ModelRunner
from engine.sampling import logprobs_of
from engine.service import ModelWorker
from engine.streams import CallStreams, request_deadline
from engine.transfer import to_lists
from tandem.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.acceptance import Verification, accept
from target_service.adapters import DEFAULT_MAX_LORAS, RuntimeAdapters
from target_service.chaining import Chain, remember, resolve_chained
from target_service.parsing import Entry, StepParser

SERVICE_NAME = "tandem.v1.TargetService"


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    rpc_service = SERVICE_NAME

    def __init__(self, worker: ModelWorker, tracing: Tracing | None = None, fail_on_token: int = -1,
                 adapters: RuntimeAdapters | None = None) -> None:
        self.worker = worker
        self.adapters = adapters or RuntimeAdapters(worker, enabled=False)  # LoadLoraAdapter / UnloadLoraAdapter
        self.fail_on_token = fail_on_token  # fault injection for tests: a Step starting a sequence with it fails
        self.runner: ModelRunner = worker.runner
        self.tracing = tracing  # spans for calls that carry a trace context (engine.rpc_trace)
        self.history = TokenHistory()  # token ids of sequences with penalties (engine/logits.py)
        self.streams = CallStreams()  # the open StepStreams
        self._chains: dict[int, Chain] = {}  # per open StepStream: what its last step emitted (chained steps)
        self.parser = StepParser(self.runner.model_config.vocab_size, self.runner.max_model_len,
                                 worker.max_draft_tokens)
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

    @rpc_errors
    async def LoadLoraAdapter(self, request: target_pb2.LoadLoraAdapterRequest,
                              context: grpc.aio.ServicerContext) -> common_pb2.LoraAdapterInfo:
        self.worker.lease.check(context)
        return await self.adapters.load(request.name, request.path)

    @rpc_errors
    async def UnloadLoraAdapter(self, request: target_pb2.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext) -> target_pb2.UnloadLoraAdapterResponse:
        self.worker.lease.check(context)
        await self.adapters.unload(request.name)
        return target_pb2.UnloadLoraAdapterResponse()

    # ---- the step (model thread) ----------------------------------------------------------
    @torch.inference_mode()
    def step(self, request: target_pb2.StepRequest, deadline: float | None = None,
             chain: Chain | None = None) -> target_pb2.StepResponse:
        """chain: the stream's record of its last step (None for a unary Step, which cannot chain)."""
        chosen = resolve_chained(request, chain)
        entries = self.parser.parse(request)
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
        # an emitting entry's last k + 1 rows decide; rows before them score prompt tokens (prompt_logprobs)
        decided = [logits[n][len(logits[n]) - entries[n].k - 1:] for n in emitting]
        outcomes = accept(decided, [self._judged(entries[n]) for n in emitting])
        results = [target_pb2.EntryResult(seq_id=e.seq.seq_id) for e in entries]
        for n, out in zip(emitting, outcomes, strict=True):
            e = entries[n]
            runner.trim(e.seq.seq_id, e.seq.start_pos + len(e.seq.tokens) - e.k + out.num_accepted)
            results[n].tokens.extend(out.tokens)
            results[n].num_accepted = out.num_accepted
        self._add_logprobs(entries, decided, [(n, o.tokens) for n, o in zip(emitting, outcomes, strict=True)], results)
        self._add_prompt_logprobs(entries, logits, results)
        for e, r in zip(entries, results, strict=True):
            r.cached_len = runner.cached_len(e.seq.seq_id)
            runner.commit(e.seq.seq_id, r.cached_len)  # rejected drafts are trimmed: the rest is history
        for n, alternative in chosen.items():
            results[n].alternative = alternative
        if chain is not None:
            remember(chain, entries, results)
        return target_pb2.StepResponse(results=results, forward_ms=(time.perf_counter() - t0) * 1e3,
                                       free_blocks=runner.blocks.num_free)

    def _check_siblings(self, entries: list[Entry]) -> dict[int, int]:
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

    def _mirror(self, entries: list[Entry]) -> None:
        """Keep the token history of sequences with penalties (a gap means the service lost it: recompute)."""
        missing = [e.seq.seq_id for e in entries if e.needs_history and not e.sibling
                   and not self.history.covers(e.seq.seq_id, e.seq.start_pos)]
        if missing:
            raise CacheMiss(missing)
        for e in entries:
            if e.needs_history and not e.sibling:
                self.history.put(e.seq.seq_id, e.seq.start_pos, e.seq.tokens)

    def _judged(self, e: Entry) -> Verification:
        v = e.verification
        assert v is not None
        if e.processors is None and not e.masks:
            return v
        history = self.history.get(e.seq.seq_id, v.position) if e.needs_history else ()
        return replace(v, context=Context(e.processors, history, v.draft, e.masks, v.position))

    def _add_logprobs(self, entries: list[Entry], decided: list[torch.Tensor], emitted: list[tuple[int, list[int]]],
                      results: list[target_pb2.EntryResult]) -> None:
        """Raw-distribution logprobs of the emitted tokens (decided: each emitting entry's deciding rows)."""
        wanted = [(n, rows[:len(toks)], toks, entries[n].logprobs)
                  for (n, toks), rows in zip(emitted, decided, strict=True) if entries[n].logprobs >= 0]
        for n, lp in _logprobs(wanted):
            results[n].logprobs.append(lp)

    def _add_prompt_logprobs(self, entries: list[Entry], logits: list[torch.Tensor],
                             results: list[target_pb2.EntryResult]) -> None:
        """Raw-distribution logprobs of the prompt tokens the chunks asking for them score."""
        wanted = [(n, logits[n][:len(e.prompt_targets)], list(e.prompt_targets), e.prompt_logprobs)
                  for n, e in enumerate(entries) if e.prompt_logprobs >= 0]
        for n, lp in _logprobs(wanted):
            results[n].prompt_logprobs.append(lp)


def _logprobs(wanted: list[tuple[int, torch.Tensor, list[int], int]]) -> list[tuple[int, common_pb2.TokenLogprob]]:
    """(entry, TokenLogprob) of each token of each (entry, rows, tokens, top alternatives) wanted: one
    logprobs_of call for the batch."""
    if not wanted:
        return []
    rows = torch.cat([r for _, r, _, _ in wanted])
    tokens = torch.tensor([t for _, _, toks, _ in wanted for t in toks], device=rows.device)
    chosen, rank, top_ids, top_lp = logprobs_of(rows, tokens, max(m for *_, m in wanted))
    chosen_l, rank_l, ids_l, lp_l = to_lists(chosen, rank, top_ids, top_lp)
    out, row = [], 0
    for n, _, toks, m in wanted:
        for t in toks:
            out.append((n, common_pb2.TokenLogprob(token_id=t, logprob=chosen_l[row], top_token_ids=ids_l[row][:m],
                                                   top_logprobs=lp_l[row][:m], rank=rank_l[row])))
            row += 1
    return out


def _tokens(request: target_pb2.StepRequest) -> int:
    """A step's size: the tokens it scores (a sibling entry forks, computing nothing; a chained one
    at most its longest alternative)."""
    return sum(1 + max((len(a.drafts) for a in e.alternatives), default=0) if e.chained else len(e.tokens)
               for e in request.entries)


def create_servicer(runner: ModelRunner, model_id: str = "", max_draft_tokens: int = 8,
                    tracing: Tracing | None = None, fail_on_token: int = -1,
                    thread: ThreadPoolExecutor | None = None, runtime_lora: bool = False,
                    max_loras: int = DEFAULT_MAX_LORAS, lora_root: Path | None = None) -> TargetServicer:
    """thread: the model thread the runner loaded on (engine.service.model_thread), if any;
    runtime_lora: LoRA adapters may be loaded and unloaded while serving (at most max_loras held; from
    directories inside lora_root, where it is given)."""
    worker = ModelWorker(runner, model_id, max_draft_tokens, thread)
    return TargetServicer(worker, tracing, fail_on_token, RuntimeAdapters(worker, runtime_lora, max_loras, lora_root))


def register(server: grpc.aio.Server, servicer: TargetServicer) -> None:
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
