"""Anthropic's Messages API answers, from the chat answer (router.gateway.openai_format.ChatFormat) they are:

    reasoning_content   a "thinking" block (signature "": Tandem signs nothing)
    content             a "text" block
    tool_calls          one "tool_use" block each (id the chat call's id, input its parsed arguments)

    stop_reason   end_turn (EOS), stop_sequence (with the one that matched), tool_use (the answer calls),
                  max_tokens, model_context_window_exceeded (the context ended it before max_tokens)
    usage         input_tokens (the prompt less what the prefix cache held), cache_read_input_tokens

Streamed as Anthropic's events, each `event: TYPE` with its JSON:

    message_start (the message, content empty)
    per block:  content_block_start, content_block_delta (text_delta / thinking_delta / input_json_delta) ...,
                content_block_stop
    message_delta (stop_reason, stop_sequence, usage), message_stop
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi.responses import JSONResponse, Response

from router.core import Delta
from router.gateway.messages_body import MessagesBody
from router.gateway.openai_format import ChatFormat, count_usage

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
_DELTA = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking"),
          "tool_use": ("input_json_delta", "partial_json")}


def anthropic_error(response: Response) -> Response:
    """An OpenAI-shaped error response in Anthropic's shape ({"type": "error", "error": {type, message}})."""
    if response.status_code < 400 or not isinstance(response, JSONResponse):
        return response
    err = json.loads(bytes(response.body)).get("error") or {}
    headers = {k: v for k, v in response.headers.items() if k.lower() in ("retry-after", "www-authenticate")}
    return JSONResponse(_error_body(response.status_code, err.get("message", "")), response.status_code,
                        headers=headers)


def _error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


class MessagesFormat:
    def __init__(self, chat: ChatFormat, body: MessagesBody, model: str) -> None:
        self.chat, self.body, self.model = chat, body, model
        self.id = f"msg_{uuid.uuid4().hex}"
        self.blocks: list[dict] = []  # the content written so far
        self.open = False  # the last block is still being written
        self.finish: str | None = None  # the chat finish_reason
        self.stop_string: str | None = None  # the stop sequence that ended it

    # -- the whole answer -------------------------------------------------------------------------------

    def whole(self, deltas: list[Delta]) -> dict:
        [choice] = self.chat.whole(deltas)["choices"]
        message = choice["message"]
        self.finish, self.stop_string = choice["finish_reason"], _stop_string(deltas[-1])
        if message.get("reasoning_content"):
            self.blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            self.blocks.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or []:
            self.blocks.append(_tool_use(call["id"], call["function"]["name"], call["function"]["arguments"]))
        return self._message(deltas)

    def _message(self, deltas: list[Delta] | None) -> dict:
        """The message object; deltas None: just started (no answer, the prompt's tokens alone)."""
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.blocks if deltas is not None else [],
                "stop_reason": self._stop_reason(deltas) if deltas is not None else None,
                "stop_sequence": self.stop_string if deltas is not None else None, "usage": self._usage(deltas)}

    def _stop_reason(self, deltas: list[Delta]) -> str:
        if self.finish == "length":
            asked = self.body.max_tokens
            return "max_tokens" if count_usage(deltas, 1)["completion_tokens"] >= asked \
                else "model_context_window_exceeded"
        if any(b["type"] == "tool_use" for b in self.blocks):
            return "tool_use"
        return "stop_sequence" if self.stop_string is not None else "end_turn"

    def _usage(self, deltas: list[Delta] | None) -> dict:
        if deltas is None:
            prompt, cached, output = len(self.chat.req.prompt_ids), 0, 0
        else:
            usage = count_usage(deltas, 1)
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            prompt, output = usage["prompt_tokens"], usage["completion_tokens"]
        return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
                "output_tokens": output}

    # -- streamed ---------------------------------------------------------------------------------------

    @staticmethod
    def _event(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    def opening(self) -> list[str]:
        return [self._event("message_start", message=self._message(None))]

    def events(self, d: Delta) -> list[str]:
        if (choice := self.chat.streamed_choice(d)) is None:
            return []
        delta, out = choice["delta"], []
        if delta.get("reasoning_content"):
            out += self._write("thinking", delta["reasoning_content"])
        if delta.get("content"):
            out += self._write("text", delta["content"])
        for call in delta.get("tool_calls") or []:
            if call.get("id"):  # a new call
                out += self._begin({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                                    "input": {}})
            if call["function"].get("arguments"):
                out += self._write("tool_use", call["function"]["arguments"])
        if choice["finish_reason"]:
            self.finish, self.stop_string = choice["finish_reason"], _stop_string(d)
        return out

    def closing(self, seen: list[Delta], usage: bool, failed: bool = False) -> list[str]:
        if failed:
            return []
        message = self._message(seen)
        return [*self._close(), self._event("message_delta", delta={"stop_reason": message["stop_reason"],
                                                                    "stop_sequence": message["stop_sequence"]},
                                            usage=message["usage"]),
                self._event("message_stop")]

    def error_event(self, error: dict) -> str:
        e = error["error"]
        status = e.get("code") if isinstance(e.get("code"), int) else 500
        return self._event("error", error=_error_body(status, e["message"])["error"])

    def _begin(self, block: dict) -> list[str]:
        out = self._close()
        self.blocks.append(block)
        self.open = True
        start = {**block, "input": {}} if block["type"] == "tool_use" else {**block}
        return [*out, self._event("content_block_start", index=len(self.blocks) - 1, content_block=start)]

    def _write(self, kind: str, text: str) -> list[str]:
        out = [] if self.open and self.blocks[-1]["type"] == kind else \
            self._begin({"type": "text", "text": ""} if kind == "text" else
                        {"type": "thinking", "thinking": "", "signature": ""})
        block = self.blocks[-1]
        field = "arguments" if kind == "tool_use" else kind
        block[field] = block.get(field, "") + text
        delta_type, key = _DELTA[kind]
        return [*out, self._event("content_block_delta", index=len(self.blocks) - 1,
                                  delta={"type": delta_type, key: text})]

    def _close(self) -> list[str]:
        if not self.open:
            return []
        self.open = False
        block = self.blocks[-1]
        if block["type"] == "tool_use":
            self.blocks[-1] = _tool_use(block["id"], block["name"], block.pop("arguments", ""))
        return [self._event("content_block_stop", index=len(self.blocks) - 1)]


def _stop_string(d: Delta) -> str | None:
    return d.stop_reason if isinstance(d.stop_reason, str) else None


def _tool_use(call_id: str, name: str, arguments: str) -> dict:
    """A tool_use block; arguments that do not parse (cut short by max_tokens) come back as a text block."""
    try:
        parsed = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {"type": "text", "text": arguments}
    return {"type": "tool_use", "id": call_id, "name": name, "input": parsed if isinstance(parsed, dict) else {}}
