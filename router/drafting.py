"""The router's side of the draft service: one Propose per step that mirrors prompt chunks and
prepares proposals (draft_work.DraftWork), run in the background so the target never waits for it;
graceful absence.

The draft is optional: any failure of a call means k = 0 for the sequences it carried and, when
the service is unreachable, a reconnect loop with backoff takes over. Releases made while it is
down are kept and sent when it is back, so its KV never leaks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING

from router.clients import CacheMissError, DraftClient, NotOwner, Rejected, ServiceDown, ServiceError
from router.draft_work import DraftWork
from router.metrics import Metrics
from router.sequence import Sequence
from router.speculation import OutcomeStats, Prepared
from tandem.v1 import common_pb2, draft_pb2

if TYPE_CHECKING:
    from router.tracing import StepTrace

log = logging.getLogger(__name__)

OVERHEAD_PRIOR_MS = 1.0  # demo pair, two cores: 0.3-0.5 ms each way plus validation and serialisation
OVERHEAD_DECAY = 0.1
MIN_STOP_AFTER_MS = 0.01


class IncompatibleDraft(RuntimeError):
    """The draft does not share the target's tokenizer/vocabulary (DESIGN invariant 4)."""


class DraftLane:
    def __init__(self, client: DraftClient | None, metrics: Metrics, retry_s: float, lease_ttl_s: float = 10.0) -> None:
        self.client = client
        self.metrics = metrics
        self.retry_s = retry_s
        self.lease_ttl_s = lease_ttl_s
        self.info: common_pb2.ModelInfo | None = None
        self.up = False
        self.stats = OutcomeStats()
        self.on_done: Callable[[], None] = lambda: None  # the step loop's wake-up
        self.on_cost: Callable[[DraftWork, float], None] = lambda work, ms: None
        self._call: asyncio.Task | None = None
        self.in_flight: DraftWork | None = None  # the call's work, while it runs
        self.started = 0.0  # perf_counter() when it was sent
        self.ended = 0.0  # perf_counter() when the last call ended
        self.waited_for = False  # a step already waited for it (upfront.grace_ms: once per call)
        self.overhead_ms = OVERHEAD_PRIOR_MS  # a call's wall time beyond its forwards (decayed mean)
        self._reconnect: asyncio.Task | None = None
        self._releases: list[int] = []  # kept while the draft is unreachable
        self._expect: tuple[str, int] | None = None  # (tokenizer fingerprint, vocab) of the target

    @property
    def max_k(self) -> int:
        return self.info.max_draft_tokens if self.info else 0

    @property
    def budget(self) -> int:
        return self.info.max_batch_tokens if self.info else 0

    @property
    def call(self) -> asyncio.Task | None:
        """The call in flight (done once its proposals landed on the sequences), if any."""
        return None if self.idle else self._call

    @property
    def idle(self) -> bool:
        return self._call is None or self._call.done()

    async def connect(self, fingerprint: str, vocab_size: int) -> None:
        """First contact: an incompatible draft is refused; an absent one is retried in the background."""
        self._expect = (fingerprint, vocab_size)
        if self.client is None:
            return
        try:
            await self._handshake()
        except (ServiceDown, NotOwner) as err:
            log.warning("draft %s unavailable (%s): serving with k = 0 until it is back", self.client.address, err)
            self._lost()

    async def _handshake(self) -> None:
        assert self.client is not None and self._expect is not None
        info = await self.client.info()  # answered by the model thread: a stuck draft is not "up"
        lease = await self.client.lease(self.lease_ttl_s)
        if not lease.granted:
            raise NotOwner(lease.owner)
        fingerprint, vocab = self._expect
        if info.vocab_size != vocab or (fingerprint and info.tokenizer_fingerprint != fingerprint):
            raise IncompatibleDraft(
                f"draft {info.model_id!r} at {self.client.address} does not share the target's tokenizer "
                f"(vocab {info.vocab_size} vs {vocab}, fingerprint {info.tokenizer_fingerprint[:12]!r} vs "
                f"{fingerprint[:12]!r}); speculation needs an identical vocabulary")
        if self._releases:  # what finished while it was away; sequences it lost anyway are ignored
            ids, self._releases = self._releases, []
            await self.client.release(ids)
        self.info, self.up = info, True
        self.metrics.replica_up.labels(replica=self.client.address, service="draft").set(1)
        log.info("draft %s ready: %s, %d blocks x %d, on %s", self.client.address, info.model_id, info.num_blocks,
                 info.block_size, info.compute_id or "unknown compute")

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
            except (ServiceDown, Rejected, CacheMissError, NotOwner, ServiceError):
                delay = min(2 * delay, 5.0)
            except IncompatibleDraft as err:
                log.error("%s", err)
                delay = 30.0

    async def close(self) -> None:
        for task in (self._reconnect, self._call):
            if task:
                task.cancel()

    def rest(self) -> None:
        """The router had nothing to do: its proposal stream closes after a while (clients._CallStream)."""
        if self.client is not None and self.idle:
            self.client.idle()

    # ---- calls ---------------------------------------------------------------------------------
    def launch(self, plan: Callable[[], DraftWork], trace: StepTrace | None = None) -> None:
        """Run a call in the background (one at a time); its results land on the sequences. plan()
        builds its work in the call's task, so the step loop sends the target's Step before the draft's
        work is planned (the step that follows waits for neither).
        trace: the step it was planned for, when tracing (its spans parent the call's)."""
        assert self.idle
        if self.up:
            self._call = asyncio.create_task(self._launched(plan, trace))

    async def _launched(self, plan: Callable[[], DraftWork], trace: StepTrace | None) -> None:
        try:
            work = plan()
        except Exception:  # noqa: BLE001 - the draft is optional: planning its work may not fail a step
            log.exception("planning the draft's work failed")
            return
        if work.entries:
            self.in_flight, self.started, self.waited_for = work, time.perf_counter(), False
            await self.run(work, trace)

    def busy_since(self, t: float) -> bool:
        """Whether a call was running at some time since perf_counter() t."""
        return self.in_flight is not None or self.ended > t

    async def wait(self, timeout_s: float | None = None) -> None:
        """Until the call in flight is done, or timeout_s passed (the call goes on)."""
        if self.idle:
            return
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(self._call)
        except TimeoutError:
            pass

    async def run(self, work: DraftWork, trace: StepTrace | None = None) -> float:
        """The call, awaited (sequential mode uses it directly). Returns its wall time in ms."""
        if not self.up or not work.entries:
            return 0.0
        assert self.client is not None
        t0 = time.perf_counter()
        try:
            with trace.draft_call(work.seqs) if trace is not None else nullcontext(None) as metadata:
                response = await self.client.propose(work.entries, metadata, self._stop_after_ms(work, t0))
            ms = (time.perf_counter() - t0) * 1000
            self.overhead_ms += OVERHEAD_DECAY * (ms - response.forward_ms - self.overhead_ms)
            if 0 < response.forwards < work.rounds:  # stopped early (_stop_after_ms): what it ran is what it cost
                work.rounds = response.forwards
                self.metrics.draft_stops.inc()
            self.on_cost(work, ms)
            self._apply(work, response)
        except CacheMissError as err:  # the draft restarted: those sequences resync from scratch
            self._reset([s for s in work.seqs if s.seq_id in set(err.seq_ids)], "cache_miss")
        except (ServiceDown, NotOwner) as err:
            log.warning("draft call failed (%s): k = 0 until it is back", err)
            self._reset(work.seqs, "down")
            self._lost()
        except Rejected as err:
            log.error("draft rejected a call: %s", err)
            self._reset(work.seqs, "rejected")
        except Exception:  # noqa: BLE001 - the draft is optional: nothing it does may fail a request
            log.exception("draft call failed unexpectedly")
            self._reset(work.seqs, "error")
        finally:
            self.in_flight, self.ended = None, time.perf_counter()
            self.on_done()
        return (time.perf_counter() - t0) * 1000

    def _stop_after_ms(self, work: DraftWork, sent: float) -> float:
        """The call's time to stop drafting by: when it is due, less the call's own overhead (what a call
        takes beyond the draft's forwards: both transits, validation, the answer's serialisation). At
        least a moment: a call already late still gets its drafts' first round."""
        if not work.due:
            return 0.0
        return max(MIN_STOP_AFTER_MS, (work.due - sent) * 1000 - self.overhead_ms)

    def _reset(self, seqs: list[Sequence], reason: str) -> None:
        self.metrics.draft_fallbacks.labels(reason=reason).inc()
        for seq in seqs:
            seq.draft_cached, seq.draft_stream = 0, []
            seq.prefix.draft_dropped, seq.prefix.draft_committed = True, 0

    def _apply(self, work: DraftWork, response: draft_pb2.ProposeResponse) -> None:
        assert len(response.proposals) == len(work.entries), "one proposal per entry"
        for seq, base, epoch, entry, prop in zip(work.seqs, work.bases, work.epochs, work.entries,
                                                  response.proposals, strict=True):
            if seq.finished or seq.cache_epoch != epoch:
                continue  # preempted or moved meanwhile: its draft cache was dropped
            plain = list(prop.tokens)
            seq.draft_stream = base + plain[:-1]
            seq.draft_cached = prop.cached_len
            assert prop.cached_len == len(seq.draft_stream), "draft cached_len disagrees with the router"
            v = entry.num_verifying
            history_len = seq.prefix.draft_committed = len(base) - v  # the draft published its full blocks
            if plain:
                seq.prepared.append(Prepared(len(base), (), tuple(plain), tuple(prop.probs),
                                             confidence=tuple(prop.confidence)))
            verifying = tuple(base[history_len:])
            for spec, b in zip(entry.branches, prop.branches, strict=True):
                seq.prepared.append(Prepared(history_len, verifying[:b.accepted] + (b.token,), tuple(b.drafts),
                                             tuple(b.probs), b.accepted, spec.rank, tuple(b.confidence)))

    async def renew(self) -> None:
        """Keep this router's lease on the draft; losing it is losing the draft."""
        if not self.up or self.client is None:
            return
        try:
            if not (await self.client.lease(self.lease_ttl_s)).granted:
                raise NotOwner("another router")
        except (ServiceDown, NotOwner) as err:
            log.warning("draft %s lease not renewed (%s): k = 0 until it is back", self.client.address, err)
            self._lost()
        except (Rejected, ServiceError) as err:
            log.warning("draft %s lease renewal failed: %s", self.client.address, err)

    async def give_up(self) -> None:
        """Hand the draft back (its KV freed) when no lane of this router uses it any more."""
        await self.close()
        if self.up and self.client is not None:
            try:
                await self.client.lease(self.lease_ttl_s, release=True)
            except (ServiceDown, Rejected, ServiceError, NotOwner) as err:
                log.debug("draft lease release failed: %s", err)
        self.up = False

    def release(self, seq_ids: list[int]) -> None:
        """Queue releases; they go out with the next chance (at once when up, on reconnect otherwise)."""
        self._releases.extend(seq_ids)

    async def flush_releases(self) -> None:
        if not (self.up and self._releases and self.client is not None):
            return
        ids, self._releases = self._releases, []
        try:
            await self.client.release(ids)
        except (ServiceDown, Rejected, CacheMissError) as err:
            log.debug("draft release failed, kept for later: %s", err)
            self._releases.extend(ids)
