"""What a request may ask, checked once before it is queued: every refusal names its field."""

from __future__ import annotations

from common.protocol import MAX_LOGPROBS
from router.core import Request, RequestError

MAX_CHOICES = 16  # n per request
MAX_CACHE_SALT = 256  # characters: room for any secret worth the name (vLLM suggests 43, 256 bits in base64)


def check_request(req: Request, vocab_size: int, limit: int, policy: str, adapters: list[str],
                  eos_ids: tuple[int, ...] = ()) -> int:
    """RequestError naming the first bad field; else the number of tokens the request may generate.
    limit: the longest sequence served; policy: the router's scheduling policy; adapters: the LoRA
    adapters the targets serve; eos_ids: the model's EOS ids."""
    n = len(req.prompt_ids)
    if not n:
        raise RequestError("prompt", "must not be empty")
    if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= vocab_size:
        raise RequestError("prompt", f"token ids must be in [0, {vocab_size})")
    if n >= limit:
        raise RequestError("prompt", f"{n} tokens leave no room to generate within max_model_len {limit}")
    if req.max_tokens is not None:
        if req.max_tokens < (0 if req.prompt_logprobs is not None else 1):  # 0: the prompt's logprobs alone
            raise RequestError("max_tokens", f"must be >= 1, got {req.max_tokens}")
        if n + req.max_tokens > limit:
            raise RequestError("max_tokens", f"prompt ({n} tokens) + max_tokens ({req.max_tokens}) exceeds "
                                             f"max_model_len {limit}")
    req.sampling.check(held_back=() if req.ignore_eos else eos_ids)
    if req.lora and req.lora not in adapters:
        raise RequestError("model", f"no LoRA adapter {req.lora!r} is served")
    if req.priority and policy != "priority":
        raise RequestError("priority", "the router serves first come, first served (start it with "
                                       "--scheduling-policy priority)")
    if len(req.cache_salt) > MAX_CACHE_SALT:
        raise RequestError("cache_salt", f"at most {MAX_CACHE_SALT} characters")
    if any(not s for s in req.stop):
        raise RequestError("stop", "stop strings must not be empty")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise RequestError("logprobs", f"must be in [0, {MAX_LOGPROBS}]")
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
        raise RequestError("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}]")
    if len(req.prediction) > limit:
        raise RequestError("prediction", f"{len(req.prediction)} tokens: longer than max_model_len {limit}")
    if req.prediction and (min(req.prediction) < 0 or max(req.prediction) >= vocab_size):
        raise RequestError("prediction", f"token ids must be in [0, {vocab_size})")
    if req.max_speculative_tokens is not None and req.max_speculative_tokens < 0:
        raise RequestError("max_speculative_tokens", "must be >= 0")
    req.sampling.check_vocab(vocab_size)
    if req.sampling.allowed_token_ids and req.constraint is not None:
        raise RequestError("allowed_token_ids", "is not taken with structured output (the grammar says which "
                                                "tokens may come)")
    if not 1 <= req.n <= MAX_CHOICES:
        raise RequestError("n", f"must be in [1, {MAX_CHOICES}], got {req.n}")
    return req.max_tokens if req.max_tokens is not None else limit - n
