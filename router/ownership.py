"""Sharing model replicas between routers: each replica serves the router holding its lease
(engine/lease.py), and every router takes about its fair part, total / routers.

    router A holds t0 t1        router B starts: claims t0 t1, refused, but both now list B
    A renews: routers {A, B}, share 1: A drains t1 (its sequences finish or move) and gives it up
    B claims t1                 A dies: its leases run out; B claims t0 within ttl + one renewal

How many routers share the replicas comes from the services themselves (every lease answer lists
the routers that asked within the last ttl), so routers need no discovery of one another.
"""

from __future__ import annotations

import math
import time

from router.clients import _Client
from router.config import RouterConfig
from tandem.v1 import common_pb2


class Ownership:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.me = config.router_id
        self._sharers: dict[str, float] = {}  # router -> until when it counts (monotonic)
        self.elsewhere: dict[str, str] = {}  # replica address -> the other router holding it

    def note(self, address: str, lease: common_pb2.LeaseResponse) -> None:
        until = time.monotonic() + self.config.lease_ttl_s
        for router in lease.routers:
            self._sharers[router] = until
        if lease.granted:
            self.elsewhere.pop(address, None)
        elif lease.owner:
            self.elsewhere[address] = lease.owner
        else:
            self.elsewhere.pop(address, None)

    def routers(self) -> int:
        now = time.monotonic()
        self._sharers = {r: until for r, until in self._sharers.items() if until > now}
        return len(set(self._sharers) | {self.me})

    def share(self, total: int) -> int:
        """How many of `total` replicas this router should hold (at least one when there are any)."""
        return max(1, math.ceil(total / self.routers())) if total else 0

    async def claim(self, client: _Client) -> bool:
        """Claim or renew this router's lease on client's service (ServiceDown propagates)."""
        lease = await client.lease(self.config.lease_ttl_s)
        self.note(client.address, lease)
        return lease.granted
