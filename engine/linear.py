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

Where every weight is a half-precision value (a checkpoint stored in fp16, as model_zoo writes
SmolLM2), there is a fifth way: fbgemm's product over a packed fp16 copy, which reads half the bytes
and computes in fp32 (each fp16 weight widened exactly), so its products are the fp32 products of the
same weights, summed in another order. On the AVX2 EPYC above, SmolLM2's linears:

    rows           1      2      3      4      5      8
    fp32 best     43     62     78     81     83     95  ms
    fp16 copy     23     30     29     31     31     49  ms

a decode step 59 -> 44 ms and a step verifying 4 drafts 128 -> 49 ms: what lets speculation pay on
such a CPU. A weight that is not exactly an fp16 value never takes this way (it would change the model).

Which way pays is measured on the model's own weights when it loads (engine/calibration.py), never assumed:
other CPUs and BLAS builds have no such steps, and on a GPU the question does not arise.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

PAD_TO = 4
PACK_HINT = 8  # the batch size oneDNN lays the packed weight out for (1 and 64 timed no better)
# torch marks its fbgemm fp16 ops deprecated; the torch pin keeps them, and can_halve() probes for them.
warnings.filterwarnings("ignore", message=r"fbgemm_\w+ is deprecated", category=UserWarning)


@dataclass(frozen=True)
class SmallProducts:
    """How products of few rows run: every count up to `half_up_to` against the fp16 copy (weights that
    are fp16 values only); else `padded` row counts as PAD_TO rows, `by_columns` against the
    column-major copy, `packed` (and every count above PAD_TO up to `packed_up_to`) against a copy
    packed for oneDNN; every other row count as is."""

    padded: frozenset[int] = frozenset()
    by_columns: frozenset[int] = frozenset()
    packed: frozenset[int] = frozenset()
    packed_up_to: int = 0
    half_up_to: int = 0

    def __post_init__(self) -> None:
        assert not any(r <= self.half_up_to for r in self.padded | self.by_columns | self.packed), \
            "a count the fp16 way runs needs no other way"

    def packs(self, rows: int) -> bool:
        return rows in self.packed or PAD_TO < rows <= self.packed_up_to

    @property
    def uses_packed(self) -> bool:
        """Whether some row count runs against the packed copy (which is kept only then)."""
        return bool(self.packed) or self.packed_up_to > PAD_TO


def packed_product(x: torch.Tensor, weight_packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T (+ b) by oneDNN, W packed by torch.ops.mkldnn._reorder_linear_weight."""
    return torch.ops.mkldnn._linear_pointwise(x, weight_packed, bias, "none", [], "")


def half_product(x: torch.Tensor, weight_half: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x @ W^T + b by fbgemm in fp32 over W stored as fp16 (torch.fbgemm_pack_gemm_matrix_fp16)."""
    return torch.fbgemm_linear_fp16_weight(x, weight_half, bias)


class Linear(nn.Linear):
    """nn.Linear that runs 2-D inputs of few rows the way `small` says (set by calibrate())."""

    small: SmallProducts = SmallProducts()
    weight_t: torch.Tensor | None = None  # [in, out] contiguous: only while small.by_columns needs it
    weight_packed: torch.Tensor | None = None  # oneDNN's layout: only while small packs some row count
    weight_half: torch.Tensor | None = None  # fbgemm's fp16 copy: only while small.half_up_to > 0
    bias_or_zeros: torch.Tensor | None = None  # the bias fbgemm adds (it needs one)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T (+ b), the way `small` says. Not forward: a subclass's forward (engine.model's
        ReducedHead widens its output) must not run again on the padded rows."""
        if x.dim() == 2:
            rows = x.shape[0]
            if 0 < rows <= self.small.half_up_to:
                assert self.weight_half is not None and self.bias_or_zeros is not None
                return half_product(x, self.weight_half, self.bias_or_zeros)
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


def use(layers: list[Linear], small: SmallProducts, half: bool = False) -> None:
    """Run these layers' small products as `small` says, with column-major, packed or fp16 copies where
    it needs them (or `half` asks for the fp16 one, to time it), and none where it does not."""
    with torch.no_grad():
        for layer in layers:
            layer.small = small
            if not (half or small.half_up_to):
                layer.weight_half = layer.bias_or_zeros = None
            elif layer.weight_half is None:
                assert torch.equal(layer.weight.half().float(), layer.weight), "the fp16 copy must be the same weight"
                layer.weight_half = torch.fbgemm_pack_gemm_matrix_fp16(layer.weight.detach())
                layer.bias_or_zeros = layer.bias.detach() if layer.bias is not None else layer.weight.new_zeros(
                    layer.out_features)
            if not small.by_columns:
                layer.weight_t = None
            elif layer.weight_t is None:
                layer.weight_t = layer.weight.t().contiguous()
            if not small.uses_packed:
                layer.weight_packed = None
            elif layer.weight_packed is None:
                layer.weight_packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), PACK_HINT)


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


def can_halve(layers: list[Linear]) -> bool:
    """Whether the fp16 way may run these layers: this torch build runs fbgemm's fp16 product on this
    CPU, and every weight is exactly an fp16 value (an fp16 copy is then the same weight)."""
    if not layers or layers[0].weight.device.type != "cpu" or layers[0].weight.dtype != torch.float32:
        return False
    try:
        out = half_product(torch.ones(2, 8), torch.fbgemm_pack_gemm_matrix_fp16(torch.ones(4, 8)), torch.zeros(4))
        if not torch.equal(out, torch.full((2, 4), 8.0)):
            return False
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    with torch.no_grad():
        return all(torch.equal(layer.weight.half().float(), layer.weight) for layer in layers)
