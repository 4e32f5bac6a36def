"""LoRA adapters loaded and unloaded while the target serves (TargetService.LoadLoraAdapter and
UnloadLoraAdapter; vLLM's runtime LoRA updating). The files are read and fused off the model thread,
so steps go on meanwhile; the adapter joins or leaves the runner's table on the model thread,
between two steps. Off unless the service was started with --enable-runtime-lora."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import grpc

from engine.lora import AdapterError, LoraAdapter
from engine.rpc import Refused
from engine.runner import InvalidInput
from engine.service import ModelWorker
from tandem.v1 import common_pb2

log = logging.getLogger(__name__)

ADAPTER_NAME = re.compile(r"[A-Za-z0-9._:/-]{1,128}")
DEFAULT_MAX_LORAS = 16


class RuntimeAdapters:
    def __init__(self, worker: ModelWorker, enabled: bool, max_loras: int = DEFAULT_MAX_LORAS,
                 root: Path | None = None) -> None:
        self.worker = worker
        self.enabled = enabled
        self.max_loras = max_loras  # adapters held at once, those of --lora-modules included
        self.root = root.resolve() if root is not None else None  # loads only from directories inside it

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          "runtime LoRA loading is off: start the target with --enable-runtime-lora")

    async def load(self, name: str, path: str) -> common_pb2.LoraAdapterInfo:
        self._check_enabled()
        if not ADAPTER_NAME.fullmatch(name):
            raise InvalidInput("name", "1 to 128 letters, digits and . _ : / -")
        if not path:
            raise InvalidInput("path", "the adapter's PEFT directory is required")
        if self.root is not None and not Path(path).resolve().is_relative_to(self.root):
            raise InvalidInput("path", f"{path} is outside --runtime-lora-root {self.root}")
        runner = self.worker.runner
        if runner.tp.size > 1:
            raise InvalidInput("name", "LoRA adapters are served with one tensor-parallel rank only")
        try:
            adapter = await asyncio.to_thread(LoraAdapter.load, name, path, runner.model_config, runner.device,
                                              runner.dtype)
        except AdapterError as err:
            raise InvalidInput("path", str(err)) from None
        return (await self.worker.run(self._install, adapter)).info()

    def _install(self, adapter: LoraAdapter) -> LoraAdapter:
        """On the model thread: the adapter joins the table (the one held, if it has the same files)."""
        adapters = self.worker.runner.adapters
        held = adapters.get(adapter.name)
        if held is not None:
            if held.root != adapter.root:
                raise Refused(grpc.StatusCode.ALREADY_EXISTS, f"LoRA adapter {adapter.name!r} is loaded with other "
                                                              f"files ({held.path}): unload it first")
            return held
        if len(adapters) >= self.max_loras:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{len(adapters)} LoRA adapters are loaded, the most --max-loras allows: unload one")
        adapters[adapter.name] = adapter
        log.info("LoRA adapter %r loaded from %s: rank %d", adapter.name, adapter.path, adapter.rank)
        return adapter

    async def unload(self, name: str) -> None:
        self._check_enabled()
        await self.worker.run(self._drop, name)

    def _drop(self, name: str) -> None:
        if self.worker.runner.adapters.pop(name, None) is None:
            raise Refused(grpc.StatusCode.NOT_FOUND, f"no LoRA adapter {name!r} is loaded")
        log.info("LoRA adapter %r unloaded", name)
