"""A sequence sends the same SamplingParams message on every step: services check each distinct
message once and keep what the check returned (target_service/parsing.py, draft_service/server.py)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class CheckedOnce(Generic[T]):
    """check(*args) kept per key. A key never seen is checked in full: a failed check raises and keeps
    nothing, so a bad message is refused every time it comes. At most `kept` keys (then it starts over)."""

    def __init__(self, check: Callable[..., T], kept: int = 4096) -> None:
        self._check = check
        self._kept = kept
        self._results: dict[Hashable, T] = {}

    def get(self, key: Hashable, *args: object) -> T:
        try:
            return self._results[key]
        except KeyError:
            pass
        result = self._check(*args)
        if len(self._results) >= self._kept:
            self._results.clear()
        self._results[key] = result
        return result

    def __len__(self) -> int:
        return len(self._results)
