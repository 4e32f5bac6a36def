"""Types shared across the router: the request (one object from the front door to the step loop),
its outputs, a sequence's status and the errors a request can meet. The sequence itself (everything
the router knows about one request) is router.sequence's."""

from __future__ import annotations

import enum
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from common.block_hash import ROOT, salt_digest
from common.sampling import InvalidField, SamplingParams
from tandem.v1 import common_pb2

if TYPE_CHECKING:
    from router.structured import Constraint

RequestError = InvalidField  # bad input: HTTP 400 / gRPC INVALID_ARGUMENT, naming the field
# Whose prefix cache a request being admitted uses: with --cache-salt-per-key, its API key's digest, set
# by the doors' guard (router.auth) for the call it lets in; RouterEngine.submit reads it, as it reads
# the caller's trace context. b"": the cache everybody shares.
TENANT: ContextVar[bytes] = ContextVar("tandem_tenant", default=b"")
# Who is calling: its API key's digest, set by the guard for the call it lets in (b"": keys are off).
# Stored responses belong to it (router.gateway.responses_store): another key cannot read them.
CLIENT: ContextVar[bytes] = ContextVar("tandem_client", default=b"")
GREEDY = SamplingParams(temperature=0.0)


class Overloaded(RuntimeError):
    """The waiting queue is full: HTTP 429 / gRPC RESOURCE_EXHAUSTED."""


class ServiceUnavailable(RuntimeError):
    """The target stayed unreachable past the grace period: HTTP 503 / gRPC UNAVAILABLE."""


class InternalError(RuntimeError):
    """A service failed this request: HTTP 500 / gRPC INTERNAL, with a short message and a log id."""


@dataclass(frozen=True)
class Request:
    """What a client asked for, once parsed by a front door; validated once, by RouterEngine.submit."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int | None = None  # None: until EOS or the end of the model's context
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # top-n alternatives per token; None = no logprobs
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs too (echo), top-n; None = not asked
    prediction: tuple[int, ...] = ()  # OpenAI's predicted output, as tokens: prompt lookup proposes from it too
    max_speculative_tokens: int | None = None  # per-request cap on k; 0 = no speculation
    ignore_eos: bool = False
    tandem_metrics: bool = False  # report this request's figures (router.request_stats) with its usage
    skip_special_tokens: bool = True  # the output text leaves out special tokens (vLLM's default)
    include_stop_str_in_output: bool = False  # vLLM's: the stop string (or stop token) that ends it stays in
    n: int = 1  # choices: n sequences from one prompt, computed once
    priority: int = 0  # with --scheduling-policy priority: lower is served first (vLLM's convention)
    lora: str = ""  # the LoRA adapter the target runs it with (a model name /v1/models lists); "": the base
    # vLLM's cache_salt: only requests with the same salt share cached prompt blocks; "": none. Secrets
    # (a client's salt, a key's digest), so never in a repr or a log line.
    cache_salt: str = field(default="", repr=False)
    tenant: bytes = field(default=b"", repr=False)  # set by RouterEngine.submit (TENANT): a key's own cache
    block_root: int = ROOT  # set by RouterEngine.submit: where its target block hashes start (adapter, salt)
    constraint: Constraint | None = None  # structured output, as the door read it
    grammar: str = ""  # ... compiled by RouterEngine.submit (llguidance's serialized grammar)
    # A reasoning model's think-end token: the constraint holds from the token after it (the model
    # thinks freely first); None: from the first output token.
    grammar_opens_after: int | None = None
    eos_ids: tuple[int, ...] = ()  # set by RouterEngine.submit: what min_tokens holds back with stop_token_ids
    bad_words: tuple[str, ...] = ()  # vLLM's, as text: RouterEngine.submit adds their tokens to sampling.bad_words

    @cached_property
    def sampling_proto(self) -> common_pb2.SamplingParams:
        """The wire form, built once: every step of the request sends it."""
        return self.sampling.to_proto(held_back=() if self.ignore_eos else self.eos_ids)

    @cached_property
    def salt(self) -> int:
        """The cache salt the services get (a digest: the string and the tenant stay in the router)."""
        return salt_digest(self.cache_salt, self.tenant)

    @property
    def reproducible(self) -> bool:
        """Seeded sampling: its tokens must not depend on timing, so its k never does either."""
        return self.sampling.seed is not None and not self.sampling.greedy


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
    rank: int = 0  # 1 + the tokens more likely than it (0: not reported)


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
    index: int = 0  # which of the request's n choices
    prompt_logprobs: list[TokenLogprob] | None = None  # first Delta: prompt tokens 1.. (Request.prompt_logprobs)
    cached_tokens: int = 0  # prompt tokens the target took from its prefix cache instead of computing them
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop_token_id that ended it (EOS: None)
    prediction: tuple[int, int] | None = None  # with a predicted output: its tokens verified (accepted, rejected)


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # admitted to the queue, no KV reserved
    RUNNING = "running"  # KV reserved in both services; prefilling or decoding
    FINISHED = "finished"
