"""The engine's linear layer, and the CPU quirks it works around.

A BLAS may run a product with 2 or 3 input rows as that many matrix-vector passes, each streaming
the whole weight from memory, and block it as a GEMM (one pass over the weight) only from 4 rows;
and its matrix-vector kernel may stream a row-major weight (nn.Linear's [out, in]) slower than a
column-major one. Measured with MKL on an AVX2 AMD EPYC, one thread, SmolLM2-135M's 121 linears with
cold weights, as in a forward:

    rows           1      2      3      4      8     64
    row-major     47     80    109     71     80    301  ms
    column-major  33     50     74     83     96    303  ms

On an AVX-512 Xeon the same MKL runs 1-3 rows well and 4-12 badly, while oneDNN's linear over a weight
packed for it (the kernel torch's CPU compiler uses) stays near a decode's cost:

    rows           1      2      3      4      5      8     16     64    256
    row-major     46     50     54     87     87    121    108    184    512  ms
    packed        50     53     55     50     52     62     79    158    505  ms

A decode is 1 row; a target verifying k drafts for one sequence runs k + 1, so a verification cost up
to twice a decode and speculation could not pay. Each small row count therefore runs whichever way is
fastest: as is, padded to 4 rows (zeros, dropped after), against a column-major copy of the weight
(tried only for linears far larger than the CPU's cache, which stream from memory either way), or
against the packed copy; a copy is kept only where some row count uses it (the linears' memory again).

Which way pays is measured on the model's own weights when it loads (`calibrate`), never assumed:
other CPUs and BLAS builds have no such steps, and on a GPU the question does not arise.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

PAD_TO = 4
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
PACK_HINT = 8  # the batch size oneDNN lays the packed weight out for (1 and 64 timed no better)


@dataclass(frozen=True)
class SmallProducts:
    """How products of few rows run: `padded` row counts as PAD_TO rows, `by_columns` against the
    column-major copy, `packed` (and every count above PAD_TO up to `packed_up_to`) against a copy
    packed for oneDNN; every other row count as is."""

    padded: frozenset[int] = frozenset()
    by_columns: frozenset[int] = frozenset()
    packed: frozenset[int] = frozenset()
    packed_up_to: int = 0

    def packs(self, rows: int) -> bool:
        return rows in self.packed or PAD_TO < rows <= self.packed_up_to

    @property
    def uses_packed(self) -> bool:
        """Whether some row count runs against the packed copy (which is kept only then)."""
        return bool(self.packed) or self.packed_up_to > PAD_TO


def packed_product(x: torch.Tensor, weight_packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T (+ b) by oneDNN, W packed by torch.ops.mkldnn._reorder_linear_weight."""
    return torch.ops.mkldnn._linear_pointwise(x, weight_packed, bias, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear that runs 2-D inputs of few rows the way `small` says (set by calibrate())."""

    small: SmallProducts = SmallProducts()
    weight_t: torch.Tensor | None = None  # [in, out] contiguous: only while small.by_columns needs it
    weight_packed: torch.Tensor | None = None  # oneDNN's layout: only while small packs some row count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T (+ b), the way `small` says. Not forward: a subclass's forward (engine.model's
        ReducedHead widens its output) must not run again on the padded rows."""
        if x.dim() == 2:
            rows = x.shape[0]
            if self.small.packs(rows):
                assert self.weight_packed is not None
                return packed_product(x, self.weight_packed, self.bias)
            if rows in self.small.by_columns:
                assert self.weight_t is not None
                return torch.mm(x, self.weight_t) if self.bias is None else torch.addmm(self.bias, x, self.weight_t)
            if rows in self.small.padded:
                padded = torch.cat([x, x.new_zeros(PAD_TO - rows, x.shape[1])])
                return self._product(padded)[:rows]  # PAD_TO rows, the way chosen for them
        return F.linear(x, self.weight, self.bias)


def linears(model: nn.Module) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


def pass_ms(layers: list[Linear], rows: int, way: str = "rows") -> float:
    """The time of one product of `rows` rows with every layer's weight, in model order: like a
    forward, each weight comes from memory, not from a cache warmed by the call before. way: rows
    (as is), columns (the column-major copy) or packed (oneDNN's copy). Repeats: interleaved_ms."""
    inputs = {f: torch.zeros(rows, f, device=layers[0].weight.device, dtype=layers[0].weight.dtype)
              for f in {layer.in_features for layer in layers}}
    product: Callable[[Linear], torch.Tensor] = {
        "rows": lambda layer: F.linear(inputs[layer.in_features], layer.weight, layer.bias),
        "columns": lambda layer: torch.mm(inputs[layer.in_features], layer.weight_t),
        "packed": lambda layer: packed_product(inputs[layer.in_features], layer.weight_packed, layer.bias),
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
           packed: dict[int, float] | None = None) -> SmallProducts:
    """Per row count 1..PAD_TO, the fastest way to run it (ms over all layers), where it clearly beats as
    is; above PAD_TO, packed up to the last timed count from which on it clearly wins at every one."""
    packed = packed or {}
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
    packed_up_to = 0
    for rows in sorted(r for r in row_major if r > PAD_TO):
        if not clearly(packed.get(rows, inf), row_major[rows]):
            break
        packed_up_to = rows
    return SmallProducts(*(frozenset(r for r, (way, _) in chosen.items() if way == w)
                           for w in ("padded", "columns", "packed")), packed_up_to=packed_up_to)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether this torch build runs oneDNN's packed linear on this CPU (x86 builds do)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.zeros(8, 8, dtype=weight.dtype)
        out = packed_product(torch.ones(2, 8, dtype=weight.dtype),
                             torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT), None)
        return tuple(out.shape) == (2, 8)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def calibrate(model: nn.Module, repeats: int = 3) -> SmallProducts:
    """Measure, on a CPU, how products of few rows run fastest; set it on every layer. Call it once the
    weights are final: the column-major and packed copies are taken here."""
    layers = linears(model)
    if not layers or layers[0].weight.device.type != "cpu":
        return SmallProducts()
    packing = can_pack(layers[0].weight)
    counts = [r for r in POINTS if r <= PAD_TO or packing]
    size, cache = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers), largest_cache_bytes()
    streamed = cache > 0 and size >= STREAMED * cache
    use(layers, SmallProducts(by_columns=frozenset(range(1, PAD_TO + 1)) if streamed else frozenset(),
                              packed=frozenset(counts) if packing else frozenset()))  # the copies, to time them
    timed = interleaved_ms(layers, {"rows": counts,
                                    "columns": [r for r in counts if streamed and r <= PAD_TO],
                                    "packed": counts if packing else []}, repeats)
    row_major, column_major, packed = timed["rows"], timed["columns"], timed["packed"]
    small = choose(row_major, column_major, len(layers), packed)
    use(layers, small)
    log.info("CPU products of %s rows over the model's %d linears (%.0f MiB; cache %.0f MiB): as is %s ms, "
             "column-major %s, oneDNN-packed %s -> padded to %d: %s; column-major: %s; packed: %s%s",
             "/".join(map(str, counts)), len(layers), size / 2**20, cache / 2**20, _times(row_major, counts),
             _times(column_major, counts) if streamed else f"not tried (under {STREAMED}x the cache)",
             _times(packed, counts) if packing else "not available", PAD_TO, _rows(small.padded),
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


def use(layers: list[Linear], small: SmallProducts) -> None:
    """Run these layers' small products as `small` says, with column-major or packed copies where it
    needs them (and none where it does not)."""
    with torch.no_grad():
        for layer in layers:
            layer.small = small
            if not small.by_columns:
                layer.weight_t = None
            elif layer.weight_t is None:
                layer.weight_t = layer.weight.t().contiguous()
            if not small.uses_packed:
                layer.weight_packed = None
            elif layer.weight_packed is None:
                layer.weight_packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), PACK_HINT)


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
    return f" ({' and '.join(copies)} copies of the weights, {size / 2**20:.0f} MiB each)" if copies else ""
