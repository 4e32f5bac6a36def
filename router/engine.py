"""RouterEngine: the front doors' one entry point. Owns every sequence's history, validates
requests, runs the step loop, and rides out lost services."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

from tokenizers import Tokenizer

from engine.sampling import validate_sampling
from engine.tokenizer import tokenizer_fingerprint
from router.clients import DraftClient, Rejected, ServiceDown, TargetClient
from router.config import RouterConfig
from router.core import (
    Delta,
    FinishReason,
    GenerationRequest,
    Overloaded,
    RequestError,
    SeqStatus,
    Sequence,
    ServiceUnavailable,
    TokenLogprob,
)
from router.drafting import DraftLane
from router.loop import StepLoop
from router.metrics import Metrics
from router.output import OutputBuilder
from router.scheduler import CacheGeometry, Scheduler
from tandem.v1 import common_pb2

log = logging.getLogger(__name__)

MAX_LOGPROBS = 20


class IncompatibleTarget(RuntimeError):
    """The target does not use the router's tokenizer."""


class RouterEngine:
    def __init__(self, config: RouterConfig, target_address: str, draft_address: str | None,
                 tokenizer_dir: str | Path) -> None:
        self.config = config
        self.metrics = Metrics(config.k_max)
        self.target = TargetClient(target_address, config.target_timeout_s)
        self.draft = DraftLane(DraftClient(draft_address, config.draft_timeout_s) if draft_address else None,
                               self.metrics, config.draft_retry_s)
        tokenizer_dir = Path(tokenizer_dir)
        self.tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        self.fingerprint = tokenizer_fingerprint(tokenizer_dir)
        cfg_path = tokenizer_dir / "tokenizer_config.json"
        self.tokenizer_config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.target_info: common_pb2.ModelInfo | None = None
        self.target_up = False
        self._down_since = 0.0
        self._ids = itertools.count(random.getrandbits(31) << 20)  # fresh ids per router instance
        self._seqs: dict[int, Sequence] = {}
        self._builders: dict[int, OutputBuilder] = {}
        self._to_release: list[int] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.loop: StepLoop | None = None
        self.scheduler: Scheduler | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self, wait_s: float = 300.0) -> None:
        """Wait for the target (up to wait_s), check both services are compatible, start the loop."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                info = await self.target.info()
                break
            except ServiceDown as err:
                if time.monotonic() > deadline:
                    raise ServiceUnavailable(f"target {self.target.address} unreachable: {err}") from None
                log.info("waiting for target %s ...", self.target.address)
                await asyncio.sleep(1.0)
        self._check_target(info)
        self.target_info, self.target_up = info, True
        self.metrics.target_up.set(1)
        await self.draft.connect(info.tokenizer_fingerprint or self.fingerprint, info.vocab_size)
        d = self.draft.info
        self.scheduler = Scheduler(self.config, CacheGeometry(info.free_blocks, info.block_size),
                                   CacheGeometry(d.free_blocks, d.block_size) if d else None)
        self.loop = StepLoop(self.config, self.scheduler, self.target, self.draft, self.metrics, info.max_model_len,
                             self._emit, self._finish_with, self._target_lost)
        self._task = asyncio.create_task(self._run())
        log.info("router ready: target %s (%s), draft %s", self.target.address, info.model_id,
                 self.draft.client.address if self.draft.client else "none")

    def _check_target(self, info: common_pb2.ModelInfo) -> None:
        if info.tokenizer_fingerprint and self.fingerprint and info.tokenizer_fingerprint != self.fingerprint:
            raise IncompatibleTarget(f"target {info.model_id!r} uses a different tokenizer than the router's")
        if self.target_info is not None and info.vocab_size != self.target_info.vocab_size:
            raise IncompatibleTarget(f"target came back as a different model ({info.model_id!r})")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        for seq in list(self._seqs.values()):
            self._finish_with(seq, FinishReason.ABORT, ServiceUnavailable("router shutting down"))
        await self._release()
        await self.draft.close()

    @property
    def ready(self) -> bool:
        return self.target_up and self._task is not None and not self._task.done()

    # ---- requests ----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def validate(self, req: GenerationRequest) -> None:
        info = self.target_info
        assert info is not None and self.scheduler is not None, "engine not started"
        if not req.prompt_ids:
            raise RequestError("prompt", "must not be empty")
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= info.vocab_size:
            raise RequestError("prompt", f"token ids must be in [0, {info.vocab_size})")
        if req.max_tokens < 1:
            raise RequestError("max_tokens", f"must be >= 1, got {req.max_tokens}")
        total = len(req.prompt_ids) + req.max_tokens
        if total > info.max_model_len:
            raise RequestError("max_tokens" if len(req.prompt_ids) < info.max_model_len else "prompt",
                               f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.max_tokens}) exceeds "
                               f"the model's max_model_len {info.max_model_len}")
        if not self.scheduler.fits_ever(total):
            raise RequestError("max_tokens", f"{total} tokens would not fit in the KV cache even alone")
        s = req.sampling
        problems = validate_sampling(s.temperature, s.top_p, s.top_k, "sampling")
        if problems:
            raise RequestError(problems[0].split(" ", 1)[0].removeprefix("sampling."), problems[0])
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise RequestError("logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        if req.max_speculative_tokens is not None and req.max_speculative_tokens < 0:
            raise RequestError("max_speculative_tokens", "must be >= 0")

    def submit(self, req: GenerationRequest) -> Sequence:
        self.validate(req)
        assert self.scheduler is not None
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise Overloaded(f"{len(self.scheduler.waiting)} requests waiting; try again later")
        seq = Sequence(seq_id=next(self._ids), request=req, tokens=list(req.prompt_ids),
                       num_prompt=len(req.prompt_ids))
        eos = set(self.target_info.eos_token_ids) if self.target_info else set()
        self._builders[seq.seq_id] = OutputBuilder(self.tokenizer, req, eos)
        self._seqs[seq.seq_id] = seq
        self.scheduler.add(seq)
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))
        self._wake.set()
        return seq

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Delta]:
        """Deltas until one carries finish_reason. Closing the iterator early aborts the request
        and frees its KV in both services."""
        seq = self.submit(req)
        try:
            while True:
                delta = await seq.outputs.get()
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            if not seq.finished:
                self._finish_with(seq, FinishReason.ABORT, None)

    # ---- loop callbacks --------------------------------------------------------------------
    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None) -> None:
        builder = self._builders[seq.seq_id]
        kept, delta = builder.add(tokens, logprobs)
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
        if builder.finish_reason is not None:
            self._finish(seq, builder.finish_reason)

    def _finish_with(self, seq: Sequence, reason: FinishReason, error: Exception | None) -> None:
        if seq.finished:
            return
        seq.outputs.put_nowait(self._builders[seq.seq_id].abort(reason, error))
        self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finished = True
        seq.status = SeqStatus.FINISHED
        assert self.scheduler is not None
        self.scheduler.remove(seq)
        self._seqs.pop(seq.seq_id, None)
        self._builders.pop(seq.seq_id, None)
        if self.loop is not None:
            self.loop.trackers.pop(seq.seq_id, None)
            self.loop.next_k.pop(seq.seq_id, None)
        self._to_release.append(seq.seq_id)
        self.metrics.requests.labels(finish_reason=reason.value).inc()
        self.metrics.e2e.observe(time.monotonic() - seq.arrival)
        self._wake.set()

    def _target_lost(self) -> None:
        if self.target_up:
            self._down_since = time.monotonic()
        self.target_up = False
        self.metrics.target_up.set(0)
        for seq in self._seqs.values():
            seq.target_cached = 0  # whatever it held is gone or unknown: recompute from history

    # ---- the loop ------------------------------------------------------------------------------
    async def _run(self) -> None:
        assert self.loop is not None and self.scheduler is not None
        while True:
            if not self.target_up:
                await self._recover_target()
                continue
            try:
                did = await self.loop.iteration()
            except Exception as err:  # a router bug must not hang requests: fail what was running
                log.exception("step failed")
                for seq in list(self.scheduler.running):
                    self._finish_with(seq, FinishReason.ERROR, err)
                did = True
            await self._release()
            self._update_gauges()
            if not did:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=0.05)
                except TimeoutError:
                    pass

    async def _recover_target(self) -> None:
        try:
            info = await self.target.info(timeout_s=2.0)
            self._check_target(info)
        except (ServiceDown, Rejected, IncompatibleTarget) as err:
            waited = time.monotonic() - self._down_since
            for seq in list(self._seqs.values()):
                if min(waited, time.monotonic() - seq.arrival) > self.config.target_grace_s:
                    self._finish_with(seq, FinishReason.ERROR, ServiceUnavailable(
                        f"target unavailable for {waited:.0f}s (grace {self.config.target_grace_s:.0f}s): {err}"))
            await asyncio.sleep(0.5)
            return
        log.info("target %s is back; recomputing %d sequences", self.target.address, len(self._seqs))
        self.target_up = True
        self.metrics.target_up.set(1)

    async def _release(self) -> None:
        if self._to_release and self.loop is not None:
            ids, self._to_release = self._to_release, []
            await self.loop.release_now(ids)

    def _update_gauges(self) -> None:
        assert self.scheduler is not None
        self.metrics.waiting.set(len(self.scheduler.waiting))
        self.metrics.running.set(len(self.scheduler.running))
        t, d = self.scheduler.usage()
        self.metrics.kv_usage.labels(service="target").set(t / self.scheduler.target.num_blocks)
        if self.scheduler.draft:
            self.metrics.kv_usage.labels(service="draft").set(d / self.scheduler.draft.num_blocks)
