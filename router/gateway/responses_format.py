"""OpenAI's Responses API answers, from the chat answer (router.gateway.openai_format.ChatFormat) they are:

    reasoning_content   a "reasoning" item (its text as reasoning_text content)
    content             a "message" item with one output_text part
    tool_calls          one "function_call" item each (call_id the chat call's id)

Streamed as OpenAI's semantic events, each `event: TYPE` with its JSON (type, sequence_number):

    response.created, response.in_progress
    per item:  response.output_item.added, response.content_part.added (message, reasoning),
               response.output_text.delta / reasoning_text.delta / function_call_arguments.delta ...,
               response.output_text.done / reasoning_text.done / function_call_arguments.done,
               response.content_part.done (message, reasoning), response.output_item.done
    response.completed (or response.incomplete, reason max_output_tokens), the whole response in it

usage.input_tokens_details.cached_tokens: the prompt tokens the target's prefix cache held.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from router.core import Delta
from router.gateway.openai_format import ChatFormat
from router.gateway.responses_body import ResponsesBody

_TEXT_EVENT = {"message": "output_text", "reasoning": "reasoning_text"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesFormat:
    def __init__(self, chat: ChatFormat, body: ResponsesBody, model: str,
                 keep: Callable[[dict], None] | None = None) -> None:
        """keep: stores the finished response (router.gateway.responses_store); None: not stored."""
        self.chat, self.body, self.model, self.keep = chat, body, model, keep
        self.id, self.created = _id("resp"), time.time()
        self.seq = 0
        self.output: list[dict] = []  # the items written so far
        self.open: dict | None = None  # the one being written
        self.open_text = ""  # its text so far
        self.open_logprobs: list[dict] = []  # and its tokens' logprobs (a message's)
        self.unsent_logprobs: list[dict] = []  # of tokens whose text has not come yet
        self.finish: str | None = None

    # -- the whole answer -------------------------------------------------------------------------------

    def whole(self, deltas: list[Delta]) -> dict:
        [choice] = self.chat.whole(deltas)["choices"]
        message, self.finish = choice["message"], choice["finish_reason"]
        if message.get("reasoning_content"):
            self.output.append(self._item("reasoning", text=message["reasoning_content"]))
        if message.get("content"):
            self.output.append(self._item("message", text=message["content"]))
            if choice["logprobs"] is not None and not message.get("reasoning_content"):  # the text's tokens alone
                self.output[-1]["content"][0]["logprobs"] = _logprobs(choice["logprobs"])
        for call in message.get("tool_calls") or []:
            self.output.append(self._item("function_call", call_id=call["id"], name=call["function"]["name"],
                                          text=call["function"]["arguments"]))
        if self.output and self.finish == "length":
            self.output[-1]["status"] = "incomplete"
        return self._finished(deltas)

    def pending(self, status: str) -> dict:
        """The response before its answer: queued, in_progress, or cancelled (background responses)."""
        return self._response(None, status)

    def failed(self, message: str) -> dict:
        return {**self._response(None, "failed"), "error": {"code": "server_error", "message": message}}

    def _finished(self, deltas: list[Delta]) -> dict:
        response = self._response(deltas)
        if self.keep is not None:
            self.keep(response)
        return response

    def _item(self, kind: str, text: str = "", status: str = "completed", **fields: str) -> dict:
        item: dict[str, Any] = {"id": _id({"message": "msg", "reasoning": "rs"}.get(kind, "fc")), "type": kind,
                                "status": status}
        if kind == "message":
            item |= {"role": "assistant", "content": [_part(kind, text)] if status != "in_progress" else []}
        elif kind == "reasoning":
            item |= {"summary": [], "content": [_part(kind, text)] if status != "in_progress" else []}
        else:
            item |= {**fields, "arguments": text}
        return item

    def _response(self, deltas: list[Delta] | None, status: str | None = None) -> dict:
        """The response object; deltas None: still in progress (no usage yet)."""
        if status is None:
            status = "incomplete" if self.finish == "length" else "completed"
        body, usage = self.body, self.chat.usage(deltas) if deltas else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model, "status": status,
            "completed_at": time.time() if deltas is not None else None, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "output": self.output, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": None, "store": self.keep is not None,
            "background": body.background,
            "temperature": body.temperature, "top_p": body.top_p, "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [], "text": body.text or {"format": {"type": "text"}}, "truncation": "disabled",
            "metadata": {}, "usage": None if usage is None else {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                         "cache_write_tokens": 0},
                "output_tokens": usage["completion_tokens"], "output_tokens_details": {
                    "reasoning_tokens": usage.get("completion_tokens_details", {}).get("reasoning_tokens", 0)},
                "total_tokens": usage["total_tokens"]},
        }

    # -- streamed ---------------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def opening(self) -> list[str]:
        return [self._event("response.created", response=self._response(None, "in_progress")),
                self._event("response.in_progress", response=self._response(None, "in_progress"))]

    def events(self, d: Delta) -> list[str]:
        if (choice := self.chat.streamed_choice(d)) is None:
            return []
        delta, out = choice["delta"], []
        if delta.get("reasoning_content"):
            out += self._write("reasoning", delta["reasoning_content"])
        if choice["logprobs"] and not delta.get("reasoning_content"):  # (a token may bring no text yet)
            self.unsent_logprobs += _logprobs(choice["logprobs"])
        if delta.get("content"):
            out += self._write("message", delta["content"], self.unsent_logprobs)
            self.unsent_logprobs = []
        for call in delta.get("tool_calls") or []:
            if call.get("id"):  # a new call
                out += self._close()
                out += self._begin(self._item("function_call", status="in_progress", call_id=call["id"],
                                              name=call["function"]["name"]))
            if call["function"].get("arguments"):
                out += self._write("function_call", call["function"]["arguments"])
        if choice["finish_reason"]:
            self.finish = choice["finish_reason"]
        return out

    def closing(self, seen: list[Delta], usage: bool, failed: bool = False) -> list[str]:
        if failed:
            return []
        out = self._close("incomplete" if self.finish == "length" else "completed")
        response = self._finished(seen)
        return [*out, self._event("response.incomplete" if response["status"] == "incomplete"
                                  else "response.completed", response=response)]

    def error_event(self, error: dict) -> str:
        e = error["error"]
        return self._event("error", code=str(e.get("code")), message=e["message"], param=e.get("param"))

    def _begin(self, item: dict) -> list[str]:
        self.output.append(item)
        self.open = item
        index = len(self.output) - 1
        out = [self._event("response.output_item.added", output_index=index, item=item)]
        if item["type"] in _TEXT_EVENT:
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part=_part(item["type"], "")))
        return out

    def _write(self, kind: str, text: str, logprobs: list[dict] | None = None) -> list[str]:
        out = [] if self.open is not None and self.open["type"] == kind else \
            self._close() + self._begin(self._item(kind, status="in_progress"))
        item, index = self.open, len(self.output) - 1
        assert item is not None
        self.open_text += text
        self.open_logprobs += logprobs or []
        if kind == "function_call":
            item["arguments"] += text
            return [*out, self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=text)]
        extra = {"logprobs": logprobs or []} if kind == "message" else {}
        return [*out, self._event(f"response.{_TEXT_EVENT[kind]}.delta", item_id=item["id"], output_index=index,
                                  content_index=0, delta=text, **extra)]

    def _close(self, status: str = "completed") -> list[str]:
        item, text, logprobs = self.open, self.open_text, self.open_logprobs
        if item is not None and item["type"] == "message":
            logprobs, self.unsent_logprobs = logprobs + self.unsent_logprobs, []
        self.open, self.open_text, self.open_logprobs = None, "", []
        if item is None:
            return []
        index = len(self.output) - 1
        item["status"] = status
        if item["type"] == "function_call":
            return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                arguments=item["arguments"]),
                    self._event("response.output_item.done", output_index=index, item=item)]
        kind, part = item["type"], _part(item["type"], text)
        extra = {"logprobs": logprobs} if kind == "message" else {}
        if logprobs:
            part["logprobs"] = logprobs
        item["content"] = [part]
        return [self._event(f"response.{_TEXT_EVENT[kind]}.done", item_id=item["id"], output_index=index,
                            content_index=0, text=text, **extra),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=index, item=item)]


def _logprobs(chat: dict | None) -> list[dict]:
    """Chat's logprobs in the Responses shape (with each token's UTF-8 bytes, as output_text parts have them)."""
    def one(entry: dict) -> dict:
        return {"token": entry["token"], "bytes": list(entry["token"].encode()), "logprob": entry["logprob"]}

    return [{**one(e), "top_logprobs": [one(t) for t in e["top_logprobs"]]} for e in (chat or {}).get("content", [])]


def _part(kind: str, text: str) -> dict:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "reasoning_text", "text": text}
