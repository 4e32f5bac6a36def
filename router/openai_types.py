"""OpenAI-compatible request bodies (completions and chat), checked and turned into
GenerationRequests. Extensions beyond OpenAI's fields: top_k, ignore_eos, max_speculative_tokens,
typical_acceptance."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from common.protocol import MAX_LOGPROBS
from router.core import GenerationRequest, RequestError, SamplingOptions

MAX_STOP_STRINGS = 8


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | StrictInt = 1.0
    top_p: StrictFloat | StrictInt = 1.0
    top_k: StrictInt = 0
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: dict | None = None
    n: StrictInt = 1
    ignore_eos: StrictBool = False
    max_speculative_tokens: StrictInt | None = None
    typical_acceptance: StrictBool = False
    return_token_ids: StrictBool = False  # extension: each choice also carries the generated token ids
    user: StrictStr | None = None

    def _request(self, request_id: str, prompt_ids: list[int], default_max_tokens: int,
                 logprobs: int | None) -> GenerationRequest:
        if self.n != 1:
            raise RequestError("n", "only n = 1 is supported")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
            raise RequestError("stop", f"at most {MAX_STOP_STRINGS} non-empty strings")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RequestError("seed", "must be in [0, 2^63)")
        return GenerationRequest(
            request_id=request_id, prompt_ids=prompt_ids,
            max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
            sampling=SamplingOptions(temperature=float(self.temperature), top_p=float(self.top_p), top_k=self.top_k,
                                     seed=self.seed, typical_acceptance=self.typical_acceptance),
            stop=tuple(stop), logprobs=logprobs, max_speculative_tokens=self.max_speculative_tokens,
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionBody(_Common):
    prompt: StrictStr | Annotated[list[StrictInt], Field(min_length=1)] | Annotated[list[StrictStr], Field(
        min_length=1, max_length=1)]
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None

    def to_request(self, request_id: str, encode, default_max_tokens: int) -> GenerationRequest:  # noqa: ANN001
        if self.echo:
            raise RequestError("echo", "echo is not supported")
        if self.suffix:
            raise RequestError("suffix", "suffix is not supported")
        if self.prompt == "" or self.prompt == [""]:
            raise RequestError("prompt", "must not be empty")
        if isinstance(self.prompt, str):
            ids = encode(self.prompt)
        elif self.prompt and isinstance(self.prompt[0], str):
            ids = encode(self.prompt[0])
        else:
            ids = list(self.prompt)
        return self._request(request_id, ids, default_max_tokens, self.logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[dict] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError("messages.content", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatBody(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None

    def to_request(self, request_id: str, prompt_ids: list[int], default_max_tokens: int) -> GenerationRequest:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs", "needs logprobs: true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise RequestError("top_logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._request(request_id, prompt_ids, default_max_tokens, logprobs)
