"""The router's side of the draft service: prompt mirroring, proposals, and graceful absence.

Position bookkeeping per sequence (see core.Sequence): the draft holds draft_stream[:draft_cached].
A proposal continues a base stream S (the history, plus the drafts being verified right now when
pipelining); the draft is told to keep the common prefix of what it holds and S, and is fed the
rest of S, whose last token is never cached before the call:

    draft holds:  t0 t1 t2 t3 d1 d2          (draft_cached = 6, stale d's after a rejection)
    base S:       t0 t1 t2 t3 x              (x: the target's corrected token)
    call:         start_pos = 4, tokens = [x], k = K   ->  stream = S + e1..eK, cached = 4 + 1 + K - 1

The draft is optional: any failure turns this step's proposals into k = 0 for the affected
sequences and, when the service is unreachable, a reconnect loop with backoff takes over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from router.clients import CacheMissError, DraftClient, Rejected, ServiceDown
from router.core import Sequence
from router.metrics import Metrics
from tandem.v1 import common_pb2, draft_pb2

log = logging.getLogger(__name__)

CATCH_UP_IN_PROPOSE = 64  # longer catch-ups go through Sync first


class IncompatibleDraft(RuntimeError):
    """The draft does not share the target's tokenizer/vocabulary (DESIGN invariant 4)."""


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search the first difference
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class ProposalRequest:
    seq: Sequence
    base: list[int]  # the stream the proposal continues
    k: int  # tokens to propose


