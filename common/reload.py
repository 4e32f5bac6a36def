"""Files a running process re-reads when they change: certificates and API-key files, which
Kubernetes rotates in place (a Secret volume swaps a symlink; cert-manager renews before expiry).

A FileSet notices a change by its files' signatures (mtime, inode, size), looked at no more than
every `poll_s` seconds by whoever uses the files, so the check costs nothing on a hot path.
SIGHUP (or reload_all()) makes every FileSet re-read at its next use, changed or not."""

from __future__ import annotations

import os
import signal
import threading
import time
import weakref
from collections.abc import Iterable
from pathlib import Path

POLL_S = 2.0
_live: weakref.WeakSet[FileSet] = weakref.WeakSet()


class FileSet:
    def __init__(self, paths: Iterable[Path], poll_s: float = POLL_S) -> None:
        self.paths = tuple(paths)
        self.poll_s = poll_s
        self._lock = threading.Lock()  # gRPC calls certificate fetchers on its own threads
        self._forced = False
        self._next = 0.0
        self.seen = self.signature()
        _live.add(self)

    def signature(self) -> tuple:
        sig = []
        for p in self.paths:
            try:
                st = os.stat(p)
                sig.append((st.st_mtime_ns, st.st_ino, st.st_size))
            except OSError:
                sig.append(None)
        return tuple(sig)

    def due(self) -> tuple | None:
        """The new signature when the files should be re-read now (changed, or forced); else None.
        The caller re-reads and then calls accept(signature) if the new contents were good."""
        now = time.monotonic()
        with self._lock:
            if not self._forced and now < self._next:
                return None
            forced, self._forced, self._next = self._forced, False, now + self.poll_s
        sig = self.signature()
        return sig if forced or sig != self.seen else None

    def accept(self, signature: tuple) -> None:
        self.seen = signature

    def force(self) -> None:
        with self._lock:
            self._forced = True


def reload_all() -> None:
    """Every live FileSet re-reads at its next use (what SIGHUP does)."""
    for files in list(_live):
        files.force()


def reload_on_sighup(loop=None) -> None:  # noqa: ANN001 - an asyncio loop
    """SIGHUP -> reload_all(), through the event loop when given (else a plain handler, e.g. while
    a model loads: SIGHUP's default action would end the process). Main thread only (signal
    handlers live there); elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        return
    if loop is not None:
        loop.add_signal_handler(signal.SIGHUP, reload_all)
    else:
        signal.signal(signal.SIGHUP, lambda *_: reload_all())
