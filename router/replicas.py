"""The target replicas the router drives: discovering them, one lane (scheduler + step loop) each,
riding out a lost one (recompute within the grace period, else 503) and retiring those that leave."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from router.adapters import Adapters, IncompatibleTarget
from router.clients import NotOwner, Rejected, ServiceDown, ServiceError, TargetClient
from router.config import RouterConfig
from router.core import FinishReason, ServiceUnavailable, TokenLogprob
from router.discovery import Discovery
from router.lanes import Lane, connect_lane, migrate, pick_draft, publish_gauges, share_draft_capacity
from router.loop import StepLoop
from router.metrics import Metrics
from router.ownership import Ownership
from router.sequence import Sequence
from tandem.v1 import common_pb2

log = logging.getLogger(__name__)
GAUGE_PERIOD_S = 0.1  # queue and KV gauges: refreshed at most this often, not every step
PROBE_PERIOD_S = 2.0  # an idle lane asks its target how it is this often (/ready must not lie while idle)


class Replicas:
    def __init__(self, config: RouterConfig, metrics: Metrics, targets: Discovery, drafts: Discovery | None,
                 fingerprint: str,
                 emit: Callable[[Sequence, list[int], list[TokenLogprob] | None], None],
                 finish: Callable[[Sequence, FinishReason, Exception | None], None]) -> None:
        self.config, self.metrics = config, metrics
        self.targets, self.drafts = targets, drafts
        self.fingerprint = fingerprint
        self._emit, self._finish = emit, finish
        self.lanes: dict[str, Lane] = {}
        self.target_info: common_pb2.ModelInfo | None = None  # the first target's; all must agree
        self.adapters = Adapters()  # the LoRA adapters served (the first target's, then runtime updates)
        self.ownership = Ownership(config)
        self._refresh: asyncio.Task | None = None
        self._gauges_at = 0.0

    async def start(self, wait_s: float) -> None:
        """Wait (up to wait_s) until at least one target answers; check compatibility; start."""
        deadline = time.monotonic() + wait_s
        while not self.lanes:
            errors = await self.discover()
            if self.lanes:
                break
            if time.monotonic() > deadline:
                raise ServiceUnavailable(f"no target reachable: {'; '.join(errors) or 'none discovered'}")
            log.info("waiting for a target ... (%s)", "; ".join(errors) or "none discovered yet")
            await asyncio.sleep(1.0)
        self._refresh = asyncio.create_task(self._lease_loop())

    async def discover(self) -> list[str]:
        """Claim replicas up to this router's share and add lanes for them; retire lanes whose
        replica left discovery. Returns errors."""
        addresses = await self.targets.addresses()
        drafts = await self.drafts.addresses() if self.drafts else []
        errors = []
        for address in addresses:
            if address in self.lanes:
                continue
            if self.lanes and len(self.lanes) >= self.ownership.share(len(addresses)):
                break  # its part is held (a claim attempt would also tell the others about this router)
            target = TargetClient(address, self.config.target_timeout_s, self.config.target_tls, self.config.router_id)
            try:
                if not await self.ownership.claim(target):
                    await target.close()
                    continue
                lane = await connect_lane(self.config, self.metrics, target,
                                          pick_draft(list(self.lanes.values()), drafts,
                                                     set(self.ownership.elsewhere)), self.fingerprint)
            except ServiceDown as err:
                errors.append(f"{address}: {err}")
                await target.close()
                continue
            try:
                await self.check(target, lane.info)  # may load LoRA adapters it lacks
            except ServiceDown as err:
                errors.append(f"{address}: {err}")
                await lane.draft.close()
                await target.close()
                continue
            self._start_lane(lane)
        for name in [n for n in self.lanes if n not in addresses and self.targets.dynamic]:
            await self._retire(self.lanes[name])
        return errors

    async def check(self, target: TargetClient, info: common_pb2.ModelInfo) -> None:
        if info.tokenizer_fingerprint and self.fingerprint and info.tokenizer_fingerprint != self.fingerprint:
            raise IncompatibleTarget(f"target {info.model_id!r} uses a different tokenizer than the router's")
        if self.target_info is not None and info.vocab_size != self.target_info.vocab_size:
            raise IncompatibleTarget(f"target {info.model_id!r} is a different model (vocab {info.vocab_size} "
                                     f"vs {self.target_info.vocab_size})")
        await self.adapters.admit(target, info)

    def _start_lane(self, lane: Lane) -> None:
        if self.target_info is None:
            self.target_info = lane.info
            self.adapters.adopt(lane.info)
        lane.loop = StepLoop(self.config, lane.scheduler, lane.target, lane.draft, self.metrics,
                             min(lane.info.max_model_len, self.target_info.max_model_len),
                             lane.info.max_draft_tokens or self.config.k_max, self._emit, self._finish,
                             lambda: self._lost(lane), lane.wake.set, lane.info.compute_id)
        self.lanes[lane.name] = lane
        share_draft_capacity(list(self.lanes.values()))
        lane.task = asyncio.create_task(self._run(lane))
        self.metrics.replica_up.labels(replica=lane.name, service="target").set(1)
        log.info("target replica %s: %s, %d blocks x %d, max_model_len %d, on %s", lane.name, lane.info.model_id,
                 lane.info.free_blocks, lane.info.block_size, lane.info.max_model_len,
                 lane.info.compute_id or "unknown compute")

    async def _retire(self, lane: Lane) -> None:
        log.warning("target replica %s left discovery", lane.name)
        lane.retired = True
        self.relocate(lane)
        for seq in lane.sequences():  # nowhere to go: the last replica left
            self._finish(seq, FinishReason.ERROR, ServiceUnavailable(f"target replica {lane.name} is gone"))
        del self.lanes[lane.name]
        if lane.task:
            lane.task.cancel()
        await lane.draft.close()
        self.metrics.replica_up.labels(replica=lane.name, service="target").set(0)

    async def _lease_loop(self) -> None:
        """Every third of the lease: renew what this router holds, take its share, give up the rest."""
        while True:
            await asyncio.sleep(self.config.lease_ttl_s / 3)
            try:
                await self._renew()
                await self.discover()
                await self._rebalance()
            except Exception:  # noqa: BLE001 - discovery trouble must not stop serving
                log.exception("replica discovery or lease renewal failed")

    async def _renew(self) -> None:
        for lane in [lane for lane in self.lanes.values() if lane.up and not lane.retired]:
            try:
                if not await self.ownership.claim(lane.target):
                    log.error("lost the lease of target %s to %s", lane.name, self.ownership.elsewhere.get(lane.name))
                    self._lost(lane)
            except ServiceDown:
                pass  # the lane's own steps and probes notice a target that is down
        for draft in {id(lane.draft): lane.draft for lane in self.lanes.values()}.values():
            await draft.renew()

    async def _rebalance(self) -> None:
        """Hold no more than this router's share: drain the least busy extra lane, then give it up."""
        total = len(await self.targets.addresses())
        active = [lane for lane in self.lanes.values() if lane.draining_since is None and not lane.retired]
        if len(active) > self.ownership.share(total):
            lane = min(active, key=lambda ln: len(ln.sequences()))
            lane.draining_since = time.monotonic()
            log.info("holding %d of %d targets with %d routers: giving %s up", len(active), total,
                     self.ownership.routers(), lane.name)
        for lane in [ln for ln in self.lanes.values() if ln.draining_since is not None]:
            waited = time.monotonic() - lane.draining_since
            if lane.scheduler.waiting or waited > 2 * self.config.lease_ttl_s:
                self.relocate(lane)  # running ones may finish first; the queue moves now
            if not lane.sequences():
                await self._give_up(lane)

    async def _give_up(self, lane: Lane) -> None:
        lane.retired = True
        del self.lanes[lane.name]
        if lane.task:
            lane.task.cancel()
        await self._release(lane)
        try:
            await lane.target.lease(self.config.lease_ttl_s, release=True)
        except (ServiceDown, Rejected, ServiceError, NotOwner) as err:
            log.debug("target lease release failed: %s", err)
        if lane.draft.client is not None and all(ln.draft is not lane.draft for ln in self.lanes.values()):
            await lane.draft.give_up()
        self.metrics.replica_up.labels(replica=lane.name, service="target").set(0)
        log.info("gave target %s up to the other routers", lane.name)

    async def stop(self) -> None:
        if self._refresh:
            self._refresh.cancel()
        for lane in self.lanes.values():
            if lane.task:
                lane.task.cancel()

    async def release_all(self) -> None:
        for lane in self.lanes.values():
            await self._release(lane)
            await lane.draft.close()
        self.targets.close()
        if self.drafts:
            self.drafts.close()

    def _lost(self, lane: Lane) -> None:
        if lane.up:
            lane.down_since = time.monotonic()
            log.error("target replica %s lost", lane.name)
        lane.up = False
        self.metrics.replica_up.labels(replica=lane.name, service="target").set(0)
        for seq in lane.sequences():
            seq.target_cached = 0  # whatever it held is gone or unknown: recompute from history
        self.relocate(lane)

    def relocate(self, src: Lane) -> None:
        """Move src's sequences to live replicas that can hold them, if there are any."""
        migrate(src, list(self.lanes.values()), self.metrics)

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
                    self._finish(seq, FinishReason.ERROR, err)
                did = True
            if lane.draft.info is not None and lane.scheduler.draft is None:
                share_draft_capacity(list(self.lanes.values()))  # a draft that came up after the lane
            await self._release(lane)
            self.update_gauges()
            if did:
                lane.contact = time.monotonic()
                continue
            if time.monotonic() - lane.contact > PROBE_PERIOD_S:
                await self._probe(lane)
            lane.wake.clear()
            try:
                await asyncio.wait_for(lane.wake.wait(), timeout=0.05)
            except TimeoutError:
                pass

    async def _probe(self, lane: Lane) -> None:
        lane.contact = time.monotonic()
        try:
            info = await lane.target.info(timeout_s=5.0)
            if not self.adapters.held_by(info):
                log.warning("target replica %s lacks LoRA adapters this router serves (a restart?): recovering it",
                            lane.name)
                self._lost(lane)  # its recovery loads them again (Adapters.admit)
        except ServiceDown as err:
            if "DEADLINE_EXCEEDED" in str(err):
                log.warning("target replica %s is slow to answer a probe: %s", lane.name, err)
                return  # slow is not gone: its steps tell the difference
            log.error("target replica %s does not answer: %s", lane.name, err)
            self._lost(lane)
        except (Rejected, ServiceError):
            pass

    async def _recover(self, lane: Lane) -> None:
        try:
            if not await self.ownership.claim(lane.target):
                raise NotOwner(self.ownership.elsewhere.get(lane.name, ""))
            info = await lane.target.info(timeout_s=2.0)
            await self.check(lane.target, info)
        except (ServiceDown, Rejected, ServiceError, NotOwner, IncompatibleTarget) as err:
            self.relocate(lane)  # requests that arrived meanwhile, when another replica can take them
            waited = time.monotonic() - lane.down_since
            for seq in lane.sequences():
                if min(waited, time.monotonic() - seq.arrival) > self.config.target_grace_s:
                    log.error("failing seq %d: target %s unreachable for %.0fs: %s", seq.seq_id, lane.name, waited, err)
                    self._finish(seq, FinishReason.ERROR, ServiceUnavailable(
                        f"the model service was unavailable for {waited:.0f}s "
                        f"(grace {self.config.target_grace_s:.0f}s)"))
            self.update_gauges(force=True)
            await asyncio.sleep(0.5)
            return
        log.info("target replica %s is back; recomputing %d sequences", lane.name, len(lane.sequences()))
        lane.up = True
        self.metrics.replica_up.labels(replica=lane.name, service="target").set(1)

    async def _release(self, lane: Lane) -> None:
        if lane.to_release and lane.loop is not None:
            ids, lane.to_release = lane.to_release, []
            await lane.loop.release_now(ids)

    def update_gauges(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._gauges_at >= GAUGE_PERIOD_S:
            self._gauges_at = now
            publish_gauges(list(self.lanes.values()), self.metrics)
