"""Replicas: one Lane per target replica, each with its own scheduler and step loop, paired with
a draft replica. A sequence is pinned to one lane (so to one target and one draft); new
sequences go to the least loaded lane. A lane whose target is lost or leaves discovery hands its
sequences to the others, which recompute them from the router's history.

    targets  t0   t1   t2          drafts  d0   d1
    lanes   (t0,d0) (t1,d1) (t2,d0)   d0's KV blocks are split between the two lanes using it
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from router.clients import DraftClient, TargetClient
from router.config import RouterConfig
from router.core import SeqStatus
from router.drafting import DraftLane
from router.loop import StepLoop
from router.metrics import Metrics
from router.prefix import PrefixCaches
from router.scheduler import CacheGeometry, Scheduler
from router.sequence import Sequence
from tandem.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Lane:
    target: TargetClient
    draft: DraftLane
    info: common_pb2.ModelInfo
    scheduler: Scheduler
    loop: StepLoop | None = None
    up: bool = True
    down_since: float = 0.0
    contact: float = 0.0  # when the target last answered (monotonic)
    retired: bool = False
    draining_since: float | None = None  # giving the replica up to another router: no new sequences
    task: asyncio.Task | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    to_release: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.target.address

    @property
    def draft_address(self) -> str | None:
        return self.draft.client.address if self.draft.client else None

    def load(self) -> float:
        """KV reserved (fraction) plus queue pressure: where a new sequence should go."""
        t, _ = self.scheduler.usage()
        return t / self.scheduler.target.num_blocks + len(self.scheduler.waiting) / self.scheduler.config.max_num_seqs

    def sequences(self) -> list[Sequence]:
        return list(self.scheduler.running) + list(self.scheduler.waiting)

    def finished(self, seq: Sequence) -> None:
        """seq ended: out of the scheduler; its KV is released in both services by the next step."""
        self.scheduler.remove(seq)
        self.to_release.append(seq.seq_id)
        self.wake.set()


def pick_draft(lanes: list[Lane], drafts: list[str], elsewhere: set[str] = frozenset()) -> str | None:
    """The draft replica used by the fewest lanes (stable: ties go to the first listed), among those
    no other router holds."""
    free = [d for d in drafts if d not in elsewhere]
    if not free:
        return None
    used = Counter(lane.draft_address for lane in lanes)
    return min(free, key=lambda d: used[d])


def share_draft_capacity(lanes: list[Lane]) -> None:
    """Split each draft replica's blocks evenly between the lanes that use it."""
    users = Counter(lane.draft_address for lane in lanes if lane.draft.info is not None)
    for lane in lanes:
        info = lane.draft.info
        if info is not None:
            lane.scheduler.draft = CacheGeometry(info.free_blocks // users[lane.draft_address], info.block_size)
            if lane.scheduler.prefix is not None:
                lane.scheduler.prefix.use_draft(info.block_size if info.prefix_caching else None)


def choose_lane(lanes: list[Lane], exclude: Lane | None = None) -> Lane | None:
    candidates = [lane for lane in lanes if lane.up and not lane.retired and lane.draining_since is None
                  and lane is not exclude]
    return min(candidates, key=Lane.load) if candidates else None


def migrate(src: Lane, lanes: list[Lane], metrics: Metrics) -> list[tuple[Sequence, Lane]]:
    """Move every sequence of src to other live lanes that can ever hold it (front of their
    queues, original order). Their caches there are empty: they recompute from history.
    A sequence no other lane can hold stays. Returns (sequence, new lane)."""
    moved = []
    for seq in reversed(src.sequences()):
        need = len(seq.request.prompt_ids) + seq.output.max_tokens
        dst = choose_lane([lane for lane in lanes if lane.scheduler.fits_ever(need)], exclude=src)
        if dst is None:
            continue
        src.scheduler.remove(seq)
        seq.status = SeqStatus.WAITING
        seq.forget_caches()
        seq.lane = dst
        dst.scheduler.requeue(seq)
        dst.wake.set()
        moved.append((seq, dst))
    if moved:
        metrics.migrations.inc(len(moved))
        log.warning("moved %d sequences from %s to other replicas (recompute)", len(moved), src.name)
    return moved


async def connect_lane(config: RouterConfig, metrics: Metrics, target: TargetClient, draft_address: str | None,
                       fingerprint: str) -> Lane:
    """GetInfo on the target (raises ServiceDown), then the draft handshake with its lease
    (IncompatibleDraft is raised; a draft unreachable or leased elsewhere is retried in the background).
    The caller holds the target's lease already."""
    address = target.address
    info = await target.info()
    draft = DraftLane(DraftClient(draft_address, config.draft_timeout_s, config.draft_tls, config.router_id)
                      if draft_address else None, metrics, config.draft_retry_s, config.lease_ttl_s)
    await draft.connect(info.tokenizer_fingerprint or fingerprint, info.vocab_size)
    budget = min(config.max_num_batched_tokens, info.max_batch_tokens or config.max_num_batched_tokens)
    if budget < config.max_num_seqs:
        raise IncompatibleLimits(f"target {address} takes at most {info.max_batch_tokens} tokens per step, fewer than "
                                 f"the router's --max-num-seqs {config.max_num_seqs}: every running decode needs one")
    if budget < config.max_num_batched_tokens:
        log.warning("target %s takes at most %d tokens per step: the router's --max-num-batched-tokens %d is clamped "
                    "to it for this replica", address, info.max_batch_tokens, config.max_num_batched_tokens)
    if config.k_max > info.max_draft_tokens:
        log.warning("target %s verifies at most %d draft tokens per sequence: --num-speculative-tokens %d is clamped "
                    "to it for this replica", address, info.max_draft_tokens, config.k_max)
    prefix = PrefixCaches(info.block_size, metrics.prefix_queries, metrics.prefix_hits, metrics.prefix_misses) \
        if config.prefix_caching and info.prefix_caching else None
    scheduler = Scheduler(config, CacheGeometry(info.free_blocks, info.block_size), None, budget, prefix)
    return Lane(target=target, draft=draft, info=info, scheduler=scheduler, down_since=time.monotonic())


class IncompatibleLimits(RuntimeError):
    """A target's limits leave the router's configuration no room: refuse to start, naming both."""


def publish_gauges(lanes: list[Lane], metrics: Metrics) -> None:
    """Queue, running and KV gauges, in total and per replica."""
    metrics.target_up.set(int(any(lane.up for lane in lanes)))
    drafts = [lane.draft.up for lane in lanes if lane.draft.client is not None]
    metrics.draft_up.set(int(bool(drafts) and all(drafts)))
    metrics.waiting.set(sum(len(lane.scheduler.waiting) for lane in lanes))
    metrics.running.set(sum(len(lane.scheduler.running) for lane in lanes))
    used = {"target": 0, "draft": 0}
    total = {"target": 0, "draft": 0}
    for lane in lanes:
        t, d = lane.scheduler.usage()
        metrics.replica_running.labels(replica=lane.name).set(len(lane.scheduler.running))
        metrics.replica_waiting.labels(replica=lane.name).set(len(lane.scheduler.waiting))
        metrics.replica_kv_usage.labels(replica=lane.name, service="target").set(t / lane.scheduler.target.num_blocks)
        used["target"] += t
        total["target"] += lane.scheduler.target.num_blocks
        if lane.scheduler.draft:
            used["draft"] += d
            total["draft"] += lane.scheduler.draft.num_blocks
    for service in ("target", "draft"):
        if total[service]:
            metrics.kv_usage.labels(service=service).set(used[service] / total[service])
