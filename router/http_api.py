"""HTTP front door (FastAPI): OpenAI-compatible completions and chat (SSE streaming), models,
health, readiness and Prometheus metrics. Errors use OpenAI's shape and name the bad field."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from router.chat import ChatFormatter
from router.core import Delta, FinishReason, GenerationRequest, Overloaded, RequestError, ServiceUnavailable
from router.engine import RouterEngine
from router.openai_types import ChatBody, CompletionBody

MAX_BODY_BYTES = 4 * 2**20


def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def create_app(engine: RouterEngine, model_name: str) -> FastAPI:
    app = FastAPI(title="Tandem", description="Speculative decoding with chunked prefill, as a service")
    chat = ChatFormatter(engine.tokenizer_config)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error(400, f"{loc or 'body'}: {first.get('msg')}", loc or None)

    async def parse(request: Request, model: type) -> object:
        size = request.headers.get("content-length")
        if size is not None and int(size) > MAX_BODY_BYTES:
            raise _HTTPError(error(413, f"body larger than {MAX_BODY_BYTES} bytes"))
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise _HTTPError(error(413, f"body larger than {MAX_BODY_BYTES} bytes"))
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise _HTTPError(error(400, "body is not valid UTF-8")) from None
        except json.JSONDecodeError as err:
            raise _HTTPError(error(400, f"malformed JSON: {err}")) from None
        if not isinstance(data, dict):
            raise _HTTPError(error(400, "body must be a JSON object"))
        try:
            body = model.model_validate(data)
        except ValidationError as err:
            loc, msg = _describe(err.errors())
            raise _HTTPError(error(400, f"{loc}: {msg}", loc or None)) from None
        if body.model != model_name:
            raise _HTTPError(error(404, f"model {body.model!r} not found; this server serves {model_name!r}",
                                   "model", "not_found_error"))
        if not engine.ready:
            raise _HTTPError(error(503, "not ready: the target service is unavailable", kind="unavailable"))
        return body

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            body = await parse(request, CompletionBody)
            req = body.to_request(f"cmpl-{uuid.uuid4().hex}", engine.encode, engine.config.default_max_tokens)
            return await respond(request, body, req, _CompletionFormat(engine, model_name, req, body.return_token_ids))
        except _HTTPError as e:
            return e.response
        except RequestError as e:
            return error(400, str(e), e.field)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            body = await parse(request, ChatBody)
            try:
                prompt = chat.render([(m.role, m.text()) for m in body.messages])
            except Exception as err:  # a template may reject a conversation (raise_exception)
                raise RequestError("messages", f"chat template: {err}") from None
            req = body.to_request(f"chatcmpl-{uuid.uuid4().hex}", engine.encode(prompt),
                                  engine.config.default_max_tokens)
            return await respond(request, body, req, _ChatFormat(engine, model_name, req, body.return_token_ids))
        except _HTTPError as e:
            return e.response
        except RequestError as e:
            return error(400, str(e), e.field)

    async def respond(request: Request, body, req: GenerationRequest, fmt) -> Response:  # noqa: ANN001
        try:
            engine.validate(req)
            stream = engine.generate(req)
            first = await anext(stream)  # surfaces 429 before any byte is sent
        except Overloaded as err:
            return error(429, str(err), kind="rate_limit_error")
        if body.stream:
            return StreamingResponse(sse(fmt, first, stream, body.include_usage), media_type="text/event-stream")
        return await collect(request, fmt, first, stream)

    async def sse(fmt, first: Delta, stream: AsyncIterator[Delta], usage: bool) -> AsyncIterator[str]:  # noqa: ANN001
        delta: Delta | None = first
        last = first
        try:
            while delta is not None:
                if delta.error is not None:
                    yield f"data: {json.dumps(_error_body(delta.error))}\n\n"
                    break
                if delta.text or delta.token_ids or delta.finish_reason:
                    yield f"data: {json.dumps(fmt.chunk(delta))}\n\n"
                last = delta
                delta = await anext(stream, None)
            if usage:
                yield f"data: {json.dumps(fmt.usage_chunk(last))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await stream.aclose()  # a client that went away frees its KV in both services

    async def collect(request: Request, fmt, first: Delta, stream: AsyncIterator[Delta]) -> Response:  # noqa: ANN001
        deltas = [first]

        async def drain() -> None:
            async for d in stream:
                deltas.append(d)

        task = asyncio.create_task(drain())
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await request.is_disconnected():
                task.cancel()
                await stream.aclose()
                return Response(status_code=499)
        last = deltas[-1]
        if last.error is not None:
            status = 503 if isinstance(last.error, ServiceUnavailable) else 500
            return JSONResponse(_error_body(last.error), status)
        return JSONResponse(fmt.whole(deltas))

    @app.get("/v1/models")
    async def models() -> dict:
        info = engine.target_info
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "tandem",
                                            "max_model_len": info.max_model_len if info else None}]}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        if not engine.ready:
            return error(503, "target unavailable", kind="unavailable")
        lanes = list(engine.lanes.values())
        return JSONResponse({"status": "ready", "target": lanes[0].name, "draft": lanes[0].draft_address,
                             "draft_available": any(lane.draft_address for lane in lanes)
                             and all(lane.draft.up for lane in lanes if lane.draft_address),
                             "replicas": [{"target": lane.name, "target_up": lane.up, "draft": lane.draft_address,
                                           "draft_up": lane.draft.up} for lane in lanes]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.exposition(), media_type="text/plain; version=0.0.4")

    return app


class _HTTPError(Exception):
    def __init__(self, response: JSONResponse) -> None:
        self.response = response


def _describe(errors: list[dict]) -> tuple[str, str]:
    """(field path, message) of the first bad field. A union field (temperature: float | int) fails
    once per member, each loc tagged with the member ("temperature", "float"): the field is the
    locs' common prefix, and the message the most specific member's (deepest, then not a mere type
    mismatch), so an empty prompt list says "at least 1 item", not "a valid string"."""
    head = errors[0].get("loc", ())[:1]
    same = [e for e in errors if e.get("loc", ())[:1] == head]
    path = list(same[0].get("loc", ()))
    for e in same[1:]:
        loc = e.get("loc", ())
        n = 0
        while n < min(len(path), len(loc)) and path[n] == loc[n]:
            n += 1
        path = path[:n]
    best = min(same, key=lambda e: (-len(e.get("loc", ())), str(e.get("type", "")).endswith("_type")))
    return ".".join(str(p) for p in path), str(best.get("msg"))


def _error_body(err: Exception) -> dict:
    kind = "unavailable" if isinstance(err, ServiceUnavailable) else "server_error"
    return {"error": {"message": str(err), "type": kind, "param": None, "code": None}}


def _finish(delta: Delta) -> str | None:
    if delta.finish_reason is None:
        return None
    return "stop" if delta.finish_reason in (FinishReason.STOP, FinishReason.ABORT) else delta.finish_reason.value


class _CompletionFormat:
    def __init__(self, engine: RouterEngine, model: str, req: GenerationRequest, token_ids: bool) -> None:
        self.engine, self.model, self.req, self.created = engine, model, req, int(time.time())
        self.token_ids = token_ids

    def _with_ids(self, choice: dict, deltas: list[Delta]) -> dict:
        if self.token_ids:
            choice["token_ids"] = [t for d in deltas for t in d.token_ids]
        return choice

    def _logprobs(self, deltas: list[Delta]) -> dict | None:
        if self.req.logprobs is None:
            return None
        lps = [lp for d in deltas for lp in (d.logprobs or [])]
        dec = self.engine.tokenizer.decode
        return {"tokens": [dec([lp.token_id]) for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [_top_by_text(lp.top, dec) for lp in lps]}

    def _base(self, choices: list[dict]) -> dict:
        return {"id": self.req.request_id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices}

    def chunk(self, d: Delta) -> dict:
        return self._base([self._with_ids({"index": 0, "text": d.text, "logprobs": self._logprobs([d]),
                                           "finish_reason": _finish(d)}, [d])])

    def usage_chunk(self, last: Delta) -> dict:
        return {**self._base([]), "usage": _usage(last)}

    def whole(self, deltas: list[Delta]) -> dict:
        last = deltas[-1]
        choice = {"index": 0, "text": "".join(d.text for d in deltas), "finish_reason": _finish(last),
                  "logprobs": self._logprobs(deltas)}
        return {**self._base([self._with_ids(choice, deltas)]), "usage": _usage(last)}


class _ChatFormat(_CompletionFormat):
    def _logprobs(self, deltas: list[Delta]) -> dict | None:
        if self.req.logprobs is None:
            return None
        dec = self.engine.tokenizer.decode
        return {"content": [{"token": dec([lp.token_id]), "logprob": lp.logprob,
                             "top_logprobs": [{"token": dec([t]), "logprob": v} for t, v in lp.top]}
                            for d in deltas for lp in (d.logprobs or [])]}

    def _base(self, choices: list[dict], obj: str = "chat.completion") -> dict:
        return {"id": self.req.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def chunk(self, d: Delta) -> dict:
        choice = {"index": 0, "delta": {"role": "assistant", "content": d.text}, "logprobs": self._logprobs([d]),
                  "finish_reason": _finish(d)}
        return self._base([self._with_ids(choice, [d])], "chat.completion.chunk")

    def usage_chunk(self, last: Delta) -> dict:
        return {**self._base([], "chat.completion.chunk"), "usage": _usage(last)}

    def whole(self, deltas: list[Delta]) -> dict:
        last = deltas[-1]
        message = {"role": "assistant", "content": "".join(d.text for d in deltas)}
        choice = {"index": 0, "message": message, "finish_reason": _finish(last), "logprobs": self._logprobs(deltas)}
        return {**self._base([self._with_ids(choice, deltas)]), "usage": _usage(last)}


def _top_by_text(top: list[tuple[int, float]], dec) -> dict[str, float]:  # noqa: ANN001
    """OpenAI's completions top_logprobs are keyed by token text; when two alternatives decode alike
    (byte tokens of a partial UTF-8 character), the more likely one keeps the key."""
    out: dict[str, float] = {}
    for t, v in top:  # best first
        out.setdefault(dec([t]), v)
    return out


def _usage(last: Delta) -> dict:
    return {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
            "total_tokens": last.prompt_tokens + last.completion_tokens}
