"""Tool calls (OpenAI's function calling) on chat completions.

    tools        [{"type": "function", "function": {name, description?, parameters?, strict?}}], checked,
                 and given to the chat template as transformers gives them (its `tools` variable)
    tool_choice  "none"      the answer is text (the template still sees the tools)
                 {"type": "function", "function": {"name": N}}
                             the answer is a call of N: the output is constrained to N's parameters
                             schema and is the call's arguments; finish_reason "stop", as OpenAI's
                 "required"  one call or more (exactly one with parallel_tool_calls: false): the output
                             is constrained to a JSON array of {"name": ..., "parameters": ...}, each
                             item one tool's; finish_reason "tool_calls"
                 "auto"      (OpenAI's default when tools are given) the model chooses, in its own
                             format: with --tool-call-parser hermes (Qwen2.5, Hermes 2/3: text, then
                             <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks) the blocks
                             become the calls; without a parser, a 400

A named or required answer is made a valid call by the grammar, whatever the model: no parser,
nothing to retry. A "required" answer cut short by max_tokens is not JSON yet, so it comes back as
content (finish_reason "length"); a named call cut short keeps its partial arguments, as it streamed
them. An "auto" answer whose blocks do not parse, or name no given tool, is text. Earlier calls sent
back as history (an assistant's tool_calls, role "tool" answers) reach the template with their
arguments parsed into objects, as templates that render tool calls expect.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from router.config import TOOL_PARSERS
from router.core import RequestError
from router.gateway.reasoning import without_partial
from router.structured import Constraint

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_NO_PARAMETERS = {"type": "object", "properties": {}}
MAX_TOOLS = 128  # OpenAI's limit
OPEN, CLOSE = "<tool_call>", "</tool_call>"  # hermes' blocks


@dataclass(frozen=True)
class ToolCalling:
    """What a chat request asks of its tools: a call of `name`; calls of any (`name` None); or, `auto`,
    text or calls as the model chooses, in hermes' format."""

    schemas: dict[str, dict]  # tool name -> its parameters' JSON schema
    name: str | None
    parallel: bool
    auto: bool = False

    @property
    def finish_reason(self) -> str:
        """The finish_reason of an answer with calls that ended by itself."""
        return "stop" if self.name else "tool_calls"

    def constraint(self) -> Constraint | None:
        if self.auto:
            return None
        if self.name is not None:
            return Constraint("json_schema", self.schemas[self.name], "tool_choice")
        item = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                           "required": ["name", "parameters"], "additionalProperties": False}
                          for name, schema in self.schemas.items()]}
        array = {"type": "array", "items": item, "minItems": 1}
        return Constraint("json_schema", array if self.parallel else {**array, "maxItems": 1}, "tool_choice")

    def answer(self, text: str) -> tuple[str | None, list[dict] | None]:
        """(content, calls) of a whole answer, calls in OpenAI's shape (arguments as JSON text); calls
        None when the answer is text (or cut short before its calls were complete)."""
        if self.name is not None:
            return None, [call(self.name, text)]
        if self.auto:
            return self._hermes(text)
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return text, None
        assert isinstance(items, list) and all(i["name"] in self.schemas for i in items), "the grammar's shape"
        return None, [call(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]

    def streamable(self, text: str) -> int:
        """How much of an unfinished answer may stream as content: an auto answer's text up to where a
        block opens (or might: a tail that could begin OPEN waits for the next tokens)."""
        if not self.auto:
            return 0
        at = text.find(OPEN)
        return at if at >= 0 else len(without_partial(text, OPEN))

    def _hermes(self, text: str) -> tuple[str | None, list[dict] | None]:
        at = text.find(OPEN)
        if at < 0:
            return text, None
        calls = []
        for block in text[at:].split(OPEN)[1:]:
            body = block.partition(CLOSE)[0]  # unclosed: the model ended right after its JSON (or was cut short)
            try:
                item = json.loads(body)
            except json.JSONDecodeError:
                return text, None
            if not isinstance(item, dict) or item.get("name") not in self.schemas:
                return text, None
            calls.append(call(item["name"], json.dumps(item.get("arguments", {}), ensure_ascii=False)))
        return text[:at] or None, calls if self.parallel else calls[:1]  # the text as written (as vLLM's)


def call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


# what to send instead of "auto" without a parser, in each API's terms
CHAT_CHOICES = '"required" (one call or more), a named function ({"type": "function", "function": {"name": ...}}) ' \
    'or "none"'


def tool_calling(tools: list[dict] | None, tool_choice: str | dict | None, parallel_tool_calls: bool | None,
                 parser: str | None = None, choices: str = CHAT_CHOICES) -> ToolCalling | None:
    """The checked choice; None when the answer is text. parser: the router's --tool-call-parser, which
    "auto" needs; choices: the other tool choices, as the request's API names them. Every error names
    its field."""
    schemas = _schemas(tools or [])
    if tool_choice is None:
        tool_choice = "auto" if schemas else "none"
    if tool_choice == "none":
        return None
    if not schemas:
        raise RequestError("tool_choice", "needs tools")
    parallel = parallel_tool_calls is not False
    if tool_choice == "required":
        return ToolCalling(schemas, None, parallel)
    if tool_choice == "auto":
        if parser is None:
            raise RequestError("tool_choice", '"auto" (the default when tools are given) needs the router started '
                                              "with --tool-call-parser (the model's own tool-call format: "
                                              f"{', '.join(TOOL_PARSERS)}); without it send {choices}")
        return ToolCalling(schemas, None, parallel, auto=True)
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise RequestError("tool_choice", 'must be "none", "auto", "required" or {"type": "function", '
                                          '"function": {"name": ...}}')
    if name not in schemas:
        raise RequestError("tool_choice.function.name", f"{name!r} is not one of the tools ({', '.join(schemas)})")
    return ToolCalling(schemas, name, parallel)


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
