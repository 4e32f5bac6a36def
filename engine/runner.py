"""ModelRunner: one forward pass over a mixed, position-addressed batch.

Each SeqInput says "the KV cache of seq_id must end at start_pos; these tokens follow".
The runner trims anything cached past start_pos, appends the tokens and returns logits for
the last `num_logits` of them. An input naming a `prefix` (content hashes of cached blocks)
starts from those blocks instead of what the sequence held. Everything is validated before the
first byte changes, so a rejected batch leaves every sequence's cache as it was.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from common.block_hash import ROOT, salted_root
from engine.attention import BatchLayout
from engine.calibration import calibrate
from engine.config import EngineConfig, ModelConfig
from engine.cuda_graphs import GraphRunner
from engine.flash_attention import select_backend, uses_flash
from engine.kv_cache import BlockManager, PagedKVCache
from engine.lora import AdapterError, LoraAdapter, LoraBatch
from engine.model import CausalLM, FlatBatch, ForwardContext, ReducedHead
from engine.parallel import SINGLE, TensorParallel, check_shardable
from engine.prefix_cache import PrefixCache
from engine.weights import load_weights

log = logging.getLogger(__name__)
_SDPA_GRAPH_MAX_LEN = 4096  # beyond this, graphs over the SDPA fallback cost more memory than they save time


@dataclass(frozen=True)
class SeqInput:
    seq_id: int
    start_pos: int
    tokens: Sequence[int]
    num_logits: int = 1  # logits for the last num_logits tokens (0: none, a non-final prompt chunk)
    prefix: Sequence[int] = ()  # hashes of published blocks to start from (start_pos = their length)
    adapter: str = ""  # the LoRA adapter its tokens run with (load_adapters); "": the base model
    salt: int = 0  # its cache salt (common/block_hash.salt_digest); 0: none


class CacheMiss(LookupError):
    """Some sequences hold fewer than start_pos tokens: resend their history from position 0."""

    def __init__(self, seq_ids: list[int]) -> None:
        super().__init__(f"cache miss for sequences {seq_ids}: resend from start_pos 0")
        self.seq_ids = seq_ids


class InvalidInput(ValueError):
    """A request field is invalid; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class AdapterNotLoaded(InvalidInput):
    """A sequence names a LoRA adapter the runner does not hold."""

    def __init__(self, field: str, adapter: str) -> None:
        super().__init__(field, f"no LoRA adapter {adapter!r} is loaded")
        self.adapter = adapter


