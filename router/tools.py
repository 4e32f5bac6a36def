"""Tool calls (OpenAI's function calling) on chat completions, enforced by structured output.

    tools        [{"type": "function", "function": {name, description?, parameters?, strict?}}], checked,
                 and given to the chat template as transformers gives them (its `tools` variable)
    tool_choice  "none"      the answer is text (the template still sees the tools)
                 {"type": "function", "function": {"name": N}}
                             the answer is a call of N: the output is constrained to N's parameters
                             schema and is the call's arguments; finish_reason "stop", as OpenAI's
                 "required"  one call or more (exactly one with parallel_tool_calls: false): the output
                             is constrained to a JSON array of {"name": ..., "parameters": ...}, each
                             item one tool's; finish_reason "tool_calls"
                 "auto"      (OpenAI's default when tools are given) a 400: choosing between text and a
                             call takes a parser of the model's own tool-call format, which Tandem has not

The grammar makes every completed answer a valid call, whatever the model: no parser, nothing to
retry. A "required" answer cut short by max_tokens is not JSON yet, so it comes back as content
(finish_reason "length"); a named call cut short keeps its partial arguments, as it streamed them.
Earlier calls sent back as history (an assistant's tool_calls, role "tool" answers) reach the
template with their arguments parsed into objects, as templates that render tool calls expect.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from router.core import RequestError
from router.structured import Constraint

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_NO_PARAMETERS = {"type": "object", "properties": {}}
MAX_TOOLS = 128  # OpenAI's limit


@dataclass(frozen=True)
class ToolCalling:
    """What a chat request asks of its tools: a call of `name`, or calls of any (`name` None)."""

    schemas: dict[str, dict]  # tool name -> its parameters' JSON schema
    name: str | None
    parallel: bool

    @property
    def finish_reason(self) -> str:
        return "stop" if self.name else "tool_calls"

    def constraint(self) -> Constraint:
        if self.name is not None:
            return Constraint("json_schema", self.schemas[self.name], "tool_choice")
        item = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                           "required": ["name", "parameters"], "additionalProperties": False}
                          for name, schema in self.schemas.items()]}
        array = {"type": "array", "items": item, "minItems": 1}
        return Constraint("json_schema", array if self.parallel else {**array, "maxItems": 1}, "tool_choice")

    def calls(self, text: str) -> list[dict] | None:
        """The answer's calls in OpenAI's shape, arguments as JSON text; None when it is no complete
        list of calls (cut short)."""
        if self.name is not None:
            return [call(self.name, text)]
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return None
        assert isinstance(items, list) and all(i["name"] in self.schemas for i in items), "the grammar's shape"
        return [call(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]


def call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def tool_calling(tools: list[dict] | None, tool_choice: str | dict | None,
                 parallel_tool_calls: bool | None) -> ToolCalling | None:
    """The checked choice; None when the answer is text. Every error names its field."""
    schemas = _schemas(tools or [])
    if tool_choice is None:
        tool_choice = "auto" if schemas else "none"
    if tool_choice == "none":
        return None
    if not schemas:
        raise RequestError("tool_choice", "needs tools")
    if tool_choice == "required":
        return ToolCalling(schemas, None, parallel_tool_calls is not False)
    if tool_choice == "auto":
        raise RequestError("tool_choice", '"auto" (the default when tools are given) is not supported: it takes a '
                                          "parser of the model's own tool-call format; send \"required\" (one call "
                                          'or more), a named function ({"type": "function", "function": {"name": '
                                          '...}}) or "none"')
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise RequestError("tool_choice", 'must be "none", "auto", "required" or {"type": "function", '
                                          '"function": {"name": ...}}')
    if name not in schemas:
        raise RequestError("tool_choice.function.name", f"{name!r} is not one of the tools ({', '.join(schemas)})")
    return ToolCalling(schemas, name, parallel_tool_calls is not False)


def _schemas(tools: list[dict]) -> dict[str, dict]:
    if len(tools) > MAX_TOOLS:
        raise RequestError("tools", f"at most {MAX_TOOLS} tools")
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise RequestError(f"tools.{i}", 'must be {"type": "function", "function": {"name": ..., ...}}')
        name, parameters = fn.get("name"), fn.get("parameters", _NO_PARAMETERS)
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise RequestError(f"tools.{i}.function.name", "1-64 letters, digits, _ or -")
        if name in schemas:
            raise RequestError(f"tools.{i}.function.name", f"{name!r} is given twice")
        if not isinstance(parameters, dict):
            raise RequestError(f"tools.{i}.function.parameters", "must be a JSON schema object")
        schemas[name] = parameters
    return schemas


def history_calls(tool_calls: list[dict], field: str) -> list[dict]:
    """An assistant's earlier calls as the template gets them: arguments parsed (templates tojson
    them), as vLLM passes them."""
    out = []
    for i, tc in enumerate(tool_calls):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise RequestError(f"{field}.{i}", 'must be {"id": ..., "type": "function", "function": {"name": ..., '
                                               '"arguments": "<JSON text>"}}')
        try:
            arguments = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            arguments = fn["arguments"]
        out.append({**tc, "function": {**fn, "arguments": arguments}})
    return out
