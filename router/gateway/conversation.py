"""A chat request's messages (OpenAI's shape, vLLM's extensions) as the chat template gets them, and the
template's options, checked. Every door that renders a conversation goes through here: chat,
Responses and Messages (their bodies become a chat body), /tokenize."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, StrictStr

from router.core import RequestError
from router.gateway.tools import history_calls


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")  # audio, refusal, ...: a 400 naming them, not silently dropped
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[dict] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls, sent back as history
    tool_call_id: StrictStr | None = None  # a tool's answer: which call it answers
    reasoning_content: StrictStr | None = None  # an assistant's earlier thinking, for templates that render it

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError("messages.content", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)



def conversation(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template gets them (transformers' shape)."""
    out = []
    for i, m in enumerate(messages):
        message: dict = {"role": m.role, "content": m.text()}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls is not None:
            if m.role != "assistant":
                raise RequestError(f"messages.{i}.tool_calls", "only an assistant's message carries tool calls")
            message["tool_calls"] = history_calls(m.tool_calls, f"messages.{i}.tool_calls")
        if m.tool_call_id is not None:
            if m.role != "tool":
                raise RequestError(f"messages.{i}.tool_call_id", "only a tool's message answers a tool call")
            message["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            if m.role != "assistant":
                raise RequestError(f"messages.{i}.reasoning_content", "only an assistant's message carries reasoning")
            message["reasoning_content"] = m.reasoning_content
        out.append(message)
    return out


def template_options(messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool,
                     tools: list[dict] | None = None, kwargs: dict | None = None) -> dict[str, object]:
    """ChatFormatter.render's options, checked: continuing the last message needs it to be the
    assistant's, and no new turn opened after it; the tools where given; the request's own template
    variables (chat_template_kwargs), which may not replace those, or the messages."""
    if continue_final_message and (add_generation_prompt or messages[-1].role != "assistant"):
        raise RequestError("continue_final_message", "needs add_generation_prompt: false and an assistant message "
                                                     "last")
    options: dict[str, object] = {"add_generation_prompt": add_generation_prompt,
                                  "continue_final_message": continue_final_message}
    if tools:
        options["tools"] = tools
    if taken := sorted(set(kwargs or {}) & {*options, "messages", "tools"}):
        raise RequestError("chat_template_kwargs", f"may not set {', '.join(taken)} (the request's own fields do)")
    return {**(kwargs or {}), **options}