class ModelRunner:
    def __init__(self, model: CausalLM, config: EngineConfig, model_dir: Path | None = None) -> None:
        self.model = model
        self.tp: TensorParallel = model.tp
        self.config = config
        self.model_config: ModelConfig = model.config
        self.model_dir = model_dir
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.blocks = BlockManager(config.num_blocks, config.block_size, caching=config.prefix_caching)
        self.prefix = PrefixCache(self.blocks)
        self.kv_cache = PagedKVCache(mc.num_layers, config.num_blocks, config.block_size,
                                     mc.num_kv_heads // self.tp.size, mc.head_dim, self.dtype, self.device)
        self.backend = select_backend(config.attention_backend, self.device, self.dtype, mc.head_dim**-0.5,
                                      mc.sliding_window)
        self.forward_calls = 0  # counted so tests can prove batching (k forwards, not n * k)
        self.graphs: GraphRunner | None = None  # CUDA graphs for decode/verify steps (use_graphs)
        self.adapters: dict[str, LoraAdapter] = {}  # LoRA adapters by name (load_adapters)

    def load_adapters(self, paths: dict[str, Path]) -> None:
        """LoRA adapters (PEFT directories) sequences may name; they change no base weight."""
        if paths and self.tp.size > 1:
            raise AdapterError("LoRA adapters are served with one tensor-parallel rank only")
        for name, path in paths.items():
            self.adapters[name] = LoraAdapter.load(name, path, self.model_config, self.device, self.dtype)
            log.info("LoRA adapter %r from %s: rank %d", name, path, self.adapters[name].rank)

    def use_graphs(self, capture: bool = True) -> None:
        """Run decode/verify steps through fixed-shape graphs; capture=False runs the same padded
        forward eagerly (CPU tests of the layout, graphs-vs-eager comparisons)."""
        cfg = self.config
        self.graphs = GraphRunner(self.model, self.backend, self.kv_cache, leader=self.tp.leader,
                                  block_size=cfg.block_size, max_model_len=self.max_model_len,
                                  max_batch=min(cfg.cuda_graph_max_batch, cfg.max_batch_tokens),
                                  max_query=cfg.cuda_graph_max_query, capture=capture)
        if capture:
            self.graphs.capture_all()

    @classmethod
    def load(cls, model_dir: str | Path, config: EngineConfig | None = None,
             tp: TensorParallel = SINGLE) -> ModelRunner:
        config = config or EngineConfig()
        model_dir = Path(model_dir)
        mc = ModelConfig.from_dir(model_dir)
        check_shardable(mc, tp.size)
        max_len = config.max_model_len or mc.max_position_embeddings
        if max_len > mc.max_position_embeddings and mc.rope.rope_type == "default":
            raise ValueError(f"max_model_len {max_len} exceeds the checkpoint's {mc.max_position_embeddings}")
        t0 = time.perf_counter()
        device, dtype = config.resolved_device(), config.resolved_dtype()
        uses_flash(config.attention_backend, device, dtype)  # refuse flash + fp32 before loading anything
        with torch.device("meta"):
            model = CausalLM(mc, max_len, tp)
        model = model.to_empty(device=device).to(dtype)
        model.tie_weights()
        load_weights(model, model_dir)
        model.model.rotary.build(device)  # float32 tables: not weights, so not in the checkpoint
        model.eval()
        calibrate(model)  # CPU only: how small products run fastest (engine/linear.py, engine/calibration.py)
        runner = cls(model, config, model_dir)
        if config.cuda_graphs and (runner.backend.name == "flash-attn" or runner.max_model_len <= _SDPA_GRAPH_MAX_LEN):
            runner.use_graphs()
        elif config.cuda_graphs:
            log.info("CUDA graphs off: the SDPA fallback would gather all %d key positions per sequence in every "
                     "graph (flash-attn reads the cache in place)", runner.max_model_len)
        log.info("loaded %s (%s, %.1fM params%s) on %s/%s in %.1fs", model_dir.name, mc.architecture,
                 sum(p.numel() for p in model.parameters()) / 1e6,
                 f" on rank {tp.rank} of {tp.size}" if tp.size > 1 else "", device, dtype, time.perf_counter() - t0)
        return runner

    # ---- state -------------------------------------------------------------------------
    def cached_len(self, seq_id: int) -> int:
        return self.blocks.length(seq_id)

    def trim(self, seq_id: int, length: int) -> None:
        """Forget cached tokens at positions >= length (drafts the target rejected)."""
        self.blocks.trim(seq_id, length)
        self.prefix.trim(seq_id, length)

    def commit(self, seq_id: int, length: int) -> None:
        """Positions < length are final (never trimmed away by the caller): their full blocks are
        published for other sequences to attach."""
        self.prefix.commit(seq_id, length)

    def fork(self, parent: int, child: int, length: int) -> None:
        """child := parent's first `length` cached tokens, sharing their KV blocks (a branch)."""
        copy = self.blocks.fork(parent, child, length)
        self.prefix.fork(parent, child, length)
        if copy is not None:
            self.kv_cache.copy_block(*copy)

    def release(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            self.blocks.free(seq_id)
            self.prefix.free(seq_id)

    # ---- validation (no side effects) ----------------------------------------------------
    def validate(self, inputs: Sequence[SeqInput]) -> None:
        if not inputs:
            raise InvalidInput("entries", "empty batch")
        seen: set[int] = set()
        missing: list[int] = []
        total = 0
        vocab = self.model_config.vocab_size
        for n, x in enumerate(inputs):
            where = f"entries[{n}]"
            if x.seq_id in seen:
                raise InvalidInput(f"{where}.seq_id", f"sequence {x.seq_id} appears twice in one batch")
            seen.add(x.seq_id)
            if not x.tokens:
                raise InvalidInput(f"{where}.tokens", "must not be empty")
            if not 0 <= x.num_logits <= len(x.tokens):
                raise InvalidInput(f"{where}.num_logits", f"{x.num_logits} not in [0, {len(x.tokens)}]")
            if x.start_pos < 0 or x.start_pos + len(x.tokens) > self.max_model_len:
                raise InvalidInput(f"{where}.start_pos",
                                   f"{x.start_pos} + {len(x.tokens)} tokens exceeds max_model_len {self.max_model_len}")
            if min(x.tokens) < 0 or max(x.tokens) >= vocab:
                raise InvalidInput(f"{where}.tokens", f"token id outside [0, {vocab})")
            if x.adapter and x.adapter not in self.adapters:
                raise AdapterNotLoaded(f"{where}.lora", x.adapter)
            if x.prefix and x.start_pos != len(x.prefix) * self.config.block_size:
                raise InvalidInput(f"{where}.prefix_block_hashes", f"{len(x.prefix)} blocks of "
                                   f"{self.config.block_size} tokens must end at start_pos {x.start_pos}")
            held = self.prefix.holds(x.prefix) if x.prefix else x.start_pos <= self.blocks.length(x.seq_id)
            if not held:
                missing.append(x.seq_id)
            total += len(x.tokens)
        if total > self.config.max_batch_tokens:
            raise InvalidInput("entries", f"{total} tokens exceed max_batch_tokens {self.config.max_batch_tokens}")
        if missing:
            raise CacheMiss(missing)
        self.blocks.check_capacity({x.seq_id: (x.start_pos, x.start_pos + len(x.tokens)) for x in inputs},
                                   attach={x.seq_id: x.prefix for x in inputs if x.prefix})

    # ---- forward ---------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, inputs: Sequence[SeqInput], checked: bool = False, narrow: bool = False) -> list[torch.Tensor]:
        """Logits [num_logits, vocab] (float32) per input, in order. checked: the caller validated these
        inputs already (the draft's own rounds, which its Proposer checked with the call). narrow: a
        reduced head's own columns only, [num_logits, head_vocab] (tokens: head_ids; widen() restores)."""
        if not checked:
            self.validate(inputs)
        batch = self.prepare(inputs)
        self.tp.send(batch)
        logits = self.execute(batch, narrow)
        return list(logits.split([x.num_logits for x in inputs]))

    def prepare(self, inputs: Sequence[SeqInput]) -> FlatBatch:
        """Attach, trim and grow each sequence's blocks (validated already) and flatten the batch.
        Attaches come first (no allocation can evict what they take), trims before appends (the
        capacity check counted the blocks trims free)."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        for x in inputs:
            if x.prefix:
                self.prefix.attach(x.seq_id, x.prefix)
            root = salted_root(self.adapters[x.adapter].root if x.adapter else ROOT, x.salt)
            if root != ROOT:  # a sequence keeps its root for life; the draft's own rounds send none
                self.prefix.set_root(x.seq_id, root)
        for x in inputs:
            self.trim(x.seq_id, x.start_pos)
        for x in inputs:
            offset = len(ids)
            ids.extend(x.tokens)
            positions.extend(range(x.start_pos, x.start_pos + len(x.tokens)))
            slots.extend(self.blocks.append(x.seq_id, len(x.tokens)))
            self.prefix.extend(x.seq_id, x.tokens)
            logits_indices.extend(range(offset + len(x.tokens) - x.num_logits, offset + len(x.tokens)))
        tables = [self.blocks.block_table(x.seq_id) for x in inputs]
        width = max(len(t) for t in tables)
        return FlatBatch(ids, positions, slots, logits_indices, [t + [0] * (width - len(t)) for t in tables],
                         [x.start_pos for x in inputs], [len(x.tokens) for x in inputs], self.blocks.take_copies(),
                         [x.adapter for x in inputs] if any(x.adapter for x in inputs) else [])

    @property
    def head_ids(self) -> torch.Tensor | None:
        """The token of each column of narrow logits; None where the head covers the vocabulary."""
        head = self.model.lm_head
        return head.token_ids if isinstance(head, ReducedHead) else None

    def widen(self, logits: torch.Tensor) -> torch.Tensor:
        """Narrow logits [N, head_vocab] -> [N, vocab] (unchanged where the head covers the vocabulary)."""
        head = self.model.lm_head
        return head.widen(logits) if isinstance(head, ReducedHead) else logits

    def execute(self, batch: FlatBatch, narrow: bool = False) -> torch.Tensor:
        """Run the model over a flattened batch: logits on the leader, an empty tensor on followers."""
        for src, dst in batch.copies:  # copy-on-write: before the forward writes into dst
            self.kv_cache.copy_block(src, dst)
        if self.graphs is not None and not batch.adapters and (shape := self.graphs.shape_for(batch)) is not None:
            self.forward_calls += 1
            return self.graphs.run(batch, shape, narrow)
        dev = self.device
        layout = BatchLayout(batch.start_positions, batch.query_lens,
                             torch.tensor(batch.block_tables, dtype=torch.int32, device=dev),
                             self.config.block_size, dev)
        # one tensor (one copy to the device) for the four index lists: a small forward is mostly such costs
        t, n = len(batch.input_ids), len(batch.logits_indices)
        flat = torch.tensor(batch.input_ids + batch.positions + batch.slot_mapping + batch.logits_indices,
                            dtype=torch.long, device=dev)
        input_ids, positions, slots, logits_indices = flat.split([t, t, t, n])
        ctx = ForwardContext(positions=positions, slot_mapping=slots, layout=layout, backend=self.backend,
                             plan=self.backend.plan(layout), kv_cache=self.kv_cache, logits_indices=logits_indices,
                             lora=LoraBatch.of(batch.adapters, batch.query_lens, self.adapters, dev)
                             if batch.adapters else None)
        self.forward_calls += 1
        hidden = self.model.hidden_states(input_ids, ctx)
        if not self.tp.leader:
            return hidden[:0]
        return self.model.logits(hidden, ctx.logits_indices, narrow)

    @torch.inference_mode()
    def follow(self) -> int:
        """A tensor-parallel follower's life: run every batch the leader broadcasts, in lockstep,
        until it broadcasts the stop. Returns the number of forwards run."""
        assert not self.tp.leader
        while isinstance(batch := self.tp.receive(), FlatBatch):
            self.execute(batch)
        return self.forward_calls

    def stop_followers(self) -> None:
        """The leader tells its followers to return from follow()."""
        if self.tp.leader:
            self.tp.send(None)
