"""HTTP front door (FastAPI): OpenAI-compatible completions, chat and responses (SSE streaming),
Anthropic's messages, vLLM's tokenize, detokenize and runtime LoRA updates (gateway.lora_api),
models, health, readiness and Prometheus metrics. Errors use OpenAI's shape (Anthropic's on its
routes) and name the bad field.

Nothing heavy runs on the event loop: the body is read with a hard byte limit (router.gateway.http_body),
large bodies are parsed and every prompt is tokenized on the codec's thread pool."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib.metadata
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from common.tracing import Tracing
from router.core import CLIENT, Overloaded, RequestError, ServiceUnavailable
from router.core import Request as CoreRequest
from router.engine import RouterEngine
from router.gateway.answers import respond
from router.gateway.background import BackgroundResponses, add_background_routes
from router.gateway.http_body import (
    PARSE_OFF_LOOP_BYTES,
    Refusal,
    error,
    error_response,
    parse_json,
    read_body,
)
from router.gateway.http_counts import HTTPCounts
from router.gateway.lora_api import add_lora_routes
from router.gateway.messages_body import MessagesBody
from router.gateway.messages_format import MessagesFormat, anthropic_error
from router.gateway.openai_format import ChatFormat, CompletionFormat
from router.gateway.openai_types import ChatBody, CompletionBody
from router.gateway.reasoning import Reasoning
from router.gateway.request_ids import request_id as answer_id
from router.gateway.responses_body import ResponsesBody
from router.gateway.responses_format import ResponsesFormat
from router.gateway.responses_store import ResponseNotFound, ResponseStore, add_stored_response_routes
from router.gateway.tokenize_body import DetokenizeBody, TokenizeBody


def create_app(engine: RouterEngine, model_name: str, aliases: tuple[str, ...] = ()) -> FastAPI:
    """aliases: more names the model answers to (model_name is the one /v1/models lists first)."""
    app = FastAPI(title="Tandem", description="Speculative decoding with chunked prefill, as a service",
                  telemetry=_telemetry(engine.config.tracing))

    app.add_middleware(HTTPCounts, counter=engine.metrics.http_requests)
    stored = ResponseStore(engine.config.max_stored_responses)
    background = BackgroundResponses(stored, engine.metrics.background)
    served = (model_name, *aliases)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)  # logged under an id; the client gets the id in OpenAI's shape

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error(400, f"{loc or 'body'}: {first.get('msg')}", loc or None)

    async def adapted(req: CoreRequest, body: ChatBody | CompletionBody) -> CoreRequest:
        """The request as the model it names runs it (a LoRA adapter's name, that adapter), with the
        tokens of its predicted output (OpenAI's prediction), if any."""
        predicted = body.predicted()
        ids = await engine.codec.encode(predicted, engine.max_model_len, "prediction", plain=True) if predicted else []
        return dataclasses.replace(req, lora=engine.model_lora(body.model, served) or "", prediction=tuple(ids))

    async def parse(request: Request, model: type[BaseModel]) -> BaseModel:
        raw = await read_body(request, engine.config.max_body_bytes)
        if len(raw) > PARSE_OFF_LOOP_BYTES:
            body = await asyncio.get_running_loop().run_in_executor(None, parse_json, raw, model)
        else:
            body = parse_json(raw, model)
        if engine.model_lora(body.model, served) is None:
            names = ", ".join(repr(m) for m in [*served, *engine.lora_adapters])
            raise Refusal(error(404, f"model {body.model!r} not found; this server serves {names}",
                                "model", "not_found_error"))
        if engine.unready is not None:
            raise Refusal(error(503, f"not ready: {engine.unready}", kind="unavailable"))
        return body

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            body = await parse(request, CompletionBody)
            request_id = answer_id(request, "cmpl")
            prompts = body.prompts()
            cut = body.truncate_prompt_tokens is not None
            reqs = [await adapted(body.to_request(request_id, body.truncated(
                await engine.encode(p, truncating=cut) if isinstance(p, str) else p, engine.max_model_len),
                engine.sampling_defaults), body) for p in prompts]
            echo = [(p if isinstance(p, str) and not cut else await engine.codec.decode(r.prompt_ids), r.prompt_ids)
                    for p, r in zip(prompts, reqs, strict=True)] if body.echo else None
            fmt = CompletionFormat(engine.codec.decode_one, body.model, reqs[0], body.return_token_ids, echo=echo)
            return await respond(request, body, engine.submit(reqs[0]) if len(reqs) == 1 else engine.submit_all(reqs),
                                 fmt)
        except Refusal as e:
            return e.response
        except (RequestError, Overloaded, ServiceUnavailable) as e:
            return error_response(e)

    async def chat_request(body: ChatBody, request_id: str) -> tuple[CoreRequest, ChatFormat]:
        calling = body.tool_calling(engine.config.tool_call_parser)
        cut = body.truncate_prompt_tokens is not None
        ids = body.truncated(await engine.encode_chat(body.conversation(), body.template_options(), cut),
                             engine.max_model_len)
        req = await adapted(body.to_request(request_id, ids, engine.sampling_defaults, calling), body)
        reasoning = engine.config.reasoning_parser
        if reasoning is not None and req.constraint is not None:
            # a reasoning model thinks, then answers as the constraint says: it holds after the think-end token
            # (with the template told not to think, or no single think-end token, it holds from the start and
            # there is nothing to parse)
            end = engine.codec.think_end
            thinking = (body.chat_template_kwargs or {}).get("enable_thinking") is not False
            req = dataclasses.replace(req, grammar_opens_after=end) if thinking and end is not None else req
            reasoning = reasoning if req.grammar_opens_after is not None else None
        think = engine.codec.think_end, engine.codec.think_start
        return req, ChatFormat(engine.codec.decode_one, body.model, req, body.return_token_ids, tools=calling,
                               reasoning=Reasoning.named(reasoning, *think) if reasoning else None)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            body = await parse(request, ChatBody)
            req, fmt = await chat_request(body, answer_id(request, "chatcmpl"))
            return await respond(request, body, engine.submit(req), fmt)
        except Refusal as e:
            return e.response
        except (RequestError, Overloaded, ServiceUnavailable) as e:
            return error_response(e)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API: the chat request it means (router.gateway.responses_body), its answer as
        output items and semantic events (router.gateway.responses_format), kept when stored
        (router.gateway.responses_store)."""
        try:
            body = await parse(request, ResponsesBody)
            previous = body.previous_response_id
            req, chat = await chat_request(body.chat(stored.history(previous) if previous else None),
                                           answer_id(request, "resp"))
            keep = functools.partial(stored.put, inputs=body.input_items(), previous=previous, owner=CLIENT.get()) \
                if body.store and stored.capacity else None
            if body.background and keep is None:
                raise RequestError("background", "this router stores no responses (--max-stored-responses 0)")
            fmt = ResponsesFormat(chat, body, body.model, keep)
            if body.background:
                queued = background.start(engine.submit(req), fmt, streamed=body.stream)
                if body.stream:
                    return StreamingResponse(background.follow(fmt.id), media_type="text/event-stream")
                return JSONResponse(queued)
            return await respond(request, body, engine.submit(req), fmt)
        except ResponseNotFound as e:
            return error(404, str(e), "previous_response_id", "not_found_error")
        except Refusal as e:
            return e.response
        except (RequestError, Overloaded, ServiceUnavailable) as e:
            return error_response(e)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API (router.gateway.messages_body, router.gateway.messages_format), its errors
        in Anthropic's shape."""
        try:
            body = await parse(request, MessagesBody)
            req, chat = await chat_request(body.chat(budgets=engine.config.reasoning_parser is not None),
                                           answer_id(request, "msg"))
            fmt = MessagesFormat(chat, body, body.model)
            return anthropic_error(await respond(request, body, engine.submit(req), fmt))
        except Refusal as e:
            return anthropic_error(e.response)
        except (RequestError, Overloaded, ServiceUnavailable) as e:
            return anthropic_error(error_response(e))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        """Anthropic's: the prompt's tokens, as /v1/messages would encode it."""
        try:
            chat = (await parse(request, MessagesBody)).chat(counting=True)
            return JSONResponse({"input_tokens": len(await engine.encode_chat(chat.conversation(),
                                                                              chat.template_options()))})
        except Refusal as e:
            return anthropic_error(e.response)
        except RequestError as e:
            return anthropic_error(error_response(e))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """vLLM's: the ids a prompt (or chat messages) becomes, as the doors encode it."""
        try:
            body = await parse(request, TokenizeBody)
            chat = body.chat()
            ids = await engine.encode_chat(*chat) if chat else await engine.encode(body.prompt)
            return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids})
        except Refusal as e:
            return e.response
        except RequestError as e:
            return error_response(e)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        try:
            body = await parse(request, DetokenizeBody)
            vocab = engine.target_info.vocab_size if engine.target_info else 0
            if any(not 0 <= t < vocab for t in body.tokens):
                return error(400, f"tokens: token ids must be in [0, {vocab})", "tokens")
            return JSONResponse({"prompt": await engine.codec.decode(body.tokens)})
        except Refusal as e:
            return e.response

    add_lora_routes(app, engine, model_name)
    add_stored_response_routes(app, stored)
    add_background_routes(app, stored, background)

    @app.get("/v1/models")
    async def models() -> dict:
        """The served model, then its LoRA adapters (parent: the served model), as vLLM lists them."""
        created, max_len = int(time.time()), engine.max_model_len if engine.lanes else None
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "tandem",
                                            "root": model_name, "parent": None if name in served else model_name,
                                            "max_model_len": max_len}
                                           for name in [*served, *engine.lora_adapters]]}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict:
        """vLLM's: the server's version (the tandem package's)."""
        return {"version": importlib.metadata.version("tandem")}

    @app.get("/ready")
    async def ready() -> Response:
        if engine.unready is not None:
            return error(503, engine.unready, kind="unavailable")
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


def _telemetry(tracing: Tracing | None) -> dict:
    """FastAPI's own spans (one per HTTP request, the parent of tandem.request) only when tracing,
    with the router's provider; probes and scrapes are left out."""
    if tracing is None:
        return {"tracing": False, "metrics": False, "logs": False}
    return {"tracer_provider": tracing.provider, "metrics": False, "logs": False, "operation_spans": False,
            "exclude": lambda scope: scope.get("path") in ("/metrics", "/health", "/ready")}
