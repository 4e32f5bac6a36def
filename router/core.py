"""Types shared across the router: requests, per-sequence state, outputs, configuration."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from tandem.v1 import common_pb2


class RequestError(ValueError):
    """Bad input: becomes HTTP 400 / gRPC INVALID_ARGUMENT. `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class Overloaded(RuntimeError):
    """The waiting queue is full: HTTP 429 / gRPC RESOURCE_EXHAUSTED."""


class ServiceUnavailable(RuntimeError):
    """The target stayed unreachable past the grace period: HTTP 503 / gRPC UNAVAILABLE."""


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    typical_acceptance: bool = False

    def to_proto(self) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=self.seed or 0, has_seed=self.seed is not None,
            acceptance=common_pb2.ACCEPTANCE_TYPICAL if self.typical_acceptance else common_pb2.ACCEPTANCE_STRICT,
        )


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int = 16
    sampling: SamplingOptions = SamplingOptions()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # top-n alternatives per token; None = no logprobs
    max_speculative_tokens: int | None = None  # per-request cap on k; 0 = no speculation
    ignore_eos: bool = False


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Delta:
    """New output of one request since its previous Delta."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    error: Exception | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # admitted to the queue, no KV reserved
    RUNNING = "running"  # KV reserved in both services; prefilling or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """The router's truth about one request. Service caches are only caches of `tokens`."""

    seq_id: int
    request: GenerationRequest
    arrival: float = field(default_factory=time.monotonic)
    status: SeqStatus = SeqStatus.WAITING
    tokens: list[int] = field(default_factory=list)  # prompt + output: the history
    num_prompt: int = 0
    target_cached: int = 0  # tokens the target's KV holds for this sequence
    draft_cached: int = 0  # tokens the draft's KV holds
    # The draft's believed continuation: draft_stream[:len(tokens)] == tokens when it is still valid;
    # draft_stream[len(tokens):] are proposals, draft_probs holds their sparse q (None when greedy).
    draft_stream: list[int] = field(default_factory=list)
    draft_probs: dict[int, common_pb2.SparseDist] = field(default_factory=dict)  # position -> q
    acceptance_ema: float = 0.7  # running estimate of this sequence's per-token acceptance
    num_preemptions: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    outputs: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)
    finished: bool = False

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def prefilling(self) -> bool:
        """Still feeding history into the target (first prefill, or recompute after preemption)."""
        return self.target_cached < len(self.tokens) - 1 or self.num_output == 0

    def proposal(self) -> list[int]:
        """Draft tokens that continue the current history (empty when the stream diverged)."""
        n = len(self.tokens)
        if len(self.draft_stream) > n and self.draft_stream[:n] == self.tokens:
            return self.draft_stream[n:]
        return []
