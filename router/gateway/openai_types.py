"""OpenAI-compatible request bodies (completions and chat; vLLM's tokenize and detokenize: tokenize_body),
checked and turned into Requests; chat's tools as router.gateway.tools takes them (OpenAI's
Predicted Outputs, `prediction`, are proposed by prompt lookup: router.lookup). Extensions beyond
OpenAI's fields: top_k, min_p, ignore_eos, max_speculative_tokens, typical_acceptance, return_token_ids,
tandem_metrics, and vLLM's repetition_penalty, min_tokens, stop_token_ids,
allowed_token_ids, bad_words, prompt_logprobs, thinking_token_budget,
skip_special_tokens, truncate_prompt_tokens, add_generation_prompt, continue_final_message,
chat_template_kwargs, structured_outputs (json, regex, choice, grammar, json_object) with its older
guided_json/guided_regex/guided_choice/guided_grammar. Sampling fields left out (or null) take the
served model's defaults (generation_config.json).

A field Tandem does not know or does not support is a 400 naming it, never ignored: a client asking
for audio or tool_choice "auto" must not get plain text with a 200. A few are accepted because they change nothing
about the output (HARMLESS)."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from common.protocol import MAX_LOGPROBS
from common.sampling import SamplingParams
from router.core import Request, RequestError
from router.gateway.conversation import ChatMessage, conversation, template_options
from router.gateway.tools import CHAT_CHOICES, ToolCalling, tool_calling
from router.structured import Constraint

MAX_STOP_STRINGS = 8
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
MAX_PROMPT_CHOICES = 64  # prompts x n: the choices one completions request may ask for


# fields that only label or route a request elsewhere (OpenAI's own bookkeeping): accepted, no effect
HARMLESS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})


class OpenAIBody(BaseModel):
    """A body of OpenAI's API: unknown fields refused, null meaning the default."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: object) -> object:
        """OpenAI's optional fields are nullable: null means the default (clients send "stream": null)."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @classmethod
    def unsupported(cls, body: dict) -> list[str]:
        """Top-level fields this body type does not take (a 400 names them); null asks for nothing."""
        return sorted({k for k, v in body.items() if v is not None} - set(cls.model_fields) - HARMLESS)


class StreamOptions(OpenAIBody):
    include_usage: StrictBool = False  # a last chunk with the request's usage
    continuous_usage_stats: StrictBool = False  # vLLM's: with include_usage, every chunk carries the usage so far
    include_obfuscation: StrictBool = True  # OpenAI's padding field against length side channels: not written


class _Common(OpenAIBody):
    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    ignore_eos: StrictBool = False
    max_speculative_tokens: StrictInt | None = None
    typical_acceptance: StrictBool = False
    return_token_ids: StrictBool = False  # extension: each choice also carries the generated token ids
    skip_special_tokens: StrictBool = True  # vLLM's: false keeps special tokens in the output text
    include_stop_str_in_output: StrictBool = False  # vLLM's: the stop string that ended it stays in the text
    priority: StrictInt = 0  # vLLM's: with --scheduling-policy priority, lower is served first
    cache_salt: StrictStr | None = None  # vLLM's: only requests with this salt share its cached prompt blocks
    truncate_prompt_tokens: StrictInt | None = None  # vLLM's: keep the prompt's last k tokens (-1: what fits)
    tandem_metrics: StrictBool = False  # extension: usage.tandem_metrics, this request's figures (request_stats)
    presence_penalty: StrictFloat | StrictInt | None = None
    frequency_penalty: StrictFloat | StrictInt | None = None
    repetition_penalty: StrictFloat | StrictInt | None = None
    logit_bias: dict[StrictStr, StrictFloat | StrictInt] | None = None  # token id (as a string) -> bias
    min_tokens: StrictInt | None = None
    stop_token_ids: list[StrictInt] | None = None
    allowed_token_ids: list[StrictInt] | None = None  # vLLM's: only these ids may be generated
    bad_words: list[StrictStr] | None = None  # vLLM's: words the output must not contain
    prompt_logprobs: StrictInt | None = None  # vLLM's: each prompt token's logprob, rank and top alternatives
    thinking_token_budget: StrictInt | None = None  # vLLM's: thinking past it is ended (--reasoning-parser)
    prediction: dict | None = None  # OpenAI's Predicted Outputs: {"type": "content", "content": the expected text}
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: StrictStr | dict | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None

    def asked_max_tokens(self) -> int | None:
        """The output length asked for, defaults applied (None: until EOS or the end of the context)."""
        return self.max_tokens

    def truncated(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens (after the chat template: the
        conversation's start goes first); -1 keeps what leaves room for max_tokens (or one token)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return prompt_ids
        if k == -1:
            k = max_model_len - (self.asked_max_tokens() or 1)
        if k < 1:
            raise RequestError("truncate_prompt_tokens", "must be >= 1, or -1 (what fits beside max_tokens)")
        return prompt_ids[-k:]

    def _request(self, request_id: str, prompt_ids: list[int], defaults: SamplingParams, logprobs: int | None,
                 max_tokens: int | None) -> Request:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise RequestError("stop", f"at most {MAX_STOP_STRINGS} strings")
        sampling = defaults.updated(temperature=None if self.temperature is None else float(self.temperature),
                                    top_p=_float(self.top_p), top_k=self.top_k, min_p=_float(self.min_p),
                                    seed=self.seed, typical_acceptance=self.typical_acceptance or None,
                                    presence_penalty=_float(self.presence_penalty),
                                    frequency_penalty=_float(self.frequency_penalty),
                                    repetition_penalty=_float(self.repetition_penalty), logit_bias=self._bias(),
                                    min_tokens=self.min_tokens,
                                    stop_token_ids=tuple(self.stop_token_ids) if self.stop_token_ids else None,
                                    allowed_token_ids=self._allowed(), thinking_token_budget=self.thinking_token_budget)
        if self.cache_salt is not None and not self.cache_salt:
            raise RequestError("cache_salt", "must be a non-empty string if given (as vLLM)")
        if self.prompt_logprobs is not None and self.stream:
            raise RequestError("prompt_logprobs", "not with stream (as vLLM): ask without streaming")
        constraint = Constraint.from_openai(self.response_format, self.structured_outputs, {
            "guided_json": self.guided_json, "guided_regex": self.guided_regex, "guided_choice": self.guided_choice,
            "guided_grammar": self.guided_grammar})
        return Request(request_id=request_id, prompt_ids=prompt_ids, sampling=sampling, max_tokens=max_tokens,
                       stop=tuple(stop), logprobs=logprobs, max_speculative_tokens=self.max_speculative_tokens,
                       ignore_eos=self.ignore_eos, tandem_metrics=self.tandem_metrics, n=self.n,
                       constraint=constraint, skip_special_tokens=self.skip_special_tokens,
                       include_stop_str_in_output=self.include_stop_str_in_output, priority=self.priority,
                       bad_words=tuple(self.bad_words or ()), prompt_logprobs=self.prompt_logprobs,
                       cache_salt=self.cache_salt or "")

    def _bias(self) -> tuple[tuple[int, float], ...] | None:
        if not self.logit_bias:
            return None
        try:
            return tuple(sorted((int(t), float(b)) for t, b in self.logit_bias.items()))
        except ValueError:
            raise RequestError("logit_bias", "keys must be token ids (integers as strings)") from None

    def predicted(self) -> str:
        """The text of OpenAI's prediction (a text, or text parts), "" when none."""
        if self.prediction is None:
            return ""
        content = self.prediction.get("content")
        if self.prediction.get("type") != "content" or not isinstance(content, str | list):
            raise RequestError("prediction", '{"type": "content", "content": the text the output is expected to be}')
        if isinstance(content, str):
            return content
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise RequestError("prediction.content", "a text or text parts")
        return "".join(p["text"] for p in content)

    def _allowed(self) -> tuple[int, ...] | None:
        if self.allowed_token_ids is None:
            return None
        if not self.allowed_token_ids:
            raise RequestError("allowed_token_ids", "must not be empty (leave it out to allow every token)")
        return tuple(sorted(set(self.allowed_token_ids)))

    @property
    def include_usage(self) -> bool:
        """Streams end with a usage chunk: asked for, or where the asked-for tandem_metrics go."""
        return bool(self.stream_options and self.stream_options.include_usage) or self.tandem_metrics

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: each streamed chunk also carries the usage so far."""
        return bool(self.stream_options and self.stream_options.include_usage
                    and self.stream_options.continuous_usage_stats)


def _float(value: float | int | None) -> float | None:
    return None if value is None else float(value)


class CompletionBody(_Common):
    # OpenAI's four shapes: a text, token ids, or a list of either (several prompts, answered as one)
    prompt: (StrictStr | Annotated[list[StrictInt], Field(min_length=1)]
             | Annotated[list[StrictStr], Field(min_length=1)]
             | Annotated[list[Annotated[list[StrictInt], Field(min_length=1)]], Field(min_length=1)])
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_shape(cls, value: object) -> object:
        """A list mixing texts, ids and id lists would fail every member of the union, and the error
        would name one member's complaint ("a valid integer"): say what is taken instead."""
        if isinstance(value, list) and len({type(v) for v in value}) > 1:
            raise ValueError("token ids, texts or token-id lists, one kind in a list")
        return value

    def prompts(self) -> list[str | list[int]]:
        """Each prompt, a text to tokenize or token ids. Choice i of prompt p is answered as index
        p x n + i, as OpenAI and vLLM number them."""
        if self.suffix:
            raise RequestError("suffix", "suffix is not supported")
        prompts: list = [self.prompt] if isinstance(self.prompt, str) or isinstance(self.prompt[0], int) \
            else list(self.prompt)
        if any(p == "" for p in prompts):
            raise RequestError("prompt", "must not be empty")
        if len(prompts) > 1 and self.tandem_metrics:
            raise RequestError("tandem_metrics", "reports one sequence's figures: send one prompt")
        if len(prompts) * max(self.n, 1) > MAX_PROMPT_CHOICES:
            raise RequestError("prompt", f"{len(prompts)} prompts with n = {self.n} ask for "
                                         f"{len(prompts) * self.n} choices, more than {MAX_PROMPT_CHOICES}")
        return prompts

    def asked_max_tokens(self) -> int:
        return COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens

    def to_request(self, request_id: str, prompt_ids: list[int], defaults: SamplingParams) -> Request:
        """echo with logprobs: the prompt tokens' logprobs too; max_tokens 0 with echo: the prompt alone
        (with its logprobs, as eval harnesses ask)."""
        max_tokens = self.asked_max_tokens()
        if self.thinking_token_budget is not None:
            raise RequestError("thinking_token_budget", "chat only: the reasoning parser reads what a chat template "
                                                        "opens, not a raw prompt")
        req = self._request(request_id, prompt_ids, defaults, self.logprobs, max_tokens)
        if self.echo and (self.logprobs is not None or max_tokens == 0):
            req = replace(req, prompt_logprobs=max(self.logprobs or 0, self.prompt_logprobs or 0))
        elif max_tokens == 0:
            raise RequestError("max_tokens", "0 only with echo (the prompt alone)")
        return req


