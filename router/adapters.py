"""The LoRA adapters this router serves: those of its first target replica (its --lora-modules),
then vLLM's runtime updates (/v1/load_lora_adapter, /v1/unload_lora_adapter) made on every replica
this router holds. Each adapter keeps the block-hash root its targets report (a hash of its name
and files), which starts its requests' prefix hashes.

A replica joining, or back after a restart, is admitted only if it serves each adapter with the same
files: one it lacks is loaded there from the directory recorded for it (a restarted target comes back
with the adapters loaded at runtime); one it cannot load, or holds with other files, keeps it out."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from common.block_hash import ROOT
from router.clients import Rejected, ServiceDown, ServiceError, TargetClient
from tandem.v1 import common_pb2

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 120.0  # reading and fusing an adapter's files on a target
DRAIN_TIMEOUT_S = 60.0  # how long an unload waits for the requests running with the adapter


class IncompatibleTarget(RuntimeError):
    """A replica that cannot serve what this router serves."""


class AdapterUpdateFailed(Exception):
    """A runtime update refused or not made, with the HTTP status that says why and the field it names."""

    def __init__(self, status: int, message: str, param: str = "lora_name") -> None:
        super().__init__(message)
        self.status, self.param = status, param


class Adapters:
    def __init__(self) -> None:
        self.served: dict[str, common_pb2.LoraAdapterInfo] = {}
        self.draining: set[str] = set()  # being unloaded: new requests are refused
        self.loading: set[str] = set()  # being loaded: another load of the name waits for nothing, it is refused
        self._known = False

    def adopt(self, info: common_pb2.ModelInfo) -> None:
        """The first replica's adapters are the router's."""
        if not self._known:
            self.served, self._known = {a.name: a for a in info.lora}, True

    def names(self) -> list[str]:
        return sorted(n for n in self.served if n not in self.draining)

    def root(self, name: str) -> int:
        return self.served[name].block_root if name else ROOT

    def held_by(self, info: common_pb2.ModelInfo) -> bool:
        """Whether a replica serves every adapter with the same files."""
        held = {a.name: a.block_root for a in info.lora}
        return all(held.get(name) == a.block_root for name, a in self.served.items())

    async def admit(self, target: TargetClient, info: common_pb2.ModelInfo) -> None:
        """IncompatibleTarget unless the replica serves every adapter with the same files (loading
        the ones it lacks from the directories recorded for them)."""
        held = {a.name: a for a in info.lora}
        for name, want in self.served.items():
            if name not in held:
                try:
                    held[name] = await target.load_lora(name, want.path, LOAD_TIMEOUT_S)
                except (Rejected, ServiceError) as err:
                    raise IncompatibleTarget(f"target {info.model_id!r} lacks LoRA adapter {name!r} and could not "
                                             f"load it from {want.path} ({err}): start every replica with the same "
                                             "--lora-modules, or with --enable-runtime-lora") from None
                log.info("LoRA adapter %r loaded on a replica that lacked it (from %s)", name, want.path)
            if held[name].block_root != want.block_root:
                raise IncompatibleTarget(f"target {info.model_id!r} serves LoRA adapter {name!r} with other files "
                                         f"({held[name].path}) than the others ({want.path})")

    async def load(self, targets: list[TargetClient], name: str, path: str) -> None:
        """Load on every replica, or on none: a partial load is undone."""
        if name in self.served or name in self.loading:
            raise AdapterUpdateFailed(400, f"the LoRA adapter {name!r} has already been loaded")
        if not targets:
            raise AdapterUpdateFailed(503, "no target replica is up")
        self.loading.add(name)
        try:
            results = await asyncio.gather(*(t.load_lora(name, path, LOAD_TIMEOUT_S) for t in targets),
                                           return_exceptions=True)
            loaded = [(t, r) for t, r in zip(targets, results, strict=True)
                      if isinstance(r, common_pb2.LoraAdapterInfo)]
            failed = [r for r in results if not isinstance(r, common_pb2.LoraAdapterInfo)]
            if not failed and len({r.block_root for _, r in loaded}) > 1:
                failed = [ValueError("the replicas read different files at that path")]
            if failed:
                await asyncio.gather(*(t.unload_lora(name) for t, _ in loaded), return_exceptions=True)
                raise _refusal(failed[0])
            self.served[name] = loaded[0][1]
        finally:
            self.loading.discard(name)
        log.info("LoRA adapter %r loaded from %s on %d replicas", name, path, len(targets))

    async def unload(self, targets: list[TargetClient], name: str, running: Callable[[], int]) -> None:
        """Refuse new requests for it, wait (DRAIN_TIMEOUT_S at most) for those running with it to
        finish, then unload it from every replica. Still in use after that: it stays served (409)."""
        if name not in self.served or name in self.draining:
            raise AdapterUpdateFailed(404, f"the LoRA adapter {name!r} cannot be found")
        self.draining.add(name)
        try:
            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            while (n := running()) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if n:
                raise AdapterUpdateFailed(409, f"{n} requests still run with LoRA adapter {name!r} after "
                                              f"{DRAIN_TIMEOUT_S:.0f}s; it stays loaded")
            results = await asyncio.gather(*(t.unload_lora(name) for t in targets), return_exceptions=True)
            for err in results:  # a replica that lost it (NOT_FOUND) or is down may keep it: nobody names it
                if isinstance(err, Exception) and not (isinstance(err, Rejected) and err.code.name == "NOT_FOUND"):
                    log.warning("LoRA adapter %r: a replica did not unload it: %s", name, err)
            del self.served[name]
            log.info("LoRA adapter %r unloaded", name)
        finally:
            self.draining.discard(name)


def _refusal(err: BaseException) -> AdapterUpdateFailed:
    """The HTTP answer to a target's refusal to load."""
    if isinstance(err, ServiceDown):
        return AdapterUpdateFailed(503, f"a target replica is unavailable: {err}")
    if isinstance(err, Rejected):  # the target names the field: "path: ..." is the directory's fault
        return AdapterUpdateFailed(400, err.details, "lora_path" if err.details.startswith("path") else "lora_name")
    return AdapterUpdateFailed(500 if isinstance(err, ServiceError) else 400, str(err))
