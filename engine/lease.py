"""Ownership leases (common.proto LeaseRequest): a model service serves one router at a time.

    router A: Lease(A, ttl) ... renew every ttl/3 ...            (A dies)
    service:  owner A, expires t+ttl -> calls from B refused       t+ttl: owner none, every block freed
    router B: Lease(B) refused (routers seen: A, B) ... Lease(B) granted after A's expiry

A call carries its router's id in metadata; while a lease is held only the holder's calls are
served. Without any holder, calls are served as before (a single router that never asks for a
lease, a test's own client). Expiry and hand-over free everything: the router owns the truth and
recomputes what it still needs, so nothing a service drops is ever lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from common.protocol import ROUTER_METADATA
from tandem.v1 import common_pb2

log = logging.getLogger(__name__)


class NotOwner(Exception):
    """Another router holds the lease."""

    def __init__(self, owner: str) -> None:
        super().__init__(f"another router holds this service's lease ({owner})")
        self.owner = owner


class LeaseKeeper:
    def __init__(self, free_all: Callable[[], Awaitable[None]]) -> None:
        self._free_all = free_all  # drops every sequence's KV (on the model thread)
        self.owner = ""
        self.expires = 0.0  # monotonic
        self._seen: dict[str, float] = {}  # router -> until when it counts as a sharer
        self._timer: asyncio.TimerHandle | None = None

    def check(self, context: grpc.aio.ServicerContext) -> None:
        """NotOwner unless the caller holds the lease (or no one does)."""
        self._expire_if_due()
        if not self.owner:
            return
        caller = dict(context.invocation_metadata() or ()).get(ROUTER_METADATA, "")
        if caller != self.owner:
            raise NotOwner(self.owner)

    async def handle(self, request: common_pb2.LeaseRequest) -> common_pb2.LeaseResponse:
        now = time.monotonic()
        me, ttl = request.router_id, request.ttl_ms / 1000
        if not me or (ttl <= 0 and not request.release):
            raise ValueError("router_id must be set and ttl_ms > 0")
        self._seen[me] = now + max(ttl, 1.0)
        if request.release:
            if self.owner == me:
                await self._hand_over("")
        elif self.owner in ("", me) or now >= self.expires:
            if self.owner not in ("", me):
                log.warning("lease of %s expired: %s takes over; freeing what it held", self.owner, me)
                await self._hand_over(me)
            self.owner, self.expires = me, now + ttl
            self._schedule(ttl)
        self._seen = {r: until for r, until in self._seen.items() if until > now}
        return common_pb2.LeaseResponse(granted=self.owner == me, owner=self.owner,
                                        expires_in_ms=int(max(0.0, self.expires - now) * 1000) if self.owner else 0,
                                        routers=sorted(self._seen))

    def _schedule(self, ttl: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(ttl + 0.05, self._expire_if_due)

    def _expire_if_due(self) -> None:
        if self.owner and time.monotonic() >= self.expires:
            log.warning("lease of %s expired unrenewed: freeing everything it held", self.owner)
            self.owner = ""
            asyncio.get_running_loop().create_task(self._free_all())

    async def _hand_over(self, to: str) -> None:
        self.owner = to
        await self._free_all()
