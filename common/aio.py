"""The event loop every process runs on: uvloop where it is installed (Linux), the standard loop
otherwise. Each step crosses the router's and both services' loops several times; uvloop wakes and
dispatches faster, which is measurable at small models' step times (docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main), on uvloop when available."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
