"""The follower processes of a tensor-parallel target: ranks 1..N-1, started by rank 0 itself.

Rank 0 (the process serving gRPC) spawns them, and all N join one torch.distributed group. Each
follower loads its shard of the weights and runs every forward rank 0 sends it (ModelRunner.follow)
until rank 0 sends the stop. No follower outlives rank 0: its pipe from rank 0 closes (follow()
returns), on Linux the kernel sends it SIGKILL when its parent dies (PR_SET_PDEATHSIG), and a
watchdog thread exits when the parent is gone. Rank 0 exits when a follower dies, since every
later collective would hang.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.parallel import TensorParallel, init_group
from engine.runner import ModelRunner

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """Rank r runs on cuda:r when the service runs on CUDA; every rank shares the CPU otherwise."""
    device = config.resolved_device()
    if device.type == "cuda":
        return dataclasses.replace(config, device=f"cuda:{rank}")
    return config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with(parent: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def follower_main(rank: int, size: int, init_method: str, model_dir: str, config: EngineConfig,
                  threads: int, parent: int, pipe: Connection) -> None:
    _die_with(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    if threads:
        torch.set_num_threads(threads)
    config = rank_config(config, rank)
    tp = init_group(rank, size, init_method, config.resolved_device(), [pipe])
    runner = ModelRunner.load(model_dir, config, tp)
    forwards = runner.follow()
    log.info("rank %d stopping after %d forwards", rank, forwards)
    logging.shutdown()
    # No destroy_process_group(), no interpreter teardown: gloo's destructors racing rank 0's own
    # teardown abort the process ("terminate called without an active exception"). The OS closes
    # the sockets; rank 0 has already stopped sending.
    os._exit(0)


class Followers:
    """Ranks 1..N-1 as child processes, seen from rank 0."""

    def __init__(self, procs: list[mp.process.BaseProcess], tp: TensorParallel) -> None:
        self.procs = procs
        self.tp = tp
        self._stopping = False

    @classmethod
    def start(cls, size: int, model_dir: str | Path, config: EngineConfig, threads: int = 0) -> Followers:
        """Spawn the followers and join the group as rank 0 (returns once all N have joined)."""
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe(duplex=False) for _ in range(1, size)]  # (receive end, send end)
        procs = [ctx.Process(target=follower_main, name=f"tp-rank{r}", daemon=True,
                             args=(r, size, init_method, str(model_dir), config, threads, os.getpid(), pipes[r - 1][0]))
                 for r in range(1, size)]
        for p in procs:
            p.start()
        for receive, _ in pipes:
            receive.close()  # the followers hold them now; closing ours lets them see EOF if we die
        log.info("tensor parallel: %d ranks (%s), followers pids %s", size,
                 "nccl" if config.resolved_device().type == "cuda" else "gloo", [p.pid for p in procs])
        tp = init_group(0, size, init_method, rank_config(config, 0).resolved_device(), [s for _, s in pipes])
        return cls(procs, tp)

    def exit_if_one_dies(self) -> None:
        """Watch the followers from a thread; the serving process calls this once it is up."""
        threading.Thread(target=self._watch, daemon=True, name="tp-watch").start()

    def _watch(self) -> None:
        while not self._stopping:
            dead = [p for p in self.procs if not p.is_alive()]
            if dead and not self._stopping:
                log.error("tensor-parallel rank %s exited (code %s): rank 0 cannot run a forward without it; "
                          "exiting", dead[0].name, dead[0].exitcode)
                self.kill()
                os._exit(1)
            time.sleep(0.5)

    def stop(self, runner: ModelRunner | None, timeout: float = 10.0) -> None:
        """Broadcast the stop, wait for the followers, kill any that hang; leave the group."""
        self._stopping = True
        if runner is not None:
            try:
                runner.stop_followers()
            except Exception as e:  # a follower already gone: killing the rest is all that is left
                log.warning("could not broadcast the stop: %s", e)
        end = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, end - time.monotonic()))
        self.kill()
        if dist.is_initialized():
            dist.destroy_process_group()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)
