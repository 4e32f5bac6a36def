"""The engine's linear layer, and a CPU quirk it works around.

A BLAS may run a product with 2 or 3 input rows as that many matrix-vector passes, each streaming
the whole weight from memory, and block it as a GEMM (one pass over the weight) only from 4 rows.
Measured with MKL on an AVX2 AMD EPYC, one thread, over SmolLM2-135M's layers (cold weights, as in
a forward): 1 row 36 ms, 2 rows 64-68 ms, 3 rows 76-81 ms, 4 rows 49-68 ms. A target verifying
k = 1 or 2 drafts for one sequence runs exactly such products, so its step cost up to twice a decode
and speculation could not pay. Run them padded to 4 rows (zeros, dropped after) and they cost what
4 rows do.

Whether it pays is measured on the model's own weights when it loads (`calibrate`), never assumed:
other CPUs and BLAS builds have no such step, and on a GPU the question does not arise.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

PAD_TO = 4
PAYS = 0.9  # padding must save 10% of the unpadded time: a smaller difference is timing noise
PAD_COST_MS = 0.01  # ... and more per layer than the padding itself costs (a cat and a slice: ~6 µs)


class Linear(nn.Linear):
    """nn.Linear that runs a 2-D input of `pad_rows` rows padded to PAD_TO rows."""

    pad_rows: frozenset[int] = frozenset()  # set per module by calibrate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if x.dim() == 2 and rows in self.pad_rows:
            padded = torch.cat([x, x.new_zeros(PAD_TO - rows, x.shape[1])])
            return super().forward(padded)[:rows]
        return super().forward(x)


def linears(model: nn.Module) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


def pass_ms(layers: list[Linear], rows: int, repeats: int) -> float:
    """Best-of-`repeats` time of one product of `rows` rows with every layer's weight, in model order:
    like a forward, each weight comes from memory, not from a cache warmed by the call before."""
    inputs = {f: torch.zeros(rows, f, device=layers[0].weight.device, dtype=layers[0].weight.dtype)
              for f in {layer.in_features for layer in layers}}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            for layer in layers:
                F.linear(inputs[layer.in_features], layer.weight, layer.bias)
            best = min(best, time.perf_counter() - t0)
    return best * 1e3


def padded_rows(ms: dict[int, float], num_layers: int) -> frozenset[int]:
    """The row counts below PAD_TO whose products (ms[rows], over all layers) clearly cost more than
    PAD_TO rows do."""
    return frozenset(rows for rows in range(2, PAD_TO)
                     if ms[PAD_TO] < PAYS * ms[rows] and ms[rows] - ms[PAD_TO] > PAD_COST_MS * num_layers)


def calibrate(model: nn.Module, repeats: int = 3) -> frozenset[int]:
    """Measure, on a CPU, which row counts below PAD_TO run faster padded; set them on every layer."""
    layers = linears(model)
    if not layers or layers[0].weight.device.type != "cpu":
        return frozenset()
    ms = {rows: pass_ms(layers, rows, repeats) for rows in range(1, PAD_TO + 1)}
    pad = padded_rows(ms, len(layers))
    for layer in layers:
        layer.pad_rows = pad
    log.info("CPU products of %s rows: %s ms over the model's %d linears -> %s",
             "/".join(map(str, ms)), "/".join(f"{v:.1f}" for v in ms.values()), len(layers),
             f"{', '.join(map(str, sorted(pad)))} rows run padded to {PAD_TO}" if pad else "no padding")
    return pad
