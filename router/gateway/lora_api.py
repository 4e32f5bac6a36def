"""vLLM's runtime LoRA updates over HTTP, answered as vLLM answers them (a line of text on success):

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql"}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

The path is a PEFT directory on the target replicas' machines; they must have been started with
--enable-runtime-lora (else a 400 says so). Like every /v1/ route, these need the API key when
the router has one."""

from __future__ import annotations

from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import StrictInt, StrictStr

from router.adapters import AdapterUpdateFailed
from router.engine import RouterEngine
from router.gateway.http_body import Refusal, error, parse_json, read_body
from router.gateway.openai_types import OpenAIBody

KINDS = {404: "not_found_error", 409: "conflict_error", 500: "server_error", 503: "unavailable"}


class LoadLoraBody(OpenAIBody):
    lora_name: StrictStr
    lora_path: StrictStr


class UnloadLoraBody(OpenAIBody):
    lora_name: StrictStr
    lora_int_id: StrictInt | None = None  # vLLM's; the name says which


Body = TypeVar("Body", LoadLoraBody, UnloadLoraBody)


def add_lora_routes(app: FastAPI, engine: RouterEngine, model_name: str) -> None:
    async def body_of(request: Request, model: type[Body]) -> Body:
        body = parse_json(await read_body(request, engine.config.max_body_bytes), model)
        assert isinstance(body, model)
        if body.lora_name in ("", model_name):
            raise Refusal(error(400, f"lora_name must name an adapter, not {body.lora_name!r}", "lora_name"))
        return body

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request) -> Response:
        try:
            body = await body_of(request, LoadLoraBody)
            await engine.load_lora(body.lora_name, body.lora_path)
        except Refusal as e:
            return e.response
        except AdapterUpdateFailed as e:
            return error(e.status, str(e), e.param, KINDS.get(e.status, "invalid_request_error"))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request) -> Response:
        try:
            body = await body_of(request, UnloadLoraBody)
            await engine.unload_lora(body.lora_name)
        except Refusal as e:
            return e.response
        except AdapterUpdateFailed as e:
            return error(e.status, str(e), e.param, KINDS.get(e.status, "invalid_request_error"))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
