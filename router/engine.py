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

from common.protocol import MAX_LOGPROBS
from common.sampling import validate_sampling
from common.tokenizer import tokenizer_fingerprint
from router.clients import Rejected, ServiceDown
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
from router.discovery import parse_spec
from router.lanes import Lane, choose_lane, connect_lane, migrate, pick_draft, publish_gauges, share_draft_capacity
from router.loop import StepLoop
from router.metrics import Metrics
from router.output import OutputBuilder
from tandem.v1 import common_pb2

log = logging.getLogger(__name__)


class IncompatibleTarget(RuntimeError):
    """The target does not use the router's tokenizer."""


class RouterEngine:
    def __init__(self, config: RouterConfig, target_spec: str, draft_spec: str | None,
                 tokenizer_dir: str | Path) -> None:
        """target_spec / draft_spec: where the replicas are (router.discovery.parse_spec)."""
        self.config = config
        self.metrics = Metrics(config.k_max)
        self.targets = parse_spec(target_spec)
        self.drafts = parse_spec(draft_spec) if draft_spec else None
        tokenizer_dir = Path(tokenizer_dir)
        self.tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        self.fingerprint = tokenizer_fingerprint(tokenizer_dir)
        cfg_path = tokenizer_dir / "tokenizer_config.json"
        self.tokenizer_config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.target_info: common_pb2.ModelInfo | None = None  # the first target's; all must agree
        self.lanes: dict[str, Lane] = {}
        self._ids = itertools.count(random.getrandbits(31) << 20)  # fresh ids per router instance
        self._seqs: dict[int, Sequence] = {}
        self._lane_of: dict[int, Lane] = {}
        self._builders: dict[int, OutputBuilder] = {}
        self._refresh: asyncio.Task | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self, wait_s: float = 300.0) -> None:
        """Wait (up to wait_s) until at least one target answers; check compatibility; start."""
        deadline = time.monotonic() + wait_s
        while not self.lanes:
            errors = await self._discover()
            if self.lanes:
                break
            if time.monotonic() > deadline:
                raise ServiceUnavailable(f"no target reachable: {'; '.join(errors) or 'none discovered'}")
            log.info("waiting for a target ... (%s)", "; ".join(errors) or "none discovered yet")
            await asyncio.sleep(1.0)
        if self.targets.dynamic or (self.drafts is not None and self.drafts.dynamic):
            self._refresh = asyncio.create_task(self._refresh_loop())
        log.info("router ready: %s", ", ".join(f"{n} (draft {lane.draft_address})" for n, lane in self.lanes.items()))

    async def _discover(self) -> list[str]:
        """Add lanes for new target replicas, retire lanes whose replica left. Returns errors."""
        addresses = await self.targets.addresses()
        drafts = await self.drafts.addresses() if self.drafts else []
        errors = []
        for address in addresses:
            if address in self.lanes:
                continue
            try:
                lane = await connect_lane(self.config, self.metrics, address,
                                          pick_draft(list(self.lanes.values()), drafts), self.fingerprint)
            except ServiceDown as err:
                errors.append(f"{address}: {err}")
                continue
            self._check_target(lane.info)
            self._start_lane(lane)
        for name in [n for n in self.lanes if n not in addresses and self.targets.dynamic]:
            await self._retire(self.lanes[name])
        return errors

    def _start_lane(self, lane: Lane) -> None:
        if self.target_info is None:
            self.target_info = lane.info
        lane.loop = StepLoop(self.config, lane.scheduler, lane.target, lane.draft, self.metrics,
                             min(lane.info.max_model_len, self.target_info.max_model_len),
                             self._emit, self._finish_with, lambda: self._target_lost(lane))
        self.lanes[lane.name] = lane
        share_draft_capacity(list(self.lanes.values()))
        lane.task = asyncio.create_task(self._run(lane))
        self.metrics.replica_up.labels(replica=lane.name, service="target").set(1)
        log.info("target replica %s: %s, %d blocks x %d, max_model_len %d", lane.name, lane.info.model_id,
                 lane.info.free_blocks, lane.info.block_size, lane.info.max_model_len)

    async def _retire(self, lane: Lane) -> None:
        log.warning("target replica %s left discovery", lane.name)
        lane.retired = True
        self._relocate_pins(lane)
        for seq in lane.sequences():  # nowhere to go: the last replica left
            self._finish_with(seq, FinishReason.ERROR, ServiceUnavailable(f"target replica {lane.name} is gone"))
        del self.lanes[lane.name]
        if lane.task:
            lane.task.cancel()
        await lane.draft.close()
        self.metrics.replica_up.labels(replica=lane.name, service="target").set(0)

    async def _refresh_loop(self, period_s: float = 5.0) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await self._discover()
            except Exception:  # noqa: BLE001 - discovery trouble must not stop serving
                log.exception("replica discovery failed")

    def _check_target(self, info: common_pb2.ModelInfo) -> None:
        if info.tokenizer_fingerprint and self.fingerprint and info.tokenizer_fingerprint != self.fingerprint:
            raise IncompatibleTarget(f"target {info.model_id!r} uses a different tokenizer than the router's")
        if self.target_info is not None and info.vocab_size != self.target_info.vocab_size:
            raise IncompatibleTarget(f"target {info.model_id!r} is a different model (vocab {info.vocab_size} "
                                     f"vs {self.target_info.vocab_size})")

    async def stop(self) -> None:
        if self._refresh:
            self._refresh.cancel()
        for lane in self.lanes.values():
            if lane.task:
                lane.task.cancel()
        for seq in list(self._seqs.values()):
            self._finish_with(seq, FinishReason.ABORT, ServiceUnavailable("router shutting down"))
        for lane in self.lanes.values():
            await self._release(lane)
            await lane.draft.close()
        self.targets.close()
        if self.drafts:
            self.drafts.close()

    @property
    def ready(self) -> bool:
        return any(lane.up and lane.task is not None and not lane.task.done() for lane in self.lanes.values())

    # ---- requests ----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def validate(self, req: GenerationRequest) -> None:
        info = self.target_info
        assert info is not None and self.lanes, "engine not started"
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
        if not any(lane.scheduler.fits_ever(total) for lane in self.lanes.values()):
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
        waiting = sum(len(lane.scheduler.waiting) for lane in self.lanes.values())
        if waiting >= self.config.max_waiting * len(self.lanes):
            raise Overloaded(f"{waiting} requests waiting; try again later")
        lane = choose_lane(list(self.lanes.values())) or next(iter(self.lanes.values()))
        seq = Sequence(seq_id=next(self._ids), request=req, tokens=list(req.prompt_ids),
                       num_prompt=len(req.prompt_ids))
        eos = set(self.target_info.eos_token_ids) if self.target_info else set()
        self._builders[seq.seq_id] = OutputBuilder(self.tokenizer, req, eos)
        self._seqs[seq.seq_id] = seq
        self._lane_of[seq.seq_id] = lane
        lane.scheduler.add(seq)
        self.metrics.replica_assigned.labels(replica=lane.name).inc()
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))
        lane.wake.set()
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
        lane = self._lane_of.pop(seq.seq_id)
        lane.scheduler.remove(seq)
        self._seqs.pop(seq.seq_id, None)
        self._builders.pop(seq.seq_id, None)
        if lane.loop is not None:
            lane.loop.trackers.pop(seq.seq_id, None)
            lane.loop.next_k.pop(seq.seq_id, None)
        lane.to_release.append(seq.seq_id)
        self.metrics.requests.labels(finish_reason=reason.value).inc()
        self.metrics.e2e.observe(time.monotonic() - seq.arrival)
        lane.wake.set()

    def _target_lost(self, lane: Lane) -> None:
        if lane.up:
            lane.down_since = time.monotonic()
            log.error("target replica %s lost", lane.name)
        lane.up = False
        self.metrics.replica_up.labels(replica=lane.name, service="target").set(0)
        for seq in lane.sequences():
            seq.target_cached = 0  # whatever it held is gone or unknown: recompute from history
        self._relocate_pins(lane)

    def _relocate_pins(self, src: Lane) -> None:
        """Move src's sequences to live replicas, if there are any, and re-pin them."""
        for seq, dst in migrate(src, list(self.lanes.values()), self.metrics):
            self._lane_of[seq.seq_id] = dst

    # ---- the loop (one per replica) -------------------------------------------------------------
    async def _run(self, lane: Lane) -> None:
        assert lane.loop is not None
        while not lane.retired:
            if not lane.up:
                await self._recover(lane)
                continue
            try:
                did = await lane.loop.iteration()
            except Exception as err:  # a router bug must not hang requests: fail what was running
                log.exception("step failed on %s", lane.name)
                for seq in list(lane.scheduler.running):
                    self._finish_with(seq, FinishReason.ERROR, err)
                did = True
            if lane.draft.info is not None and lane.scheduler.draft is None:
                share_draft_capacity(list(self.lanes.values()))  # a draft that came up after the lane
            await self._release(lane)
            self._update_gauges()
            if not did:
                lane.wake.clear()
                try:
                    await asyncio.wait_for(lane.wake.wait(), timeout=0.05)
                except TimeoutError:
                    pass

    async def _recover(self, lane: Lane) -> None:
        try:
            info = await lane.target.info(timeout_s=2.0)
            self._check_target(info)
        except (ServiceDown, Rejected, IncompatibleTarget) as err:
            self._relocate_pins(lane)  # requests that arrived meanwhile, when another replica can take them
            waited = time.monotonic() - lane.down_since
            for seq in lane.sequences():
                if min(waited, time.monotonic() - seq.arrival) > self.config.target_grace_s:
                    self._finish_with(seq, FinishReason.ERROR, ServiceUnavailable(
                        f"target unavailable for {waited:.0f}s (grace {self.config.target_grace_s:.0f}s): {err}"))
            self._update_gauges()
            await asyncio.sleep(0.5)
            return
        log.info("target replica %s is back; recomputing %d sequences", lane.name, len(lane.sequences()))
        lane.up = True
        self.metrics.replica_up.labels(replica=lane.name, service="target").set(1)

    async def _release(self, lane: Lane) -> None:
        if lane.to_release and lane.loop is not None:
            ids, lane.to_release = lane.to_release, []
            await lane.loop.release_now(ids)

    def _update_gauges(self) -> None:
        publish_gauges(list(self.lanes.values()), self.metrics)
