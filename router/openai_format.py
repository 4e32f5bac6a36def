"""OpenAI response shapes for completions and chat: streamed chunks, the usage chunk, whole answers."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router.core import Delta, FinishReason, Request
from router.tools import ToolCalling, call


def _finish(delta: Delta) -> str | None:
    if delta.finish_reason is None:
        return None
    return "stop" if delta.finish_reason in (FinishReason.STOP, FinishReason.ABORT) else delta.finish_reason.value


def _usage(deltas: list[Delta], n: int) -> dict:
    """Each prompt once (choices p x n .. p x n + n - 1 share prompt p), the completion tokens of every choice."""
    last = {d.index: d for d in deltas}
    prompt = sum({i // n: d.prompt_tokens for i, d in last.items()}.values())
    completion = sum(d.completion_tokens for d in last.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


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

    def _usage(self, deltas: list[Delta]) -> dict:
        usage = _usage(deltas, self.req.n)
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
                "top_logprobs": [None, *(_top_by_text(lp.top, dec) for lp in scored)] + out["top_logprobs"]}

    def _base(self, choices: list[dict], obj: str) -> dict:
        return {"id": self.req.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def _choice(self, deltas: list[Delta], streamed: bool) -> dict:
        index = deltas[-1].index
        echoed = self.echo is not None and (not streamed or index not in self._started)
        self._started.add(index)
        prompt_text, prompt_ids = self.echo[index // self.req.n] if echoed else ("", None)  # type: ignore[index]
        return {"index": index, "text": prompt_text + "".join(d.text for d in deltas),
                "logprobs": self._logprobs(deltas, prompt_ids), "finish_reason": _finish(deltas[-1])}

    def chunk(self, d: Delta) -> dict:
        return self._base([self._with_ids(self._choice([d], True), [d])], self.chunk_name)

    def usage_chunk(self, deltas: list[Delta]) -> dict:
        return {**self._base([], self.chunk_name), "usage": self._usage(deltas)}

    def whole(self, deltas: list[Delta]) -> dict:
        choices = [self._with_ids(self._choice(ds, False), ds) for ds in by_choice(deltas)]
        return {**self._base(choices, self.object_name), "usage": self._usage(deltas)}


@dataclass
class _Held:
    """A streamed choice's answer so far, where tools decide what it is."""

    deltas: list[Delta] = field(default_factory=list)  # since the last chunk written
    text: str = ""
    sent: int = 0  # characters of text written (as content, or as a named call's arguments)


class ChatFormat(CompletionFormat):
    """Chat answers; with tools (router.tools), the answer's calls as message.tool_calls. Streamed, a
    named call's arguments stream as they come (its id and name in the first chunk); "required" calls
    come whole in the choice's last chunk; an "auto" answer streams its text until a call opens, its
    calls come whole in the last chunk. A chunk carries the logprobs and token ids of the deltas since
    the choice's chunk before it."""

    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"

    def __init__(self, *args: Any, tools: ToolCalling | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tools = tools
        self._held: dict[int, _Held] = {}

    def _logprobs(self, deltas: list[Delta]) -> dict | None:
        if self.req.logprobs is None:
            return None
        dec = self.decode
        return {"content": [{"token": dec([lp.token_id]), "logprob": lp.logprob,
                             "top_logprobs": [{"token": dec([t]), "logprob": v} for t, v in lp.top]}
                            for d in deltas for lp in (d.logprobs or [])]}

    def _choice(self, deltas: list[Delta], streamed: bool) -> dict:
        text = "".join(d.text for d in deltas)
        if self.tools is None:
            return self._message(deltas, streamed, {"content": text}, _finish(deltas[-1]))
        content, calls = self.tools.answer(text)
        body = {"content": content} if calls is None else {"content": content, "tool_calls": calls}
        return self._message(deltas, streamed, body, self._tool_finish(deltas[-1], calls))

    def _tool_finish(self, last: Delta, calls: list[dict] | None) -> str | None:
        assert self.tools is not None
        return self.tools.finish_reason if calls and last.finish_reason == FinishReason.STOP else _finish(last)

    def _message(self, deltas: list[Delta], streamed: bool, body: dict, finish: str | None) -> dict:
        index = deltas[-1].index
        first = not streamed or index not in self._started  # as OpenAI streams: the role in a choice's first delta
        self._started.add(index)
        message = {"role": "assistant", **body} if first else body
        return {"index": index, "delta" if streamed else "message": message, "logprobs": self._logprobs(deltas),
                "finish_reason": finish}

    def chunk(self, d: Delta) -> dict | None:
        """None while what the held text is cannot be told yet (a call being written)."""
        if self.tools is None:
            return super().chunk(d)
        held = self._held.setdefault(d.index, _Held())
        held.deltas.append(d)
        held.text += d.text
        if self.tools.name is not None:  # a named call's arguments, as they come
            piece, held.sent = held.text[held.sent:], len(held.text)
            if d.index not in self._started:
                body = {"content": None, "tool_calls": [{"index": 0, **call(self.tools.name, piece)}]}
            else:
                body = {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]} if piece else {}
            finish = self._tool_finish(d, [{}]) if d.finish_reason else None
        elif d.finish_reason is None:
            upto = self.tools.streamable(held.text)
            if upto <= held.sent:
                return None
            body, finish, held.sent = {"content": held.text[held.sent:upto]}, None, upto
        else:
            calls = self.tools.answer(held.text)[1]
            if calls is None:
                body = {"content": held.text[held.sent:]}
            else:
                body = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
                body = {"content": None, **body} if held.sent == 0 else body
            finish = self._tool_finish(d, calls)
        deltas, held.deltas = held.deltas, []
        if d.finish_reason is not None:
            del self._held[d.index]
        return self._base([self._with_ids(self._message(deltas, True, body, finish), deltas)], self.chunk_name)