class DraftLane:
    def __init__(self, client: DraftClient | None, metrics: Metrics, retry_s: float) -> None:
        self.client = client
        self.metrics = metrics
        self.retry_s = retry_s
        self.info: common_pb2.ModelInfo | None = None
        self.up = False
        self._reconnect: asyncio.Task | None = None
        self._expect: tuple[str, int] | None = None  # (tokenizer fingerprint, vocab) of the target

    @property
    def max_k(self) -> int:
        return self.info.max_draft_tokens if self.info else 0

    async def connect(self, fingerprint: str, vocab_size: int) -> None:
        """First contact: an incompatible draft is refused; an absent one is retried in the background."""
        self._expect = (fingerprint, vocab_size)
        if self.client is None:
            return
        try:
            await self._handshake()
        except ServiceDown as err:
            log.warning("draft %s unreachable (%s): serving with k = 0 until it is back", self.client.address, err)
            self._lost()

    async def _handshake(self) -> None:
        assert self.client is not None and self._expect is not None
        info = await self.client.info()
        fingerprint, vocab = self._expect
        if info.vocab_size != vocab or (fingerprint and info.tokenizer_fingerprint != fingerprint):
            raise IncompatibleDraft(
                f"draft {info.model_id!r} at {self.client.address} does not share the target's tokenizer "
                f"(vocab {info.vocab_size} vs {vocab}, fingerprint {info.tokenizer_fingerprint[:12]!r} vs "
                f"{fingerprint[:12]!r}); speculation needs an identical vocabulary")
        self.info, self.up = info, True
        self.metrics.replica_up.labels(replica=self.client.address, service="draft").set(1)
        log.info("draft %s ready: %s, %d blocks x %d", self.client.address, info.model_id, info.num_blocks,
                 info.block_size)

    def _lost(self) -> None:
        self.up = False
        if self.client is not None:
            self.metrics.replica_up.labels(replica=self.client.address, service="draft").set(0)
        if self._reconnect is None or self._reconnect.done():
            self._reconnect = asyncio.create_task(self._reconnect_loop())

    async def _reconnect_loop(self) -> None:
        delay = self.retry_s
        while not self.up:
            await asyncio.sleep(delay)
            try:
                await self._handshake()
            except ServiceDown:
                delay = min(2 * delay, 5.0)
            except IncompatibleDraft as err:
                log.error("%s", err)
                delay = 30.0

    async def close(self) -> None:
        if self._reconnect:
            self._reconnect.cancel()

    # ---- calls ---------------------------------------------------------------------------------
    async def sync(self, chunks: list[tuple[Sequence, list[int], int]]) -> None:
        """Make the draft hold stream[:end] for each (seq, stream, end): mirrors the target's prompt
        chunks, and catches up a draft that lags (after a restart) from where it diverges."""
        if not self.up or not chunks:
            return
        msgs, applied = [], []
        budget = self.info.max_batch_tokens
        for seq, stream, end in chunks:
            begin = common_prefix(seq.draft_stream[: seq.draft_cached], stream, end)
            if begin >= end:
                continue  # already there (a recompute the draft did not need)
            if end - begin > budget:
                end = begin + budget  # the rest next step
            if end <= begin:
                continue
            budget -= end - begin
            msgs.append(draft_pb2.Chunk(seq_id=seq.seq_id, start_pos=begin, tokens=stream[begin:end]))
            applied.append((seq, stream[:end]))
        if msgs:
            await self._guard(self._do_sync(msgs, applied), [s for s, _ in applied], "sync")

    async def _do_sync(self, msgs: list[draft_pb2.Chunk], applied: list[tuple[Sequence, list[int]]]) -> bool:
        assert self.client is not None
        resp = await self.client.sync(msgs)
        for (seq, held), cached in zip(applied, resp.cached_len, strict=True):
            assert cached == len(held), "draft cached_len disagrees with the router's bookkeeping"
            seq.draft_cached, seq.draft_stream = cached, held
            seq.draft_probs.clear()
        return True

    async def propose(self, requests: list[ProposalRequest], spec: dict[int, common_pb2.SamplingParams]) -> float:
        """Ask for proposals; install them as each sequence's draft_stream. Returns the call's ms."""
        if not self.up or not requests:
            return 0.0
        t0 = time.perf_counter()
        catch_up, entries, kept = [], [], []
        budget = self.info.max_batch_tokens
        for r in requests:
            held = r.seq.draft_stream[: r.seq.draft_cached]
            p = common_prefix(held, r.base, len(r.base) - 1)
            if len(r.base) - p > CATCH_UP_IN_PROPOSE:
                catch_up.append((r.seq, r.base, len(r.base) - 1))
                continue
            if budget < len(r.base) - p + r.k:
                continue  # no room this step: k = 0 for it, next step tries again
            budget -= len(r.base) - p + r.k
            entries.append(draft_pb2.ProposeEntry(seq_id=r.seq.seq_id, start_pos=p, tokens=r.base[p:], k=r.k,
                                                  sampling=spec[r.seq.seq_id]))
            kept.append(r)
        if catch_up:
            await self.sync(catch_up)
        if entries:
            await self._guard(self._do_propose(entries, kept), [r.seq for r in kept], "propose")
        return (time.perf_counter() - t0) * 1000

    async def _do_propose(self, entries: list[draft_pb2.ProposeEntry], kept: list[ProposalRequest]) -> bool:
        assert self.client is not None
        resp = await self.client.propose(entries)
        for r, prop in zip(kept, resp.proposals, strict=True):
            seq = r.seq
            seq.draft_stream = r.base + list(prop.tokens)
            seq.draft_cached = prop.cached_len
            # the base may end in drafts still being verified: keep their q, add the new ones
            kept_q = {pos: q for pos, q in seq.draft_probs.items() if pos < len(r.base)}
            seq.draft_probs = kept_q | {len(r.base) + j: q for j, q in enumerate(prop.probs)}
        return True

    async def _guard(self, call, seqs: list[Sequence], what: str) -> bool | None:  # noqa: ANN001
        """Run a draft call; on failure fall back to k = 0 for this step and repair state."""
        try:
            return await call
        except CacheMissError as err:
            missing = set(err.seq_ids)
            for seq in seqs:
                if seq.seq_id in missing:
                    seq.draft_cached, seq.draft_stream = 0, []
            self.metrics.draft_fallbacks.labels(reason="cache_miss").inc()
        except ServiceDown as err:
            log.warning("draft %s failed (%s): k = 0 until it is back", what, err)
            self.metrics.draft_fallbacks.labels(reason="down").inc()
            self._lost()
        except Rejected as err:
            log.error("draft rejected %s: %s", what, err)
            self.metrics.draft_fallbacks.labels(reason="rejected").inc()
            for seq in seqs:  # resync these from scratch next time
                seq.draft_cached, seq.draft_stream = 0, []
        return None

    async def release(self, seq_ids: list[int]) -> None:
        if self.up and seq_ids and self.client is not None:
            try:
                await self.client.release(seq_ids)
            except (ServiceDown, Rejected, CacheMissError) as err:
                log.debug("draft release failed: %s", err)
