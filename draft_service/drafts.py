"""What a Propose call asks of the proposer and what it answers, as plain types (the gRPC server
converts them from and to draft.proto; draft_service.proposer does the work)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.logits import Processors
from engine.sampling import SamplingSpec


@dataclass(frozen=True)
class BranchSpec:
    accepted: int  # j: drafts under verification assumed accepted
    rank: int  # the guessed token is the draft's rank-th favourite there (1-based)


@dataclass(frozen=True)
class DraftRequest:
    seq_id: int
    start_pos: int
    tokens: Sequence[int]  # tokens after start_pos the draft has not cached; non-empty
    k: int
    spec: SamplingSpec = SamplingSpec()
    num_verifying: int = 0  # the last v of `tokens` are drafts under verification
    branches: Sequence[BranchSpec] = ()  # empty: one plain continuation after all of `tokens`
    processors: Processors | None = None  # logits processors (engine/logits.py), as on the target
    grammar: str = ""  # structured output: the sequence's grammar (with its start_pos 0 entries)
    prompt_len: int = 0
    fork_of: int = 0  # n choices: start as a fork of this sequence's first start_pos tokens
    prefix: Sequence[int] = ()  # hashes of published blocks to start from (start_pos = their length)
    salt: int = 0  # its cache salt (common/block_hash.salt_digest); 0: none

    @property
    def end(self) -> int:
        return self.start_pos + len(self.tokens)

    @property
    def final_len(self) -> int:
        """Cached tokens after the call: the inputs, and a plain continuation's d_1..d_{k-1}."""
        return self.end + (self.k - 1 if self.k > 0 and not self.branches else 0)


@dataclass
class SparseQ:
    """The distribution a draft token was sampled from: mass outside token_ids is 0."""

    token_ids: list[int]
    probs: list[float]


@dataclass
class Continuation:
    """Drafts after a prefix: a plain continuation (token -1) or a branch (its guessed token)."""

    accepted: int = 0
    token: int = -1
    drafts: list[int] = field(default_factory=list)
    probs: list[SparseQ] = field(default_factory=list)  # one per draft; empty when greedy
    confidence: list[float] = field(default_factory=list)  # per draft: its probability where it was drawn


@dataclass
class DraftResult:
    seq_id: int
    plain: Continuation = field(default_factory=Continuation)
    branches: list[Continuation] = field(default_factory=list)
    cached_len: int = 0


@dataclass
class Proposals:
    results: list[DraftResult]
    forward_ms: float
    forwards: int
