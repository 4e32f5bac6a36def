"""OpenAI response shapes for completions and chat: streamed chunks, the usage chunk, whole answers."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router.core import Delta, FinishReason, Request
from router.gateway.reasoning import Reasoning
from router.gateway.tools import ToolCalling, call


def _finish(delta: Delta) -> str | None:
    if delta.finish_reason is None:
        return None
    return "stop" if delta.finish_reason in (FinishReason.STOP, FinishReason.ABORT) else delta.finish_reason.value


def count_usage(deltas: list[Delta], n: int) -> dict:
    """Each prompt once (choices p x n .. p x n + n - 1 share prompt p), the completion tokens of every choice,
    and (OpenAI's prompt_tokens_details) the prompt tokens the target's prefix cache held."""
    last = {d.index: d for d in deltas}
    prompt = sum({i // n: d.prompt_tokens for i, d in last.items()}.values())
    cached: dict[int, int] = {}
    for i, d in last.items():  # a prompt's choices fork its computation: the one that attached says how much
        cached[i // n] = max(cached.get(i // n, 0), d.cached_tokens)
    completion = sum(d.completion_tokens for d in last.values())
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}
    predicted = [d.prediction for d in last.values() if d.prediction is not None]
    if predicted:  # OpenAI's: the predicted tokens verified, accepted into the answer or not
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": sum(a for a, _ in predicted),
                                              "rejected_prediction_tokens": sum(r for _, r in predicted)}
    return usage


def by_choice(deltas: list[Delta]) -> list[list[Delta]]:
    """A request's deltas split by choice index (n > 1 interleaves them)."""
    choices: dict[int, list[Delta]] = {}
    for d in deltas:
        choices.setdefault(d.index, []).append(d)
    return [choices[i] for i in sorted(choices)]


def _top_by_text(top: list[tuple[int, float]], dec) -> dict[str, float]:  # noqa: ANN001
    """OpenAI's completions top_logprobs are keyed by token text; when two alternatives decode alike
    (byte tokens of a partial UTF-8 character), the more likely one keeps the key."""
    out: dict[str, float] = {}
    for t, v in top:  # best first
        out.setdefault(dec([t]), v)
    return out


class CompletionFormat:
    object_name = "text_completion"
    chunk_name = "text_completion"

    def __init__(self, decode, model: str, req: Request, token_ids: bool,  # noqa: ANN001
                 metrics: Callable[[], dict[str, Any]] | None = None,
                 echo: list[tuple[str, list[int]]] | None = None) -> None:
        self.decode, self.model, self.req, self.created = decode, model, req, int(time.time())
        self.token_ids = token_ids
        self.metrics = metrics  # usage.tandem_metrics, read when the usage is written
        self.echo = echo  # per prompt, its text and ids: each choice's text (and logprobs) start with them
        self._started: set[int] = set()  # choices whose first chunk was written
        self.continuous_usage = False  # vLLM's continuous_usage_stats: every chunk carries the usage so far
        self.prompt_top: int | None = None  # vLLM's prompt_logprobs, when asked: its top alternatives
        self._latest: dict[int, Delta] = {}  # each choice's last delta streamed: the usage so far

    def usage(self, deltas: list[Delta]) -> dict:
        usage = count_usage(deltas, self.req.n)
        if self.metrics is not None:
            usage["tandem_metrics"] = self.metrics()
        return usage

    def _with_ids(self, choice: dict, deltas: list[Delta]) -> dict:
        if self.token_ids:
            choice["token_ids"] = [t for d in deltas for t in d.token_ids]
        return choice

    def _logprobs(self, deltas: list[Delta], prompt_ids: list[int] | None = None) -> dict | None:
        """prompt_ids: echoed, the prompt's tokens come first, the first without a logprob (as OpenAI's)."""
        if self.req.logprobs is None:
            return None
        lps = [lp for d in deltas for lp in (d.logprobs or [])]
        dec = self.decode
        out = {"tokens": [dec([lp.token_id]) for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
               "top_logprobs": [_top_by_text(lp.top, dec) for lp in lps]}
        if prompt_ids is None:
            return out
        scored = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), [])
        assert [lp.token_id for lp in scored] == prompt_ids[1:len(scored) + 1], "logprobs of this prompt"
        return {"tokens": [dec([t]) for t in prompt_ids] + out["tokens"],
                "token_logprobs": [None, *(lp.logprob for lp in scored)] + out["token_logprobs"],
                "top_logprobs": [None, *(_top_by_text(lp.top[:self.req.logprobs], dec) for lp in scored)]
                + out["top_logprobs"]}

    def _base(self, choices: list[dict], obj: str) -> dict:
        return {"id": self.req.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def _choice(self, deltas: list[Delta], streamed: bool) -> dict:
        index = deltas[-1].index
        echoed = self.echo is not None and (not streamed or index not in self._started)
        self._started.add(index)
        prompt_text, prompt_ids = self.echo[index // self.req.n] if echoed else ("", None)  # type: ignore[index]
        choice = {"index": index, "text": prompt_text + "".join(d.text for d in deltas),
                  "logprobs": self._logprobs(deltas, prompt_ids), "finish_reason": _finish(deltas[-1]),
                  "stop_reason": deltas[-1].stop_reason}
        if not streamed and self.prompt_top is not None:
            choice["prompt_logprobs"] = prompt_logprobs(deltas, self.decode, self.prompt_top)
        return choice

    def chunk(self, d: Delta) -> dict:
        return self._base([self._with_ids(self._choice([d], True), [d])], self.chunk_name)

    # the SSE stream (http_api writes what these return; router.gateway.responses_format has its own)
    def opening(self) -> list[str]:
        return []

    def events(self, d: Delta) -> list[str]:
        self._latest[d.index] = d
        if not (d.text or d.token_ids or d.finish_reason) or (chunk := self.chunk(d)) is None:
            return []
        if self.continuous_usage:
            chunk["usage"] = count_usage(list(self._latest.values()), self.req.n)
        return [f"data: {json.dumps(chunk)}\n\n"]

    def closing(self, seen: list[Delta], usage: bool, failed: bool = False) -> list[str]:
        return ([f"data: {json.dumps(self.usage_chunk(seen))}\n\n"] if usage and seen else []) + ["data: [DONE]\n\n"]

    def error_event(self, error: dict) -> str:
        return f"data: {json.dumps(error)}\n\n"

    def usage_chunk(self, deltas: list[Delta]) -> dict:
        return {**self._base([], self.chunk_name), "usage": self.usage(deltas)}

    def whole(self, deltas: list[Delta]) -> dict:
        choices = [self._with_ids(self._choice(ds, False), ds) for ds in by_choice(deltas)]
        return {**self._base(choices, self.object_name), "usage": self.usage(deltas)}


def prompt_logprobs(deltas: list[Delta], decode, top: int) -> list[dict | None]:  # noqa: ANN001
    """vLLM's prompt_logprobs: None for the first prompt token, then per token {id: {logprob, rank,
    decoded_token}} for it and its `top` alternatives (ranked 1.. as they come)."""
    scored = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), [])
    out: list[dict | None] = [None]
    for lp in scored:
        entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": decode([lp.token_id])}}
        for rank, (alt, logprob) in enumerate(lp.top[:top], 1):
            entry.setdefault(str(alt), {"logprob": logprob, "rank": rank, "decoded_token": decode([alt])})
        out.append(entry)
    return out


