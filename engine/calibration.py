"""How a CPU runs products of few rows fastest, measured on the model's own weights when it loads
(the ways, and why each exists: engine/linear.py). Each way is timed in turn, best of a few repeats;
another way is taken only where it clearly beats the product as is."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.linear import PAD_TO, Linear, SmallProducts, can_halve, can_pack, half_product, linears, packed_product, use

log = logging.getLogger(__name__)

# Row counts timed by calibrate(): 1..PAD_TO each, and above it the points up to which the packed way
# may run (a count between two points takes the way of the point above it; above the last, as is).
POINTS = (1, 2, 3, 4, 8, 16, 32, 64, 128)
PAYS = 0.9  # another way must save 10% of the time as is: a smaller difference is timing noise
PAD_COST_MS = 0.01  # ... and more per layer than the padding itself costs (a cat and a slice: ~6 µs)
# Column-major copies only for linears this many times the largest cache: weights that stream from
# memory anyway. Near the cache's size the two copies evict each other: the demo target (28 MiB of
# linears, a 32 MiB L3) timed faster column-major alone, then served (6) at c=1 with 16.1 ms target
# steps against 10.5-12.4 ms without the copies.
STREAMED = 4


def pass_ms(layers: list[Linear], rows: int, way: str = "rows") -> float:
    """The time of one product of `rows` rows with every layer's weight, in model order: like a
    forward, each weight comes from memory, not from a cache warmed by the call before. way: rows
    (as is), columns (the column-major copy), packed (oneDNN's copy) or half (the fp16 copy). Repeats:
    interleaved_ms."""
    inputs = {f: torch.zeros(rows, f, device=layers[0].weight.device, dtype=layers[0].weight.dtype)
              for f in {layer.in_features for layer in layers}}
    product: Callable[[Linear], torch.Tensor] = {
        "rows": lambda layer: F.linear(inputs[layer.in_features], layer.weight, layer.bias),
        "columns": lambda layer: torch.mm(inputs[layer.in_features], layer.weight_t),
        "packed": lambda layer: packed_product(inputs[layer.in_features], layer.weight_packed, layer.bias),
        "half": lambda layer: half_product(inputs[layer.in_features], layer.weight_half, layer.bias_or_zeros),
    }[way]
    with torch.inference_mode():
        t0 = time.perf_counter()
        for layer in layers:
            product(layer)
        return (time.perf_counter() - t0) * 1e3


def interleaved_ms(layers: list[Linear], ways: dict[str, list[int]], repeats: int) -> dict[str, dict[int, float]]:
    """Best-of-`repeats` pass_ms per way and row count, every way timed once per count in each repeat
    before the next repeat starts: a neighbour that takes the cores for a while (the other service
    loading beside this one on shared cores) slows every way alike. Timed way after way, it had slowed
    SmolLM2's as-is products to 55-65 ms for 1-3 rows (alone: 21-25) and its target then served one-row
    decodes packed, 25-30% slower, in every stack that started its draft beside it."""
    best = {way: {rows: float("inf") for rows in counts} for way, counts in ways.items()}
    for _ in range(repeats):
        for rows in sorted({r for counts in ways.values() for r in counts}):
            for way, counts in ways.items():
                if rows in counts:
                    best[way][rows] = min(best[way][rows], pass_ms(layers, rows, way))
    return best


def choose(row_major: dict[int, float], column_major: dict[int, float], num_layers: int,
           packed: dict[int, float] | None = None, half: dict[int, float] | None = None) -> SmallProducts:
    """Per row count 1..PAD_TO, the fastest way to run it (ms over all layers), where it clearly beats as
    is; above PAD_TO, packed up to the last timed count where it clearly wins before as is clearly wins.
    Then the fp16 way (timed only for fp16 weights) takes the counts from 1 up to the last timed one
    where it clearly beats whatever runs them otherwise, before that clearly beats it."""
    packed, half = packed or {}, half or {}
    inf = float("inf")

    def clearly(ms: float, as_is: float) -> bool:
        return ms < PAYS * as_is and as_is - ms > PAD_COST_MS * num_layers

    chosen: dict[int, tuple[str, float]] = {}
    for rows in sorted((r for r in row_major if r <= PAD_TO), key=lambda r: r != PAD_TO):  # PAD_TO first
        as_is = row_major[rows]
        ways = {"columns": column_major.get(rows, inf), "packed": packed.get(rows, inf)}
        if rows < PAD_TO and PAD_TO in chosen:
            ways["padded"] = chosen[PAD_TO][1]
        way, ms = min(ways.items(), key=lambda w: w[1])
        chosen[rows] = (way, ms) if clearly(ms, as_is) else ("rows", as_is)
    def reach(counts: list[int], way: dict[int, float], other: dict[int, float]) -> int:
        """The last count where `way` clearly beats `other`, before the first where `other` clearly beats
        it. A tie (within PAYS: timing noise) neither extends the range nor ends it: stopping at one had
        spread the demo target's packed range over 0 to 128 rows across one bench's launches (a tie at
        32 rows dropped 64 and 128, where packed won by 10-30%)."""
        up_to = 0
        for rows in counts:
            if clearly(way.get(rows, inf), other[rows]):
                up_to = rows
            elif clearly(other[rows], way.get(rows, inf)):
                break
        return up_to

    packed_up_to = reach(sorted(r for r in row_major if r > PAD_TO), packed, row_major)
    otherwise = {r: chosen[r][1] if r in chosen else packed[r] if r <= packed_up_to else row_major[r]
                 for r in row_major}
    half_up_to = reach(sorted(row_major), half, otherwise)
    return SmallProducts(*(frozenset(r for r, (way, _) in chosen.items() if way == w and r > half_up_to)
                           for w in ("padded", "columns", "packed")),
                         packed_up_to=packed_up_to if packed_up_to > half_up_to else 0, half_up_to=half_up_to)


def calibrate(model: nn.Module, repeats: int = 3) -> SmallProducts:
    """Measure, on a CPU, how products of few rows run fastest; set it on every layer. Call it once the
    weights are final: the column-major, packed and fp16 copies are taken here."""
    layers = linears(model)
    if not layers or layers[0].weight.device.type != "cpu":
        return SmallProducts()
    packing, halving = can_pack(layers[0].weight), can_halve(layers)
    counts = [r for r in POINTS if r <= PAD_TO or packing or halving]
    size, cache = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers), largest_cache_bytes()
    streamed = cache > 0 and size >= STREAMED * cache
    use(layers, SmallProducts(by_columns=frozenset(range(1, PAD_TO + 1)) if streamed else frozenset(),
                              packed=frozenset(counts) if packing else frozenset()),
        half=halving)  # the copies, to time them
    timed = interleaved_ms(layers, {"rows": counts,
                                    "columns": [r for r in counts if streamed and r <= PAD_TO],
                                    "packed": counts if packing else [],
                                    "half": counts if halving else []}, repeats)
    small = choose(timed["rows"], timed["columns"], len(layers), timed["packed"], timed["half"])
    use(layers, small)
    log.info("CPU products of %s rows over the model's %d linears (%.0f MiB; cache %.0f MiB): as is %s ms, "
             "column-major %s, oneDNN-packed %s, fp16 copy %s -> fp16 copy: %s; padded to %d: %s; "
             "column-major: %s; packed: %s%s",
             "/".join(map(str, counts)), len(layers), size / 2**20, cache / 2**20, _times(timed["rows"], counts),
             _times(timed["columns"], counts) if streamed else f"not tried (under {STREAMED}x the cache)",
             _times(timed["packed"], counts) if packing else "not available",
             _times(timed["half"], counts) if halving else "not tried (weights not all fp16 values, or no fbgemm)",
             f"1-{small.half_up_to}" if small.half_up_to else "none", PAD_TO, _rows(small.padded),
             _rows(small.by_columns), _packed(small), _copies(small, size))
    return small


def largest_cache_bytes(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The CPU's largest cache (Linux sysfs); 0 where unknown, which rules column-major copies out."""
    sizes = []
    for index in caches.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text[:-1] if scale > 1 else text
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=0)


def _rows(rows: frozenset[int]) -> str:
    return ", ".join(map(str, sorted(rows))) or "none"


def _times(ms: dict[int, float], counts: list[int]) -> str:
    return "/".join(f"{ms[r]:.1f}" if r in ms else "-" for r in counts)


def _packed(small: SmallProducts) -> str:
    rows = sorted(small.packed) + ([f"{PAD_TO + 1}-{small.packed_up_to}"] if small.packed_up_to > PAD_TO else [])
    return ", ".join(map(str, rows)) or "none"


def _copies(small: SmallProducts, size: int) -> str:
    copies = [name for name, used in (("column-major", small.by_columns),
                                      ("packed", small.uses_packed)) if used]
    return (f" ({' and '.join(copies)} copies of the weights, {size / 2**20:.0f} MiB each)" if copies else "") + \
        (f" (an fp16 copy of the weights, {size / 2**21:.0f} MiB)" if small.half_up_to else "")
