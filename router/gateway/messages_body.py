"""Anthropic's Messages API request (/v1/messages), turned into the chat request it means.

    system: text or text blocks          a system message first
    messages: [{"role", "content"}]      user and assistant turns; content a text or blocks:
        text                               the turn's text
        tool_use      (assistant)          an OpenAI tool call: id, name, input as its JSON arguments
        thinking      (assistant)          the turn's reasoning_content (redacted_thinking: left out)
        tool_result   (user)               a role "tool" message answering tool_use_id, before the turn's text
    tools: [{"name", "description", "input_schema"}]   chat's function tools (router.gateway.tools)
    tool_choice: auto | any | tool (name) | none        "auto" | "required" | that function | "none";
                 disable_parallel_tool_use              parallel_tool_calls false
    thinking: {"type": "disabled"}       the template told not to think (chat_template_kwargs enable_thinking)
    output_config.format (json_schema)   response_format
    stop_sequences, max_tokens, temperature, top_p, top_k   their chat fields

cache_control marks are accepted and change nothing: Tandem's prefix cache reuses a prompt's cached
blocks without being asked. Images, documents, server tools, containers: a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Annotated, ClassVar

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from router.core import RequestError
from router.gateway.openai_types import ChatBody, OpenAIBody

MESSAGES_CHOICES = '{"type": "any"} (one call or more), {"type": "tool", "name": ...} or {"type": "none"}'


class MessagesBody(OpenAIBody):
    model: StrictStr
    max_tokens: StrictInt | None = None  # required to answer, as in Anthropic's API (counting tokens needs none)
    messages: Annotated[list[dict], Field(min_length=1)]
    system: StrictStr | list[dict] | None = None
    stop_sequences: list[StrictStr] | None = None
    stream: StrictBool = False
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    top_k: StrictInt | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None
    output_config: dict | None = None
    cache_control: dict | None = None  # accepted: prefix caching needs no marks
    # Tandem's and vLLM's extensions, as on chat
    min_p: StrictFloat | StrictInt | None = None
    seed: StrictInt | None = None
    ignore_eos: StrictBool = False

    include_usage: ClassVar[bool] = False  # the usage is in message_start and message_delta, always
    continuous_usage: ClassVar[bool] = False

    def chat(self, counting: bool = False, budgets: bool = False) -> ChatBody:
        """The chat request this one means (every field checked there as on /v1/chat/completions; its
        refusals of a tool choice name this API's). counting: for /v1/messages/count_tokens, which needs
        no max_tokens; budgets: thinking.budget_tokens is enforced (the router reads thinking: it has a
        --reasoning-parser), as chat's thinking_token_budget."""
        if self.max_tokens is None and not counting:
            raise RequestError("max_tokens", "required")
        system = [] if self.system is None else [{"role": "system", "content": _text(self.system, "system")}]
        choice, parallel = _tool_choice(self.tool_choice)
        fields = {"model": self.model, "messages": system + _messages(self.messages), "max_tokens": self.max_tokens,
                  "stop": self.stop_sequences, "temperature": self.temperature, "top_p": self.top_p,
                  "top_k": self.top_k, "min_p": self.min_p, "seed": self.seed, "ignore_eos": self.ignore_eos,
                  "tools": [_tool(t, i) for i, t in enumerate(self.tools)] if self.tools else None,
                  "tool_choice": choice, "parallel_tool_calls": parallel,
                  "response_format": _format(self.output_config),
                  "chat_template_kwargs": _thinking(self.thinking),
                  "thinking_token_budget": _budget(self.thinking) if budgets else None}
        if self.messages[-1].get("role") == "assistant":  # a prefill: the answer writes on from its text
            fields |= {"add_generation_prompt": False, "continue_final_message": True}
        try:
            chat = ChatBody(**{k: v for k, v in fields.items() if v is not None})
        except ValueError as err:  # a message the chat body refuses: name the messages
            raise RequestError("messages", str(err).splitlines()[0] if str(err) else "invalid") from None
        chat._tool_choices = MESSAGES_CHOICES
        return chat


def _text(content: object, field: str) -> str:
    """A text, or text blocks joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(field, "a text or a list of text blocks")
    return "".join(_block_text(block, f"{field}.{i}") for i, block in enumerate(content))


def _block_text(block: object, field: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else None
        raise RequestError(f"{field}.type", f"{kind!r} is not supported here: text blocks only")
    return block["text"]


def _messages(messages: list[dict]) -> list[dict]:
    out: list[dict] = []
    for i, m in enumerate(messages):
        role, content, field = m.get("role"), m.get("content"), f"messages.{i}"
        if role not in ("user", "assistant"):
            raise RequestError(f"{field}.role", "user or assistant")
        if set(m) - {"role", "content"}:
            raise RequestError(field, f"unsupported keys: {', '.join(sorted(set(m) - {'role', 'content'}))}")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise RequestError(f"{field}.content", "a text or a list of content blocks")
        out += _assistant(blocks, field) if role == "assistant" else _user(blocks, field)
    return out


def _kinds(blocks: list, field: str, allowed: tuple[str, ...]) -> None:
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in allowed:
            raise RequestError(f"{field}.content.{j}.type", f"{kind!r} is not supported here ({', '.join(allowed)} "
                                                           f"are)")


def _user(blocks: list, field: str) -> list[dict]:
    """Tool results first (each a role "tool" message, as chat templates expect right after the calls),
    then the turn's text."""
    _kinds(blocks, field, ("text", "tool_result"))
    out: list[dict] = []
    for j, block in enumerate(blocks):
        if block["type"] == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise RequestError(f"{field}.content.{j}.tool_use_id", "the tool_use this result answers")
            result = block.get("content", "")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": _text(result, f"{field}.content.{j}.content")})
    text = [_block_text(b, f"{field}.content.{j}") for j, b in enumerate(blocks) if b["type"] == "text"]
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant(blocks: list, field: str) -> list[dict]:
    _kinds(blocks, field, ("text", "tool_use", "thinking", "redacted_thinking"))
    message: dict = {"role": "assistant", "content": "".join(b["text"] for b in blocks if b["type"] == "text")}
    calls = []
    for j, block in enumerate(blocks):
        if block["type"] == "tool_use":
            if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                    and isinstance(block.get("input"), dict)):
                raise RequestError(f"{field}.content.{j}", "a tool_use needs id, name (strings) and input (an object)")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
        elif block["type"] == "thinking" and isinstance(block.get("thinking"), str):
            message["reasoning_content"] = message.get("reasoning_content", "") + block["thinking"]
    if calls:
        message["tool_calls"] = calls
        message["content"] = message["content"] or None
    return [message]


def _tool(tool: dict, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or "input_schema" not in tool:
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise RequestError(f"tools.{i}", f"{kind!r} is not supported: client tools (name, input_schema) only")
    fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict | None) -> tuple[str | dict | None, bool | None]:
    """(chat's tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    raise RequestError("tool_choice.type", "auto, any, tool or none")


def _format(config: dict | None) -> dict | None:
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise RequestError("output_config.format.type", "json_schema")
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": fmt.get("schema")}}


def _budget(thinking: dict | None) -> int | None:
    budget = (thinking or {}).get("budget_tokens") if (thinking or {}).get("type") == "enabled" else None
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
        raise RequestError("thinking.budget_tokens", "an integer >= 0")
    return budget


def _thinking(thinking: dict | None) -> dict | None:
    """Extended thinking: a reasoning model thinks unless told not to."""
    kind = (thinking or {}).get("type")
    if kind not in (None, "enabled", "disabled", "adaptive"):
        raise RequestError("thinking.type", "enabled, disabled or adaptive")
    return {"enable_thinking": False} if kind == "disabled" else None
