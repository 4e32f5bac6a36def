"""HTTP front door (FastAPI): OpenAI-compatible completions and chat (SSE streaming), models,
health, readiness and Prometheus metrics. Errors use OpenAI's shape and name the bad field.

Nothing heavy runs on the event loop: the body is read with a hard byte limit (413 as soon as it
is crossed, the rest drained unkept so the client can read the answer), large bodies are parsed
and every prompt is tokenized on the codec's thread pool."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from common.logs import bind
from router.core import Delta, Overloaded, RequestError, ServiceUnavailable
from router.engine import RequestStream, RouterEngine
from router.openai_format import ChatFormat, CompletionFormat
from router.openai_types import HARMLESS, ChatBody, CompletionBody, _Common
from router.request_stats import report
from router.tracing import RouterTracer

log = logging.getLogger(__name__)

DRAIN_LIMIT_BYTES = 1 << 30  # past this an oversized body is cut off (connection closed) instead of drained
_PARSE_OFF_LOOP_BYTES = 256 * 2**10
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")  # JSON's only way to write a surrogate


def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
          headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status,
                        headers=headers)


class _HTTPError(Exception):
    def __init__(self, response: JSONResponse) -> None:
        self.response = response


def public_error(err: Exception) -> tuple[int, dict]:
    """Status and OpenAI-style body for an error that ended a request. Our own errors say what
    happened; anything else is logged in full under an id and the client gets only that id."""
    if isinstance(err, RequestError):
        return 400, {"error": {"message": str(err), "type": "invalid_request_error", "param": err.field, "code": 400}}
    if isinstance(err, Overloaded):
        return 429, {"error": {"message": str(err), "type": "rate_limit_error", "param": None, "code": 429}}
    if isinstance(err, ServiceUnavailable):
        return 503, {"error": {"message": str(err), "type": "unavailable", "param": None, "code": 503}}
    log_id = uuid.uuid4().hex[:12]
    log.error("request failed [log id %s]: %r", log_id, err, exc_info=err)
    return 500, {"error": {"message": f"internal error (log id {log_id})", "type": "server_error", "param": None,
                           "code": 500}}


def error_response(err: Exception) -> JSONResponse:
    status, body = public_error(err)
    return JSONResponse(body, status)


async def read_body(request: Request, limit: int) -> bytes:
    too_big = _HTTPError(error(413, f"body larger than {limit} bytes", headers={"Connection": "close"}))
    size = request.headers.get("content-length")
    if size is not None and not size.isdigit():
        raise _HTTPError(error(400, "invalid Content-Length"))
    if size is not None and int(size) > limit:
        if request.headers.get("expect", "").lower() != "100-continue":  # else the client has not sent it
            await _drain(request, int(size))
        raise too_big
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            await _drain(request, total)
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def _drain(request: Request, seen: int) -> None:
    """Read and drop the rest of an oversized body: a server that closes the connection while the
    client is still sending makes the client see a reset instead of the 413."""
    try:
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > DRAIN_LIMIT_BYTES:
                return
    except Exception:  # noqa: BLE001 - the client went away: nothing to answer
        return


def parse_json(raw: bytes, model: type[BaseModel]) -> BaseModel:
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise _HTTPError(error(400, "body is not valid UTF-8")) from None
    except json.JSONDecodeError as err:
        raise _HTTPError(error(400, f"malformed JSON: {err}")) from None
    if not isinstance(data, dict):
        raise _HTTPError(error(400, "body must be a JSON object"))
    bad = _unpaired_surrogate(data) if _SURROGATE_ESCAPE.search(raw) else None
    if bad is not None:
        raise _HTTPError(error(400, f"{bad or 'body'}: a string holds an unpaired UTF-16 surrogate escape (such as "
                                    f"\\ud800), which is no Unicode text", bad or None))
    unknown = model.unsupported(data) if issubclass(model, _Common) else []
    if unknown:
        raise _HTTPError(error(400, f"unsupported parameter{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)} "
                                    f"(Tandem does not implement {'them' if len(unknown) > 1 else 'it'})", unknown[0]))
    try:
        return model.model_validate({k: v for k, v in data.items() if k not in HARMLESS})
    except ValidationError as err:
        loc, msg = _describe(err.errors())
        raise _HTTPError(error(400, f"{loc}: {msg}", loc or None)) from None


def create_app(engine: RouterEngine, model_name: str) -> FastAPI:
    app = FastAPI(title="Tandem", description="Speculative decoding with chunked prefill, as a service",
                  telemetry=_telemetry(engine.config.tracer))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)  # logged under an id; the client gets the id in OpenAI's shape

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error(400, f"{loc or 'body'}: {first.get('msg')}", loc or None)

    async def parse(request: Request, model: type[BaseModel]) -> BaseModel:
        raw = await read_body(request, engine.config.max_body_bytes)
        if len(raw) > _PARSE_OFF_LOOP_BYTES:
            body = await asyncio.get_running_loop().run_in_executor(None, parse_json, raw, model)
        else:
            body = parse_json(raw, model)
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
            request_id = f"cmpl-{uuid.uuid4().hex}"
            prompts = body.prompts()
            reqs = [body.to_request(request_id, await engine.encode(p) if isinstance(p, str) else p,
                                    engine.sampling_defaults) for p in prompts]
            echo = [(p if isinstance(p, str) else await engine.codec.decode(p), r.prompt_ids)
                    for p, r in zip(prompts, reqs, strict=True)] if body.echo else None
            fmt = CompletionFormat(engine.codec.decode_one, model_name, reqs[0], body.return_token_ids, echo=echo)
            return await respond(request, body, engine.submit(reqs[0]) if len(reqs) == 1 else engine.submit_all(reqs),
                                 fmt)
        except _HTTPError as e:
            return e.response
        except (RequestError, Overloaded, ServiceUnavailable) as e:
            return error_response(e)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            body = await parse(request, ChatBody)
            ids = await engine.encode_chat(body.conversation())
            req = body.to_request(f"chatcmpl-{uuid.uuid4().hex}", ids, engine.sampling_defaults)
            fmt = ChatFormat(engine.codec.decode_one, model_name, req, body.return_token_ids)
            return await respond(request, body, engine.submit(req), fmt)
        except _HTTPError as e:
            return e.response
        except (RequestError, Overloaded, ServiceUnavailable) as e:
            return error_response(e)

    async def respond(request: Request, body, stream: RequestStream, fmt) -> Response:  # noqa: ANN001
        bind(request_id=stream.seq.request.request_id)  # every line this request's task logs from here on
        if stream.seq.request.tandem_metrics:
            fmt.metrics = functools.partial(report, stream.seq)
        if body.stream:
            return StreamingResponse(sse(fmt, stream, body.include_usage), media_type="text/event-stream")
        return await collect(request, fmt, stream)

    async def sse(fmt, stream: RequestStream, usage: bool) -> AsyncIterator[str]:  # noqa: ANN001
        seen: list[Delta] = []
        try:
            async for delta in stream:
                if delta.error is not None:
                    yield f"data: {json.dumps(public_error(delta.error)[1])}\n\n"
                    break
                if delta.text or delta.token_ids or delta.finish_reason:
                    yield f"data: {json.dumps(fmt.chunk(delta))}\n\n"
                seen.append(delta)
            if usage and seen:
                yield f"data: {json.dumps(fmt.usage_chunk(seen))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await stream.aclose()  # a client that went away frees its KV in both services

    async def collect(request: Request, fmt, stream: RequestStream) -> Response:  # noqa: ANN001
        deltas: list[Delta] = []

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
        if deltas[-1].error is not None:
            return error_response(deltas[-1].error)
        return JSONResponse(fmt.whole(deltas))

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "tandem",
                                            "max_model_len": engine.max_model_len if engine.lanes else None}]}

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


def _telemetry(tracer: RouterTracer | None) -> dict:
    """FastAPI's own spans (one per HTTP request, the parent of tandem.request) only when tracing,
    with the router's provider; probes and scrapes are left out."""
    if tracer is None:
        return {"tracing": False, "metrics": False, "logs": False}
    return {"tracer_provider": tracer.tracing.provider, "metrics": False, "logs": False, "operation_spans": False,
            "exclude": lambda scope: scope.get("path") in ("/metrics", "/health", "/ready")}


def _unpaired_surrogate(value: object, path: str = "") -> str | None:
    """The path of the first string (key or value) that JSON decoded with a lone surrogate: "\\ud800"
    is valid JSON but no text (tokenizing it raised UnicodeEncodeError, a 500). None: there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        inner = f"{path}.{key}" if path else str(key)
        for part in (key, item) if isinstance(key, str) else (item,):
            found = _unpaired_surrogate(part, inner)
            if found is not None:
                return found
    return None


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
    return ".".join(str(p) for p in path), str(best.get("msg")).removeprefix("Value error, ")
