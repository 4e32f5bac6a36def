"""OpenAI's Responses API request (/v1/responses), turned into the chat request it means.

    instructions                  a system message first
    input: "text"                 one user message
    input: [items]                messages ({"role", "content": text or input_text / output_text parts}),
                                  function_call items (an assistant's tool_calls: consecutive ones are
                                  one assistant turn), function_call_output items (role "tool"), reasoning
                                  items (the next assistant turn's reasoning_content)
    tools: [{"type": "function", "name", "parameters", ...}]   chat's tools (router.gateway.tools), as is tool_choice
    text.format                   response_format (json_schema, json_object)
    max_output_tokens, top_logprobs, temperature, top_p ...   their chat fields

    previous_response_id          the stored conversation's items first (router.gateway.responses_store)

`conversation` objects are a 400 (continue with previous_response_id, or send the history as input
items). Anything else Tandem does not do (built-in tools, images, a background response not stored)
is a 400 naming the field, never ignored. Background responses: router.gateway.background.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from router.core import RequestError
from router.gateway.openai_types import ChatBody, OpenAIBody


class ResponsesBody(OpenAIBody):
    model: StrictStr
    input: StrictStr | Annotated[list[dict], Field(min_length=1)]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    top_logprobs: StrictInt | None = None
    stream: StrictBool = False
    tools: list[dict] | None = None
    tool_choice: StrictStr | dict | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict | None = None
    store: StrictBool = True  # kept for previous_response_id and GET /v1/responses/{id} (OpenAI's default)
    previous_response_id: StrictStr | None = None
    conversation: StrictStr | dict | None = None
    include: list[StrictStr] | None = None
    truncation: StrictStr | None = None
    background: StrictBool = False
    # Tandem's and vLLM's extensions, as on chat
    top_k: StrictInt | None = None
    min_p: StrictFloat | StrictInt | None = None
    seed: StrictInt | None = None
    ignore_eos: StrictBool = False
    cache_salt: StrictStr | None = None

    include_usage: ClassVar[bool] = False  # the usage is in response.completed, always
    continuous_usage: ClassVar[bool] = False

    def input_items(self) -> list[dict]:
        """This turn's input as items (a text is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return self.input

    def chat(self, history: list[dict] | None = None) -> ChatBody:
        """The chat request this one means (every field checked there as on /v1/chat/completions).
        history: the items of the stored conversation previous_response_id continues."""
        if self.conversation is not None:
            raise RequestError("conversation", "not supported: continue with previous_response_id, or send the "
                                               "history as input items")
        if self.include:
            raise RequestError("include", f"not supported: {', '.join(self.include)}")
        if self.background and not self.store:
            raise RequestError("background", "a background response is stored (to be read back): store true")
        if self.truncation not in (None, "disabled"):
            raise RequestError("truncation", 'only "disabled" (a prompt past the context is a 400)')
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions is not None else []) + \
            _messages([*(history or []), *self.input_items()], first=-len(history or []))
        fields = {"model": self.model, "messages": messages, "max_tokens": self.max_output_tokens,
                  "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                  "seed": self.seed, "ignore_eos": self.ignore_eos, "cache_salt": self.cache_salt,
                  "parallel_tool_calls": self.parallel_tool_calls,
                  "tools": [_tool(t, i) for i, t in enumerate(self.tools)] if self.tools else None,
                  "tool_choice": _tool_choice(self.tool_choice), "response_format": _format(self.text)}
        if self.top_logprobs is not None:
            fields |= {"logprobs": True, "top_logprobs": self.top_logprobs}
        try:
            return ChatBody(**{k: v for k, v in fields.items() if v is not None})
        except ValueError as err:  # a message the chat body refuses: name the input item
            raise RequestError("input", str(err).splitlines()[0] if str(err) else "invalid") from None


def _text(content: object, field: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(field, "a text or a list of text parts")
    parts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            raise RequestError(f"{field}.{i}", "only text parts (input_text, output_text) are supported")
        parts.append(part["text"])
    return "".join(parts)


def _messages(items: list[dict], first: int = 0) -> list[dict]:
    """Input items as chat messages. A function_call joins the assistant turn just before it (its
    text, or its other calls); a reasoning item is the next assistant turn's reasoning_content.
    first: the index errors give the first item (the stored history's come before input.0)."""
    out: list[dict] = []
    thinking: str | None = None

    def assistant() -> dict:
        nonlocal thinking
        message: dict = {"role": "assistant", "content": None}
        if thinking is not None:
            message["reasoning_content"], thinking = thinking, None
        out.append(message)
        return message

    for i, item in enumerate(items, start=first):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(f"input.{i}.role", "user, system, developer or assistant")
            message = assistant() if role == "assistant" else {"role": role}
            message["content"] = _text(item.get("content"), f"input.{i}.content")
            if role != "assistant":
                out.append(message)
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise RequestError(f"input.{i}", "a function_call needs call_id, name and arguments (strings)")
            last = out[-1] if out and out[-1]["role"] == "assistant" else assistant()
            last.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise RequestError(f"input.{i}.call_id", "the call this output answers")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(item.get("output"), f"input.{i}.output")})
        elif kind == "reasoning":
            texts = [c.get("text", "") for c in item.get("content") or [] if isinstance(c, dict)]
            thinking = "".join(t for t in texts if isinstance(t, str)) or None
        else:
            raise RequestError(f"input.{i}.type", f"{kind!r} is not supported (message, function_call, "
                                                  "function_call_output and reasoning are)")
    return out


def _tool(tool: dict, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise RequestError(f"tools.{i}.type", f"{kind!r} is not supported: function tools only")
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice: str | dict | None) -> str | dict | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "answer"), "schema": fmt.get("schema")}}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    raise RequestError("text.format.type", "text, json_object or json_schema")
