"""vLLM's /tokenize and /detokenize request bodies."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from router.core import RequestError
from router.gateway.conversation import ChatMessage, conversation, template_options


class TokenizeBody(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered as /v1/chat/completions renders them."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    tools: list[dict] | None = None
    chat_template_kwargs: dict | None = None

    def chat(self) -> tuple[list[dict], dict[str, object]] | None:
        """The conversation and its template options, checked; None when a prompt was given instead."""
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("prompt", "give prompt or messages, one of them")
        if self.messages is None:
            return None
        return conversation(self.messages), template_options(self.messages, self.add_generation_prompt,
                                                             self.continue_final_message, self.tools,
                                                             self.chat_template_kwargs)


class DetokenizeBody(BaseModel):
    """vLLM's /detokenize: token ids to text, as an answer shows it (special tokens skipped)."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr
    tokens: list[StrictInt]
