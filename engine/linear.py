"""The engine's linear layer, and two CPU quirks it works around.

A BLAS may run a product with 2 or 3 input rows as that many matrix-vector passes, each streaming
the whole weight from memory, and block it as a GEMM (one pass over the weight) only from 4 rows;
and its matrix-vector kernel may stream a row-major weight (nn.Linear's [out, in]) slower than a
column-major one. Measured with MKL on an AVX2 AMD EPYC, one thread, SmolLM2-135M's 121 linears with
cold weights, as in a forward:

    rows           1      2      3      4      8     64
    row-major     47     80    109     71     80    301  ms
    column-major  33     50     74     83     96    303  ms

A decode is 1 row; a target verifying k = 1 or 2 drafts for one sequence runs 2-3, so it cost up to
twice a decode and speculation could not pay. Each small row count therefore runs whichever way is
fastest: as is, padded to 4 rows (zeros, dropped after), or against a column-major copy of the
weight (kept only where some row count uses it: the linears' memory twice; tried only for linears
far larger than the CPU's cache, which stream from memory either way).

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
PAYS = 0.9  # another way must save 10% of the time as is: a smaller difference is timing noise
PAD_COST_MS = 0.01  # ... and more per layer than the padding itself costs (a cat and a slice: ~6 µs)
# Column-major copies only for linears this many times the largest cache: weights that stream from
# memory anyway. Near the cache's size the two copies evict each other: the demo target (28 MiB of
# linears, a 32 MiB L3) timed faster column-major alone, then served (6) at c=1 with 16.1 ms target
# steps against 10.5-12.4 ms without the copies.
STREAMED = 4


@dataclass(frozen=True)
class SmallProducts:
    """How products of few rows run: `padded` row counts as PAD_TO rows, `by_columns` against the
    column-major copy; every other row count as is."""

    padded: frozenset[int] = frozenset()
    by_columns: frozenset[int] = frozenset()


class Linear(nn.Linear):
    """nn.Linear that runs 2-D inputs of few rows the way `small` says (set by calibrate())."""

    small: SmallProducts = SmallProducts()
    weight_t: torch.Tensor | None = None  # [in, out] contiguous: only while small.by_columns needs it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            rows = x.shape[0]
            if rows in self.small.by_columns:
                assert self.weight_t is not None
                return torch.mm(x, self.weight_t) if self.bias is None else torch.addmm(self.bias, x, self.weight_t)
            if rows in self.small.padded:
                padded = torch.cat([x, x.new_zeros(PAD_TO - rows, x.shape[1])])
                return super().forward(padded)[:rows]
        return super().forward(x)


def linears(model: nn.Module) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


def pass_ms(layers: list[Linear], rows: int, repeats: int, by_columns: bool = False) -> float:
    """Best-of-`repeats` time of one product of `rows` rows with every layer's weight, in model order:
    like a forward, each weight comes from memory, not from a cache warmed by the call before."""
    inputs = {f: torch.zeros(rows, f, device=layers[0].weight.device, dtype=layers[0].weight.dtype)
              for f in {layer.in_features for layer in layers}}
    product: Callable[[Linear], torch.Tensor] = (
        (lambda layer: torch.mm(inputs[layer.in_features], layer.weight_t)) if by_columns
        else (lambda layer: F.linear(inputs[layer.in_features], layer.weight, layer.bias)))
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            for layer in layers:
                product(layer)
            best = min(best, time.perf_counter() - t0)
    return best * 1e3


def choose(row_major: dict[int, float], column_major: dict[int, float], num_layers: int) -> SmallProducts:
    """Per row count 1..PAD_TO, the fastest way to run it (ms over all layers), where it clearly beats as is."""
    padded, by_columns = set(), set()
    for rows, as_is in row_major.items():
        ways = {"columns": column_major[rows]} | ({"padded": row_major[PAD_TO]} if rows < PAD_TO else {})
        way, ms = min(ways.items(), key=lambda w: w[1])
        if ms < PAYS * as_is and as_is - ms > PAD_COST_MS * num_layers:
            (padded if way == "padded" else by_columns).add(rows)
    return SmallProducts(frozenset(padded), frozenset(by_columns))


def calibrate(model: nn.Module, repeats: int = 3) -> SmallProducts:
    """Measure, on a CPU, how products of 1..PAD_TO rows run fastest; set it on every layer. Call it
    once the weights are final: the column-major copies are taken here."""
    layers = linears(model)
    if not layers or layers[0].weight.device.type != "cpu":
        return SmallProducts()
    counts = range(1, PAD_TO + 1)
    size, cache = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers), largest_cache_bytes()
    streamed = cache > 0 and size >= STREAMED * cache
    if streamed:
        use(layers, SmallProducts(by_columns=frozenset(counts)))  # the copies, to time them
    row_major = {rows: pass_ms(layers, rows, repeats) for rows in counts}
    column_major = {rows: pass_ms(layers, rows, repeats, by_columns=True) if streamed else float("inf")
                    for rows in counts}
    small = choose(row_major, column_major, len(layers))
    use(layers, small)
    columns = ("/".join(f"{column_major[r]:.1f}" for r in counts) + " ms" if streamed
               else f"not tried (under {STREAMED}x the cache)")
    log.info("CPU products of 1/2/3/4 rows over the model's %d linears (%.0f MiB; cache %.0f MiB): row-major %s ms, "
             "column-major %s -> padded to %d: %s; column-major: %s%s", len(layers), size / 2**20, cache / 2**20,
             "/".join(f"{row_major[r]:.1f}" for r in counts), columns, PAD_TO, _rows(small.padded),
             _rows(small.by_columns), f" (a {size / 2**20:.0f} MiB copy of the weights)" if small.by_columns else "")
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
    """Run these layers' small products as `small` says, with column-major copies where it needs them."""
    with torch.no_grad():
        for layer in layers:
            layer.small = small
            if not small.by_columns:
                layer.weight_t = None
            elif layer.weight_t is None:
                layer.weight_t = layer.weight.t().contiguous()


def _rows(rows: frozenset[int]) -> str:
    return ", ".join(map(str, sorted(rows))) or "none"