@dataclass
class _Held:
    """A streamed choice's answer so far, where reasoning or tools decide what it is."""

    deltas: list[Delta] = field(default_factory=list)  # since the last chunk written
    text: str = ""
    thought: int = 0  # characters of reasoning written
    sent: int = 0  # characters of the answer written (as content, or as a named call's arguments)
    called: bool = False  # a named call's id and name written


class ChatFormat(CompletionFormat):
    """Chat answers. With a reasoning parser (router.gateway.reasoning), the thinking as reasoning_content;
    with tools (router.gateway.tools), the answer's calls as message.tool_calls. Streamed: reasoning as it
    comes, then the answer's text; a named call's arguments stream as they come (its id and name
    first); "required" calls come whole in the choice's last chunk; an "auto" answer streams its
    text until a call opens, its calls come whole in the last chunk. A chunk carries the logprobs and
    token ids of the deltas since the choice's chunk before it."""

    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"

    def __init__(self, *args: Any, tools: ToolCalling | None = None, reasoning: Reasoning | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tools, self.reasoning = tools, reasoning
        self._held: dict[int, _Held] = {}

    def usage(self, deltas: list[Delta]) -> dict:
        usage = super().usage(deltas)
        if self.reasoning is not None:
            thought = sum(self.reasoning.tokens([t for d in ds for t in d.token_ids]) for ds in by_choice(deltas))
            usage.setdefault("completion_tokens_details", {})["reasoning_tokens"] = thought
        return usage

    def whole(self, deltas: list[Delta]) -> dict:
        out = super().whole(deltas)
        if self.prompt_top is not None:  # vLLM's: once, beside the choices (they share the prompt)
            out["prompt_logprobs"] = prompt_logprobs(deltas, self.decode, self.prompt_top)
        return out

    def _logprobs(self, deltas: list[Delta]) -> dict | None:
        if self.req.logprobs is None:
            return None
        dec = self.decode
        return {"content": [{"token": dec([lp.token_id]), "logprob": lp.logprob,
                             "top_logprobs": [{"token": dec([t]), "logprob": v} for t, v in lp.top]}
                            for d in deltas for lp in (d.logprobs or [])]}

    def _choice(self, deltas: list[Delta], streamed: bool) -> dict:
        text = "".join(d.text for d in deltas)
        if self.tools is None and self.reasoning is None:
            return self._message(deltas, streamed, {"content": text}, _finish(deltas[-1]))
        assert not streamed, "chunk() writes these"
        reasoning, answer = self.reasoning.split(text, True) if self.reasoning else ("", text)
        content, calls = self.tools.answer(answer or "") if self.tools and answer is not None else (answer, None)
        body: dict[str, Any] = {"content": content}
        if self.reasoning is not None:
            body["reasoning_content"] = reasoning or None
        if calls is not None:
            body["tool_calls"] = calls
        return self._message(deltas, False, body, self._tool_finish(deltas[-1], bool(calls)))

    def _tool_finish(self, last: Delta, called: bool) -> str | None:
        """An answer with calls that ended by itself finishes as its tool choice says ("tool_calls")."""
        if called and self.tools is not None and last.finish_reason == FinishReason.STOP:
            return self.tools.finish_reason
        return _finish(last)

    def _message(self, deltas: list[Delta], streamed: bool, body: dict, finish: str | None) -> dict:
        index = deltas[-1].index
        first = not streamed or index not in self._started  # as OpenAI streams: the role in a choice's first delta
        self._started.add(index)
        message = {"role": "assistant", **body} if first else body
        return {"index": index, "delta" if streamed else "message": message, "logprobs": self._logprobs(deltas),
                "finish_reason": finish, "stop_reason": deltas[-1].stop_reason}

    def chunk(self, d: Delta) -> dict | None:
        """None while what the held text is cannot be told yet (a marker or a call being written)."""
        if self.tools is None and self.reasoning is None:
            return super().chunk(d)
        held = self._held.setdefault(d.index, _Held())
        held.deltas.append(d)
        held.text += d.text
        finished = d.finish_reason is not None
        reasoning, answer = self.reasoning.split(held.text, finished) if self.reasoning else ("", held.text)
        body: dict[str, Any] = {}
        if len(reasoning) > held.thought:
            body["reasoning_content"], held.thought = reasoning[held.thought:], len(reasoning)
        finish = _finish(d) if finished else None
        if answer is not None:
            part, finish = self._answer_part(held, answer, d)
            body.update(part)
        if not body and not finished:
            return None
        deltas, held.deltas = held.deltas, []
        if finished:
            del self._held[d.index]
        return self._base([self._with_ids(self._message(deltas, True, body, finish), deltas)], self.chunk_name)

    def streamed_choice(self, d: Delta) -> dict | None:
        """The one choice a delta's chunk writes (the other APIs' events are made of it); None: nothing yet."""
        if not (d.text or d.token_ids or d.finish_reason) or (chunk := self.chunk(d)) is None:
            return None
        return chunk["choices"][0]

    def _answer_part(self, held: _Held, answer: str, d: Delta) -> tuple[dict, str | None]:
        """What of the answer this chunk writes, and its finish_reason."""
        finished, tools = d.finish_reason is not None, self.tools
        if tools is not None and tools.name is not None:  # a named call's arguments, as they come
            piece, held.sent = answer[held.sent:], len(answer)
            if not held.called:
                held.called = True
                return {"content": None, "tool_calls": [{"index": 0, **call(tools.name, piece)}]}, \
                    self._tool_finish(d, True) if finished else None
            body = {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]} if piece else {}
            return body, self._tool_finish(d, True) if finished else None
        if not finished:
            upto = tools.streamable(answer) if tools is not None else len(answer)
            body = {"content": answer[held.sent:upto]} if upto > held.sent else {}
            held.sent = max(held.sent, upto)
            return body, None
        content, calls = tools.answer(answer) if tools is not None else (answer, None)
        if calls is None:
            rest = answer[held.sent:]
            return ({"content": rest} if rest else {}), _finish(d)
        body = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
        if held.sent < len(content or ""):  # the text before the calls, where it came with them
            return {"content": content[held.sent:], **body}, self._tool_finish(d, True)
        return ({"content": None, **body} if held.sent == 0 else body), self._tool_finish(d, True)
