"""Request bodies at the HTTP door: read with a hard byte limit (413 as soon as it is crossed, the
rest drained unkept so the client can read the answer), parsed as JSON into a body type, every
refusal an OpenAI-shaped error naming the field; and the error a failed request answers with."""

from __future__ import annotations

import json
import logging
import re
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from router.core import Overloaded, RequestError, ServiceUnavailable
from router.gateway.openai_types import HARMLESS

log = logging.getLogger(__name__)

DRAIN_LIMIT_BYTES = 1 << 30  # past this an oversized body is cut off (connection closed) instead of drained
PARSE_OFF_LOOP_BYTES = 256 * 2**10  # larger bodies are parsed on a thread
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")  # JSON's only way to write a surrogate


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


def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
          headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status,
                        headers=headers)


class Refusal(Exception):
    """Raised with the response that refuses the request."""

    def __init__(self, response: JSONResponse) -> None:
        self.response = response


async def read_body(request: Request, limit: int) -> bytes:
    too_big = Refusal(error(413, f"body larger than {limit} bytes", headers={"Connection": "close"}))
    size = request.headers.get("content-length")
    if size is not None and not size.isdigit():
        raise Refusal(error(400, "invalid Content-Length"))
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
        bad = _unpaired_surrogate(data) if isinstance(data, dict) and _SURROGATE_ESCAPE.search(raw) else None
    except UnicodeDecodeError:
        raise Refusal(error(400, "body is not valid UTF-8")) from None
    except json.JSONDecodeError as err:
        raise Refusal(error(400, f"malformed JSON: {err}")) from None
    except RecursionError:  # [[[[...]]]] a hundred thousand deep: Python's decoder gives up
        raise Refusal(error(400, "malformed JSON: nested too deeply")) from None
    if not isinstance(data, dict):
        raise Refusal(error(400, "body must be a JSON object"))
    if bad is not None:
        raise Refusal(error(400, f"{bad or 'body'}: a string holds an unpaired UTF-16 surrogate escape (such as "
                                 f"\\ud800), which is no Unicode text", bad or None))
    unknown = model.unsupported(data) if hasattr(model, "unsupported") else []
    if unknown:
        raise Refusal(error(400, f"unsupported parameter{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)} "
                                 f"(Tandem does not implement {'them' if len(unknown) > 1 else 'it'})", unknown[0]))
    try:
        return model.model_validate({k: v for k, v in data.items() if k not in HARMLESS or k in model.model_fields})
    except ValidationError as err:
        loc, msg = _describe(err.errors())
        raise Refusal(error(400, f"{loc}: {msg}", loc or None)) from None


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