class ChatBody(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True  # vLLM's: end the prompt with the assistant's turn opening
    continue_final_message: StrictBool = False  # vLLM's: write on from the last (assistant) message's text
    tools: list[dict] | None = None  # router.gateway.tools
    tool_choice: StrictStr | dict | None = None
    parallel_tool_calls: StrictBool | None = None
    chat_template_kwargs: dict | None = None  # vLLM's: more template variables (Qwen3's enable_thinking, ...)
    _tool_choices: str = PrivateAttr(CHAT_CHOICES)  # the other tool choices, in the terms of the API asked

    def conversation(self) -> list[dict]:
        return conversation(self.messages)

    def template_options(self) -> dict[str, object]:
        return template_options(self.messages, self.add_generation_prompt, self.continue_final_message, self.tools,
                                self.chat_template_kwargs)

    def asked_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    def tool_calling(self, parser: str | None = None) -> ToolCalling | None:
        """parser: the router's --tool-call-parser (tool_choice "auto" needs one)."""
        return tool_calling(self.tools, self.tool_choice, self.parallel_tool_calls, parser, self._tool_choices)

    def to_request(self, request_id: str, prompt_ids: list[int], defaults: SamplingParams,
                   calling: ToolCalling | None = None) -> Request:
        """max_tokens unset: until EOS or the end of the context, as OpenAI's chat API does. calling: this
        body's tool_calling(), whose constraint the output follows."""
        max_tokens = self.asked_max_tokens()
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs", "needs logprobs: true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise RequestError("top_logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        req = self._request(request_id, prompt_ids, defaults, logprobs, max_tokens)
        if calling is not None and calling.auto:  # the model's own call markers may be special tokens (as vLLM)
            req = replace(req, skip_special_tokens=False)
        constraint = calling.constraint() if calling is not None else None
        if constraint is None:
            return req
        if req.constraint is not None:
            raise RequestError(req.constraint.field, "one output constraint per request (also given: tool_choice)")
        return replace(req, constraint=constraint)
