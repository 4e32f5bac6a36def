"""How the processes share the machine: the two modes of a run, and the stack that applies them.

shared      today's `make run`: no pinning, every process uses torch's default threads (all cores);
            the two services compete for the same cores.
two-device  the design's premise, one device per model: the target runs on core A with one thread,
            the draft on core B with one thread. The router (a separate host in the design) and
            this harness's client share core B with the draft; the target's core does nothing else.
            Target-only configs pin the target the same way, so every config gets the same target.

Pinning is `taskset -c CPU python -m ...`: the affinity is set before Python starts, so every
thread the process ever creates (torch's, gRPC's) inherits it.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from router.stack import Stack

ROOT = Path(__file__).resolve().parent.parent
MODES = ("shared", "two-device")


class ModeUnavailable(RuntimeError):
    """This machine cannot run the mode (no taskset, fewer than two cores)."""


@dataclass(frozen=True)
class Mode:
    name: str  # "shared" | "two-device"
    threads: int = 0  # torch threads per service and for the anchor (0: torch's default)
    target_cpu: int | None = None  # None: not pinned
    host_cpu: int | None = None  # draft, router and the client

    @property
    def pinned(self) -> bool:
        return self.target_cpu is not None

    def cpu_of(self, process: str) -> int | None:
        """The core a process ("target", "draft", "router", "client", "anchor") is pinned to."""
        if process in ("target", "anchor"):
            return self.target_cpu
        return self.host_cpu

    def prefix(self, process: str) -> list[str]:
        cpu = self.cpu_of(process)
        return [] if cpu is None else ["taskset", "-c", str(cpu)]

    def service_args(self) -> list[str]:
        return ["--threads", str(self.threads)] if self.threads else []

    def describe(self) -> str:
        if not self.pinned:
            return "shared: no pinning, torch's default threads in every process"
        return (f"two-device: target on core {self.target_cpu} with 1 thread; draft (1 thread), router and the "
                f"load client on core {self.host_cpu}; the anchor on core {self.target_cpu} with 1 thread")

    @contextmanager
    def client_affinity(self) -> Iterator[None]:
        """Pin this process's main thread (where the asyncio client runs) to the host core."""
        cpu = self.cpu_of("client")
        if cpu is None:
            yield
            return
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cpu})
        try:
            yield
        finally:
            os.sched_setaffinity(0, before)


def make_mode(name: str, cpus: set[int] | None = None, taskset: str | None = "auto") -> Mode:
    """The mode, checked against this machine: two-device needs taskset and two usable cores
    (the first two this process may run on)."""
    if name == "shared":
        return Mode("shared")
    if name != "two-device":
        raise ValueError(f"unknown mode {name!r}; choose from {', '.join(MODES)}")
    if taskset == "auto":
        taskset = shutil.which("taskset")
    if not taskset:
        raise ModeUnavailable("two-device mode needs `taskset` (util-linux: apt-get install util-linux) to pin "
                              "each service to its own core; it is not on PATH")
    usable = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if len(usable) < 2:
        raise ModeUnavailable(f"two-device mode is impossible here: this process may run on {len(usable)} core(s) "
                              f"({usable}); it needs two, one per model")
    return Mode("two-device", threads=1, target_cpu=usable[0], host_cpu=usable[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (0.0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: stat fields 14, 15


def affinity(pid: int) -> list[int]:
    try:
        return sorted(os.sched_getaffinity(pid))
    except OSError:
        return []


@dataclass
class PinnedStack(Stack):
    """router.stack.Stack with each process started under the mode's `taskset` prefix."""

    mode: Mode = field(default_factory=lambda: Mode("shared"))

    def __post_init__(self) -> None:
        self.wrap = {name: self.mode.prefix(name) for name in ("target", "draft", "router")}

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds each process has used so far, and this one's (the load client's)."""
        return {name: cpu_seconds(p.pid) for name, p in self.procs.items()} | {"client": time.process_time()}

    def check_pinning(self) -> dict[str, list[int]]:
        """Each process's CPU affinity as the kernel reports it; raises if a pin did not hold."""
        seen = {name: affinity(p.pid) for name, p in self.procs.items()}
        for name, cpus in seen.items():
            want = self.mode.cpu_of(name)
            if want is not None and cpus != [want]:
                raise RuntimeError(f"{name} should run on core {want} only, but its affinity is {cpus}")
        return seen
