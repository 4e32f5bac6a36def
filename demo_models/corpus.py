"""Training corpus: the Python standard library's own ``.py`` sources.

The selection is deterministic for a given stdlib: files are walked in sorted order, test
suites, ``site-packages`` and machine-specific files are skipped, oversized files are dropped,
and the walk stops at a total byte cap. The held-out split is made BY FILE, from a stable hash
of each file's path relative to the stdlib root, so no held-out file leaks into training.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass

# Directory names never descended into (test suites, third-party code, caches).
SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "__pycache__",
        "pydoc_data",  # one 750 kB file of prose
        "encodings",  # generated codec tables, trivially predictable
    }
)
# File name prefixes skipped: generated per machine, so they would break determinism across hosts.
SKIP_PREFIXES = ("_sysconfigdata",)


@dataclass(frozen=True)
class SourceFile:
    relpath: str  # POSIX-style path relative to the stdlib root
    text: str


@dataclass(frozen=True)
class Corpus:
    root: str
    train: tuple[SourceFile, ...]
    heldout: tuple[SourceFile, ...]

    @property
    def fingerprint(self) -> str:
        """Hash of every selected path and its contents: part of the build's settings hash."""
        h = hashlib.sha256()
        for f in self.train + self.heldout:
            h.update(f.relpath.encode())
            h.update(b"\0")
            h.update(hashlib.sha256(f.text.encode()).digest())
        return h.hexdigest()[:16]

    def stats(self) -> dict:
        return {
            "root": self.root,
            "train_files": len(self.train),
            "heldout_files": len(self.heldout),
            "train_chars": sum(len(f.text) for f in self.train),
            "heldout_chars": sum(len(f.text) for f in self.heldout),
        }


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_heldout(relpath: str, heldout_percent: int) -> bool:
    """Stable split by file: sha256 of the relative path, not Python's salted hash()."""
    digest = hashlib.sha256(relpath.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < heldout_percent


def iter_source_paths(root: str):
    """Yield (relpath, abspath) of candidate .py files in a deterministic (sorted) order."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-"))
        for name in sorted(filenames):
            if not name.endswith(".py") or name.startswith(SKIP_PREFIXES):
                continue
            abspath = os.path.join(dirpath, name)
            relpath = os.path.relpath(abspath, root).replace(os.sep, "/")
            yield relpath, abspath


def load_corpus(
    max_file_bytes: int = 200_000,
    max_total_bytes: int = 12_000_000,
    heldout_percent: int = 5,
    root: str | None = None,
) -> Corpus:
    """Read the stdlib sources. Files over ``max_file_bytes`` or not valid UTF-8 are skipped;
    reading stops once ``max_total_bytes`` have been collected."""
    root = root or stdlib_root()
    train: list[SourceFile] = []
    heldout: list[SourceFile] = []
    total = 0
    for relpath, abspath in iter_source_paths(root):
        size = os.path.getsize(abspath)
        if size == 0 or size > max_file_bytes:
            continue
        if total + size > max_total_bytes:
            break
        try:
            with open(abspath, encoding="utf-8") as fh:
                text = fh.read()
        except (UnicodeDecodeError, OSError):
            continue
        total += size
        f = SourceFile(relpath, text)
        (heldout if is_heldout(relpath, heldout_percent) else train).append(f)
    if not train or not heldout:
        raise RuntimeError(f"corpus from {root} is too small: {len(train)} train / {len(heldout)} held-out files")
    return Corpus(root=root, train=tuple(train), heldout=tuple(heldout))
