"""RouterEngine: the front doors' one entry point. Owns every sequence's history, validates
requests once (submit), runs one step loop per target replica, and rides out lost services.

    door:  req = Request(...)            # parsed, sampling defaults resolved
           stream = engine.submit(req)   # synchronous: raises RequestError / Overloaded / ServiceUnavailable
           async for delta in stream:    # then a stream of outputs; closing it early aborts the request
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import random
import sys
import time
from pathlib import Path

from opentelemetry.context import Context

from common.block_hash import salt_digest, salted_root
from common.sampling import SamplingParams
from common.tokenizer import tokenizer_fingerprint
from router.codec import TextCodec
from router.config import RouterConfig
from router.core import TENANT, Delta, FinishReason, Overloaded, Request, SeqStatus, ServiceUnavailable, TokenLogprob
from router.discovery import parse_spec
from router.lanes import Lane, choose_lane
from router.lookup import PromptLookup
from router.metrics import Metrics
from router.output import OutputBuilder
from router.replicas import Replicas
from router.request_checks import check_request
from router.request_trace import RequestTrace
from router.sequence import RequestStream, Sequence, about, report
from router.structured import Grammars
from tandem.v1 import common_pb2

log = logging.getLogger(__name__)


class RouterEngine:
    def __init__(self, config: RouterConfig, target_spec: str, draft_spec: str | None,
                 tokenizer_dir: str | Path) -> None:
        """target_spec / draft_spec: where the replicas are (router.discovery.parse_spec)."""
        self.config = config
        self.metrics = Metrics(config.k_max)
        self.codec = TextCodec(tokenizer_dir, chat_template=config.chat_template)
        self.fingerprint = tokenizer_fingerprint(tokenizer_dir)
        self.sampling_defaults = SamplingParams.from_generation_config(tokenizer_dir)
        self.replicas = Replicas(config, self.metrics, parse_spec(target_spec),
                                 parse_spec(draft_spec) if draft_spec else None, self.fingerprint, self._emit,
                                 self.finish)
        self._ids = itertools.count(random.getrandbits(31) << 20)  # fresh ids per router instance
        self._seqs: dict[int, Sequence] = {}
        self.tokenizer_dir = Path(tokenizer_dir)
        self._grammars: Grammars | None = None
        self.draining = False  # shutting down: requests in flight finish, new ones are refused

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self, wait_s: float = 300.0) -> None:
        """Wait (up to wait_s) until at least one target answers; check compatibility; start."""
        await self.replicas.start(wait_s)
        info = self.target_info
        if info is not None:  # the grammar engine's view of the vocabulary: ~0.4 s on 49k tokens, off the loop
            self._grammars = await asyncio.to_thread(Grammars, self.tokenizer_dir, info.vocab_size,
                                                     info.eos_token_ids)
        log.info("router ready: %s; sampling defaults %s", ", ".join(
            f"{n} (draft {lane.draft_address})" for n, lane in self.lanes.items()), self.sampling_defaults)

    def drain(self) -> None:
        """Refuse new requests (503 / UNAVAILABLE, /ready too); those in flight go on."""
        if not self.draining:
            self.draining = True
            self.metrics.draining.set(1)
            log.info("shutting down: %d requests in flight, new ones refused", len(self._seqs))

    async def drained(self, timeout_s: float) -> bool:
        """Whether every request finished within timeout_s (those in flight keep running meanwhile)."""
        deadline = time.monotonic() + timeout_s
        while self._seqs and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self._seqs

    def abort_all(self) -> int:
        """End every request now: each client gets a clean 503 / UNAVAILABLE. Returns how many."""
        seqs = list(self._seqs.values())
        for seq in seqs:
            self.finish(seq, FinishReason.ABORT, ServiceUnavailable("router shutting down"))
        return len(seqs)

    async def stop(self) -> None:
        self.drain()
        await self.replicas.stop()
        self.abort_all()
        await self.replicas.release_all()
        self.codec.close()

    @property
    def lanes(self) -> dict[str, Lane]:
        return self.replicas.lanes

    @property
    def target_info(self) -> common_pb2.ModelInfo | None:
        return self.replicas.target_info

    @property
    def lora_adapters(self) -> list[str]:
        """The LoRA adapters every target replica serves (--lora-modules, then runtime loads), by name."""
        return self.replicas.adapters.names()

    async def load_lora(self, name: str, path: str) -> None:
        """vLLM's runtime LoRA loading: on every replica up (one down gets it when it is back)."""
        await self.replicas.adapters.load([lane.target for lane in self.lanes.values() if lane.up], name, path)

    async def unload_lora(self, name: str) -> None:
        """Once the requests running with it have finished (new ones are refused meanwhile)."""
        await self.replicas.adapters.unload([lane.target for lane in self.lanes.values()], name,
                                            lambda: sum(1 for seq in self._seqs.values() if seq.request.lora == name))

    def model_lora(self, model: str, served: tuple[str, ...]) -> str | None:
        """The adapter a request's model names: "" for the served model itself (any of its names), None for
        no model served here."""
        return "" if model in served else model if model in self.lora_adapters else None

    @property
    def unready(self) -> str | None:
        """Why a new request is refused now; None: it is taken."""
        if self.draining:
            return "the router is shutting down: send it to another"
        if not any(lane.up and lane.task is not None and not lane.task.done() for lane in self.lanes.values()):
            return "the target service is unavailable"
        return None

    @property
    def max_model_len(self) -> int:
        """The longest sequence every replica can hold: the model's limit, or less where the KV cache is smaller."""
        assert self.target_info is not None and self.lanes, "engine not started"
        n = min(self.target_info.max_model_len, max(lane.scheduler.max_tokens_alone() for lane in self.lanes.values()))
        return min(n, self.config.max_model_len) if self.config.max_model_len else n

    # ---- requests ----------------------------------------------------------------------------
    async def encode(self, text: str, field: str = "prompt", truncating: bool = False) -> list[int]:
        """Tokenize off the event loop; a text that surely exceeds the context is refused unencoded
        (unless the request keeps only the end of its prompt: the body's size limit bounds it then)."""
        return await self.codec.encode(text, sys.maxsize if truncating else self.max_model_len, field)

    async def encode_chat(self, messages: list[dict], options: dict[str, object],
                          truncating: bool = False) -> list[int]:
        """options: ChatFormatter.render's (the template's flags and variables, the request's own among them)."""
        return await self.codec.encode_chat(messages, sys.maxsize if truncating else self.max_model_len, options)

    def validate(self, req: Request) -> int:
        """RequestError naming the first bad field; else the number of tokens the request may generate."""
        info = self.target_info
        assert info is not None and self.lanes, "engine not started"
        return check_request(req, info.vocab_size, self.max_model_len, self.config.scheduling_policy,
                             self.lora_adapters, tuple(info.eos_token_ids))

    def _tokenized(self, req: Request) -> Request:
        """The request with its bad_words (text) among its sampling's token sequences, and the think
        tokens its thinking_token_budget needs (the reasoning parser's)."""
        sampling = req.sampling
        if req.bad_words:
            banned = sampling.bad_words + self.codec.bad_word_ids(req.bad_words)
            sampling = dataclasses.replace(sampling, bad_words=banned)
        if sampling.thinking_token_budget is not None:
            sampling = dataclasses.replace(sampling, think_tokens=self.codec.think_tokens(self.config.reasoning_parser))
        return req if sampling is req.sampling else dataclasses.replace(req, sampling=sampling)

    @property
    def grammars(self) -> Grammars:
        if self._grammars is None:  # built at start; here only for an engine started without a target
            info = self.target_info
            assert info is not None, "engine not started"
            self._grammars = Grammars(self.tokenizer_dir, info.vocab_size, info.eos_token_ids)
        return self._grammars

    def submit_all(self, reqs: list[Request], trace_parent: Context | None = None) -> RequestStream:
        """Several prompts as one request (OpenAI's list of prompts): each validated before any is
        queued, their outputs in one stream where prompt p's choice i is index p x n + i. A prompt
        refused while queueing (Overloaded) aborts the ones queued before it."""
        assert reqs and len({r.n for r in reqs}) == 1, "one n for all prompts"
        reqs = [self._tokenized(req) for req in reqs]
        max_tokens = [self.validate(req) for req in reqs]
        queue: asyncio.Queue[Delta] = asyncio.Queue()
        seqs: list[Sequence] = []
        try:
            for p, (req, most) in enumerate(zip(reqs, max_tokens, strict=True)):
                seqs += self._queue(req, most, trace_parent, queue, p * req.n)
        except Exception:
            RequestStream(seqs, self.finish).abort()
            raise
        return RequestStream(seqs, self.finish)

    def submit(self, req: Request, trace_parent: Context | None = None) -> RequestStream:
        """Validate and queue a request (synchronous: raises before anything is queued).
        trace_parent: the caller's span, when tracing (None: the current context's)."""
        req = self._tokenized(req)
        return RequestStream(self._queue(req, self.validate(req), trace_parent, asyncio.Queue(), 0), self.finish)

    def _queue(self, req: Request, max_tokens: int, trace_parent: Context | None, queue: asyncio.Queue[Delta],
               first_index: int) -> list[Sequence]:
        """Queue a validated request's n choices, their Deltas into `queue` numbered from first_index."""
        if self.unready is not None:
            raise ServiceUnavailable(f"not ready: {self.unready}")
        total = len(req.prompt_ids) + max_tokens
        lanes = [lane for lane in self.lanes.values() if lane.scheduler.fits_ever(total)]
        waiting = sum(len(lane.scheduler.waiting) for lane in self.lanes.values())
        if waiting >= self.config.max_waiting * len(self.lanes):
            raise Overloaded(f"{waiting} requests waiting; try again later")
        lane = choose_lane(lanes) or lanes[0]
        assert lane.loop is not None, "a lane is listed once its loop runs"
        eos = tuple(self.target_info.eos_token_ids) if self.target_info else ()
        grammar = self.grammars.compile(req.constraint) if req.constraint is not None else ""
        tenant = TENANT.get()
        root = salted_root(self.replicas.adapters.root(req.lora), salt_digest(req.cache_salt, tenant))
        req = dataclasses.replace(req, eos_ids=eos, grammar=grammar, tenant=tenant, block_root=root)
        seqs: list[Sequence] = []
        for i in range(req.n):  # one lane for all: the siblings fork the first one's prompt there
            choice = req if i == 0 else dataclasses.replace(req, sampling=req.sampling.for_choice(i))
            seq = Sequence(seq_id=next(self._ids), request=choice, tokens=list(req.prompt_ids),
                           num_prompt=len(req.prompt_ids), output=OutputBuilder(self.codec.tokenizer, choice, set(eos),
                                                                                max_tokens, first_index + i),
                           lane=lane, outputs=queue, index=first_index + i, fork_parent=seqs[0] if seqs else None,
                           grammar=self.grammars.state(grammar, req.grammar_opens_after) if grammar else None,
                           tracker=lane.loop.spec.draft_acceptance.tracker(),
                           lookup_tracker=lane.loop.spec.lookup_acceptance.tracker(),
                           lookup=PromptLookup(prediction=req.prediction, start=len(req.prompt_ids),
                                               history=self.config.prompt_lookup))
            if seqs:
                seqs[0].forks.append(seq)
            seqs.append(seq)
            self._seqs[seq.seq_id] = seq
            if self.config.tracing is not None:
                seq.stats.trace = RequestTrace(self.config.tracing.tracer, req, seq.seq_id, lane.name, trace_parent)
            log.debug("queued on %s: %d prompt tokens, max_tokens %d", lane.name, len(req.prompt_ids), max_tokens,
                      extra=about(seq))
            lane.scheduler.add(seq)
        self.metrics.replica_assigned.labels(replica=lane.name).inc(req.n)
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))
        if grammar:
            self.metrics.structured_requests.labels(kind=req.constraint.kind).inc()  # type: ignore[union-attr]
        if req.lora:
            self.metrics.lora_requests.labels(adapter=req.lora).inc()
        lane.wake.set()
        return seqs

    # ---- loop callbacks --------------------------------------------------------------------
    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None) -> None:
        complete = False
        if seq.grammar is not None:
            tokens, complete = seq.grammar.advance(tokens)
        kept, delta = seq.output.add(tokens, logprobs, last=complete)
        seq.tokens.extend(kept)
        now = time.monotonic()
        if kept:
            if seq.first_token_time is None:
                seq.first_token_time = now
                self.metrics.ttft.observe(now - seq.arrival)
                rest = len(kept) - 1
            else:
                rest = len(kept)
            if rest and seq.last_token_time is not None:
                for _ in range(rest):
                    self.metrics.itl.observe((now - seq.last_token_time) / rest)
            seq.last_token_time = now
            self.metrics.generation_tokens.inc(len(kept))
        if delta is not None:
            seq.outputs.put_nowait(delta)
        if seq.output.finish_reason is not None:
            self._done(seq, seq.output.finish_reason)

    def finish(self, seq: Sequence, reason: FinishReason, error: Exception | None) -> None:
        """End a sequence from outside its output (abort, error): its client gets a final Delta."""
        if seq.finished:
            return
        seq.outputs.put_nowait(seq.output.abort(reason, error))
        self._done(seq, reason, error)

    def _done(self, seq: Sequence, reason: FinishReason, error: Exception | None = None) -> None:
        seq.finished = True
        seq.status = SeqStatus.FINISHED
        assert seq.lane is not None
        seq.lane.finished(seq)
        self._seqs.pop(seq.seq_id, None)
        self.metrics.requests.labels(finish_reason=reason.value).inc()
        self.metrics.e2e.observe(time.monotonic() - seq.arrival)
        self.metrics.queue_time.observe(seq.stats.finished())
        if seq.stats.trace is not None:
            seq.stats.trace.finish(reason, seq.num_output, report(seq), error)
        log.debug("finished (%s): %d prompt + %d output tokens in %.3fs, %.3fs queued", reason.value,
                  seq.num_prompt, seq.num_output, time.monotonic() - seq.arrival, seq.stats.queued_seconds,
                  extra=about(seq))
