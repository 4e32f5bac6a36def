"""The public gRPC front door: tandem.v1.Generate (server streaming) and GenerateUnary."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import DecodeError

from common.logs import bind
from common.sampling import SamplingParams
from common.tracing import extract
from router.core import Delta, Overloaded, Request, RequestError, ServiceUnavailable, TokenLogprob
from router.engine import RouterEngine
from router.sequence import RequestStream, report
from router.structured import Constraint
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc

SERVICE_NAME = "tandem.v1.Generate"
CHAT_ROLES = ("system", "user", "assistant", "tool")
log = logging.getLogger(__name__)


def _status(err: Exception) -> tuple[grpc.StatusCode, str]:
    """Our own errors say what happened; anything else is logged under an id, which is all the caller sees."""
    if isinstance(err, RequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(err)
    if isinstance(err, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(err)
    if isinstance(err, ServiceUnavailable):
        return grpc.StatusCode.UNAVAILABLE, str(err)
    log_id = uuid.uuid4().hex[:12]
    log.error("request failed [log id %s]: %r", log_id, err)
    return grpc.StatusCode.INTERNAL, f"internal error (log id {log_id})"


class GenerateServicer(generate_pb2_grpc.GenerateServicer):
    def __init__(self, engine: RouterEngine, model_name: str, aliases: tuple[str, ...] = ()) -> None:
        self.engine, self.model_name, self.served = engine, model_name, (model_name, *aliases)

    async def _request(self, msg: generate_pb2.GenerateRequest) -> Request:
        if sum(map(bool, (msg.prompt, msg.prompt_token_ids, msg.messages))) > 1:
            raise RequestError("prompt", "give one of prompt, prompt_token_ids and messages")
        if msg.prediction and msg.prediction_token_ids:
            raise RequestError("prediction", "give one of prediction and prediction_token_ids")
        lora = self.engine.model_lora(msg.model or self.model_name, self.served)
        if lora is None:
            raise RequestError("model", f"{msg.model!r} is neither the served model {self.model_name!r} nor one "
                                        f"of its LoRA adapters {self.engine.lora_adapters}")
        ids = list(msg.prompt_token_ids) if msg.prompt_token_ids else \
            await self._chat(msg.messages) if msg.messages else await self.engine.encode(msg.prompt)
        sampling = self.engine.sampling_defaults.updated(**SamplingParams.given_in(msg.sampling))
        return Request(
            request_id=msg.request_id or f"gen-{uuid.uuid4().hex}", prompt_ids=ids, sampling=sampling,
            max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None, stop=tuple(msg.stop),
            logprobs=msg.logprobs if msg.HasField("logprobs") else None,
            max_speculative_tokens=msg.max_speculative_tokens if msg.HasField("max_speculative_tokens") else None,
            ignore_eos=msg.ignore_eos, tandem_metrics=msg.tandem_metrics, constraint=_constraint(msg),
            prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
            include_stop_str_in_output=msg.include_stop_str_in_output, priority=msg.priority, lora=lora,
            bad_words=tuple(msg.bad_words), cache_salt=msg.cache_salt,
            prediction=tuple(msg.prediction_token_ids) or (tuple(await self.engine.codec.encode(
                msg.prediction, self.engine.max_model_len, "prediction", plain=True)) if msg.prediction else ()),
        )

    async def _chat(self, messages: list[generate_pb2.ChatMessage]) -> list[int]:
        for i, m in enumerate(messages):
            if m.role not in CHAT_ROLES:
                raise RequestError(f"messages.{i}.role", f"one of {', '.join(CHAT_ROLES)}")
        return await self.engine.encode_chat([{"role": m.role, "content": m.content} for m in messages],
                                             {"add_generation_prompt": True, "continue_final_message": False})

    async def _submit(self, msg: generate_pb2.GenerateRequest | Undecodable,
                      context: grpc.aio.ServicerContext) -> tuple[Request, RequestStream]:
        if isinstance(msg, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not a GenerateRequest: {msg.reason}")
        try:
            req = await self._request(msg)
            bind(request_id=req.request_id)  # this RPC's task: every line it logs from here on
            parent = extract(context.invocation_metadata() or ()) if self.engine.config.tracing else None
            return req, self.engine.submit(req, parent)
        except (RequestError, Overloaded, ServiceUnavailable) as err:
            await context.abort(*_status(err))
        raise AssertionError("unreachable")

    async def Generate(self, request: generate_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[generate_pb2.GenerateResponse]:
        req, stream = await self._submit(request, context)
        try:
            async for delta in stream:
                await _check(delta, context)
                yield _response(req, [delta], stream)
        finally:
            await stream.aclose()  # cancelled call: frees the sequence in both services

    async def GenerateUnary(self, request: generate_pb2.GenerateRequest,
                            context: grpc.aio.ServicerContext) -> generate_pb2.GenerateResponse:
        req, stream = await self._submit(request, context)
        deltas = []
        try:
            async for delta in stream:
                await _check(delta, context)
                deltas.append(delta)
        finally:
            await stream.aclose()
        return _response(req, deltas, stream)


def _constraint(msg: generate_pb2.GenerateRequest) -> Constraint | None:
    kind = msg.structured_output.WhichOneof("kind") if msg.HasField("structured_output") else None
    if kind is None:
        return None
    so = msg.structured_output
    value = list(so.choice.choices) if kind == "choice" else getattr(so, kind)
    return Constraint(kind, None if kind == "json_object" else value, f"structured_output.{kind}")


async def _check(delta: Delta, context: grpc.aio.ServicerContext) -> None:
    if delta.error is not None:
        await context.abort(*_status(delta.error))


def _wire(lps: list[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    return [common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_token_ids=[t for t, _ in lp.top],
                                    top_logprobs=[v for _, v in lp.top], rank=lp.rank) for lp in lps]


def _response(req: Request, deltas: list[Delta], stream: RequestStream) -> generate_pb2.GenerateResponse:
    last = deltas[-1] if deltas else None
    final = last is not None and last.finish_reason is not None
    metrics = generate_pb2.RequestMetrics(**report(stream.seq)) if final and req.tandem_metrics else None
    stop = last.stop_reason if final and last is not None else None
    stopped_by = {"stop_string": stop} if isinstance(stop, str) else {"stop_token_id": stop} if stop is not None else {}
    accepted, rejected = last.prediction if final and last is not None and last.prediction else (0, 0)
    return generate_pb2.GenerateResponse(
        request_id=req.request_id, text="".join(d.text for d in deltas),
        token_ids=[t for d in deltas for t in d.token_ids],
        logprobs=_wire([lp for d in deltas for lp in d.logprobs or []]),
        prompt_logprobs=_wire([lp for d in deltas for lp in d.prompt_logprobs or []]),
        finish_reason=last.finish_reason.value if last and last.finish_reason else "",
        prompt_tokens=len(req.prompt_ids), completion_tokens=last.completion_tokens if last else 0,
        cached_prompt_tokens=last.cached_tokens if last else 0, tandem_metrics=metrics, **stopped_by,
        accepted_prediction_tokens=accepted, rejected_prediction_tokens=rejected,
    )


class Undecodable:
    """A request that is no GenerateRequest (bad UTF-8 in a string, a truncated message): grpc would
    answer UNKNOWN for it; the servicer answers INVALID_ARGUMENT saying why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _parse_request(raw: bytes) -> generate_pb2.GenerateRequest | Undecodable:
    try:
        return generate_pb2.GenerateRequest.FromString(raw)
    except DecodeError as err:
        return Undecodable(str(err))


def register(server: grpc.aio.Server, engine: RouterEngine, model_name: str, aliases: tuple[str, ...] = ()) -> None:
    """generate_pb2_grpc.add_GenerateServicer_to_server's handlers, parsing with _parse_request."""
    servicer = GenerateServicer(engine, model_name, aliases)
    respond = generate_pb2.GenerateResponse.SerializeToString
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(servicer.Generate, _parse_request, respond),
        "GenerateUnary": grpc.unary_unary_rpc_method_handler(servicer.GenerateUnary, _parse_request, respond),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
