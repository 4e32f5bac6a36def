"""CUDA graphs for the steps the router sends most: decodes and verifications without a prompt chunk.

A decode/verify step is B sequences with 1..k+1 new tokens each. It is laid out *uniformly*: each
sequence gets Q rows (Q = the step's longest query rounded up to a bucket), its real tokens first,
padding after; the batch is padded to a bucket of B with empty sequences. Every shape is then fixed
by (B bucket, Q bucket), and everything the forward reads lives in static buffers:

    ids, positions, slot_mapping   [B * Q]   padding tokens write their K/V to a scratch block that
                                             no sequence owns (PagedKVCache's last block)
    starts                          [B]       query i of sequence b sits at starts[b] + i
    block_tables                    [B, W]    W covers max_model_len + Q positions

Causality keeps padding invisible: real query i of a sequence sees keys <= starts[b] + i, all
real; padding rows see garbage and are never read. The attention plan is built from these tensors
inside the captured region (backend.plan_uniform), so a replay needs only the buffer copies.

A graph ends at the last layer's hidden states: the final norm and lm_head run eagerly on the
rows whose logits the step wants (a vocabulary-wide output per graph would cost GBs).
One graph per (B bucket, Q bucket), captured at start-up into one shared memory pool; steps that
do not fit (a prompt chunk, a query longer than the largest Q, more sequences than the largest B)
run eagerly. `capture=False` runs the very same padded forward eagerly: that is how CPU tests hold
the layout to the eager path's logits, and how `--enforce-eager` is compared on a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from engine.attention import AttentionBackend
from engine.kv_cache import PagedKVCache
from engine.model import CausalLM, FlatBatch, ForwardContext

log = logging.getLogger(__name__)


def buckets_up_to(largest: int) -> list[int]:
    """1, 2, 4, 8, ... below `largest`, then `largest` itself."""
    out, n = [], 1
    while n < largest:
        out.append(n)
        n *= 2
    return out + [largest]


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    return next((b for b in buckets if b >= n), None)


class GraphRunner:
    def __init__(self, model: CausalLM, backend: AttentionBackend, kv_cache: PagedKVCache, *, leader: bool,
                 block_size: int, max_model_len: int, max_batch: int, max_query: int, capture: bool = True) -> None:
        """leader: this rank returns logits (a tensor-parallel follower only runs the forward)."""
        self.model, self.backend, self.kv_cache = model, backend, kv_cache
        self.leader, self.block_size = leader, block_size
        self.batch_buckets = buckets_up_to(max_batch)
        self.query_buckets = buckets_up_to(max_query)
        self.capture = capture
        dev, bs = kv_cache.k.device, block_size
        tokens = max_batch * max_query
        width = -(-(max_model_len + max_query) // bs)
        self.scratch_slot = kv_cache.scratch_block * bs
        self.ids = torch.zeros(tokens, dtype=torch.long, device=dev)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=dev)
        self.slots = torch.full((tokens,), self.scratch_slot, dtype=torch.long, device=dev)
        self.starts = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.tables = torch.zeros(max_batch, width, dtype=torch.int32, device=dev)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.runs = 0  # steps served by the padded path (replayed, or run eagerly when not capturing)

    # ---- which steps ------------------------------------------------------------------------
    def shape_for(self, batch: FlatBatch) -> tuple[int, int] | None:
        """(B bucket, Q bucket) of a decode/verify step; None for a step that must run eagerly."""
        b = bucket_for(len(batch.query_lens), self.batch_buckets)
        q = bucket_for(max(batch.query_lens), self.query_buckets)
        if b is None or q is None:
            return None
        return b, q

    # ---- the padded forward (what is captured) ---------------------------------------------------
    def _forward(self, b: int, q: int) -> torch.Tensor:
        """Hidden states [b * q, hidden] of the padded batch in the static buffers."""
        n = b * q
        plan = self.backend.plan_uniform(self.starts[:b], self.tables[:b], self.block_size, q)
        ctx = ForwardContext(positions=self.positions[:n], slot_mapping=self.slots[:n], layout=None,
                             backend=self.backend, plan=plan, kv_cache=self.kv_cache, logits_indices=None)
        return self.model.hidden_states(self.ids[:n], ctx)

    def _fill(self, batch: FlatBatch, b: int, q: int) -> list[int]:
        """Copy the step into the static buffers; the padded rows of the logits the step asked for."""
        ids, positions = [0] * (b * q), [0] * (b * q)
        slots = [self.scratch_slot] * (b * q)
        width = self.tables.shape[1]
        tables = [[0] * width for _ in range(b)]
        flat_to_padded: list[int] = []
        offset = 0
        for s, (n, table) in enumerate(zip(batch.query_lens, batch.block_tables, strict=True)):
            row = s * q
            ids[row:row + n] = batch.input_ids[offset:offset + n]
            positions[row:row + n] = batch.positions[offset:offset + n]
            slots[row:row + n] = batch.slot_mapping[offset:offset + n]
            tables[s][:len(table)] = table
            flat_to_padded.extend(range(row, row + n))
            offset += n
        starts = batch.start_positions + [0] * (b - len(batch.start_positions))
        for buf, values in ((self.ids, ids), (self.positions, positions), (self.slots, slots), (self.starts, starts)):
            buf[:len(values)].copy_(torch.tensor(values, dtype=buf.dtype), non_blocking=True)
        self.tables[:b].copy_(torch.tensor(tables, dtype=torch.int32), non_blocking=True)
        return [flat_to_padded[i] for i in batch.logits_indices]

    def run(self, batch: FlatBatch, shape: tuple[int, int], narrow: bool = False) -> torch.Tensor:
        """Logits [N, vocab] of the step's logits_indices (an empty tensor on a TP follower; narrow:
        CausalLM.logits)."""
        rows = self._fill(batch, *shape)
        self.runs += 1
        if self.capture:
            graph, hidden = self.graphs[shape]
            graph.replay()
        else:
            hidden = self._forward(*shape)
        if not self.leader:
            return hidden[:0]
        return self.model.logits(hidden, torch.tensor(rows, device=hidden.device), narrow)

    # ---- capture ----------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_all(self) -> None:
        """One graph per (B, Q) bucket, largest first so smaller ones reuse its memory pool."""
        t0 = time.perf_counter()
        pool = None
        self.slots.fill_(self.scratch_slot)  # capture runs write their K/V to the scratch block only
        for b in reversed(self.batch_buckets):
            for q in reversed(self.query_buckets):
                self._forward(b, q)  # warm-up: kernels chosen and workspaces allocated outside capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(b, q)
                pool = graph.pool()
                self.graphs[(b, q)] = (graph, out)
        torch.cuda.synchronize()
        log.info("captured %d CUDA graphs (batch %s x query %s) in %.1fs", len(self.graphs),
                 self.batch_buckets, self.query_buckets, time.perf_counter() - t0)
