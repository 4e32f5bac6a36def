"""Router configuration: one frozen dataclass, built once from the CLI and checked."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.tls import ClientTLS
    from common.tracing import Tracing


FLUSH_S = 5.0  # stopping, once the engine is done: time to write the last chunks of every stream
TOOL_PARSERS = ("hermes",)  # the models' own tool-call formats router.gateway.tools reads
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # where router.gateway.reasoning finds a model's thinking
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # both parsers' markers
SCHEDULING_POLICIES = ("fcfs", "priority")  # router.scheduler's order of admission and choice of victims


@dataclass(frozen=True)
class RouterConfig:
    max_num_batched_tokens: int = 256  # token budget of one target step (decodes count 1 + k)
    max_num_seqs: int = 32  # sequences running at once
    max_model_len: int = 0  # longest sequence served; 0: what the target and both KV caches allow
    max_waiting: int = 256  # queued requests beyond which new ones get 429
    scheduling_policy: str = "fcfs"  # "priority": requests' priority (lower first) orders, admits and preempts
    max_body_bytes: int = 2 * 2**20  # HTTP request bodies past this get 413 (as TGI's --payload-limit)
    max_stored_responses: int = 1024  # Responses API answers kept for previous_response_id; 0: none kept
    k_max: int = 4  # largest speculation length per sequence per step
    dynamic_k: bool = True  # choose k per sequence from acceptance and load; else always k_max
    pipeline: bool = True  # draft proposes step t+1 while the target scores step t
    chain_steps: bool = True  # pipelined: send step t+1 (branches keyed by outcome) before step t answers
    chunked_prefill: bool = True  # slice prompts into the budget; else whole prompts first
    prompt_lookup: bool = True  # where the draft has no proposal (or there is no draft), guess from the history
    prefix_caching: bool = True  # start sequences from the services' cached prefix blocks (router.prefix)
    target_timeout_s: float = 60.0  # deadline of one Step
    draft_timeout_s: float = 5.0  # deadline of one Sync / Propose; past it the step goes on with k = 0
    target_grace_s: float = 30.0  # how long requests wait for a lost target before failing with 503
    draft_retry_s: float = 1.0  # first reconnect backoff for a lost draft (doubles up to 30 s)
    target_tls: ClientTLS | None = None  # TLS to the target replicas (router.security); None: plaintext
    draft_tls: ClientTLS | None = None
    tracing: Tracing | None = None  # OpenTelemetry spans (router.tracing); None: tracing off
    lease_ttl_s: float = 10.0  # a replica this router stops renewing is freed for others after this long
    # On SIGTERM: how long the requests in flight may run on while new ones are refused (vLLM's
    # --shutdown-timeout); 0: they are aborted at once, as on SIGINT.
    shutdown_timeout_s: float = 30.0
    tool_call_parser: str | None = None  # the model's tool-call format, for tool_choice "auto" (router.gateway.tools)
    reasoning_parser: str | None = None  # where a reasoning model's thinking ends (router.gateway.reasoning)
    chat_template: str = ""  # a Jinja file rendering chats instead of the model's own template (vLLM's flag)
    router_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}")

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError("max_num_seqs must not exceed max_num_batched_tokens: every decode needs a token")
        if not 0 <= self.k_max <= 16:
            raise ValueError("k_max must be in [0, 16]")
        if min(self.max_waiting, self.max_model_len, self.max_stored_responses) < 0 or self.max_body_bytes < 1024:
            raise ValueError("max_waiting, max_model_len and max_stored_responses must be >= 0, max_body_bytes >= 1024")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}")
        if self.tool_call_parser not in (None, *TOOL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}")
        for name in ("target_timeout_s", "draft_timeout_s", "target_grace_s", "draft_retry_s", "lease_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.shutdown_timeout_s < 0:
            raise ValueError("shutdown_timeout_s must be >= 0")
