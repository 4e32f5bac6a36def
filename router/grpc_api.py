"""The public gRPC front door: tandem.v1.Generate (server streaming) and GenerateUnary."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import grpc

from router.core import Delta, GenerationRequest, Overloaded, RequestError, SamplingOptions, ServiceUnavailable
from router.engine import RouterEngine
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc

SERVICE_NAME = "tandem.v1.Generate"


class GenerateServicer(generate_pb2_grpc.GenerateServicer):
    def __init__(self, engine: RouterEngine) -> None:
        self.engine = engine

    def _request(self, msg: generate_pb2.GenerateRequest) -> GenerationRequest:
        if msg.prompt and msg.prompt_token_ids:
            raise RequestError("prompt", "give prompt or prompt_token_ids, not both")
        ids = list(msg.prompt_token_ids) if msg.prompt_token_ids else self.engine.encode(msg.prompt)
        s = msg.sampling
        return GenerationRequest(
            request_id=msg.request_id or f"gen-{uuid.uuid4().hex}", prompt_ids=ids,
            max_tokens=msg.max_tokens or self.engine.config.default_max_tokens,
            sampling=SamplingOptions(temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k,
                                     seed=s.seed if s.has_seed else None,
                                     typical_acceptance=s.acceptance == common_pb2.ACCEPTANCE_TYPICAL),
            stop=tuple(msg.stop), logprobs=msg.logprobs if msg.has_logprobs and msg.logprobs >= 0 else None,
            max_speculative_tokens=msg.max_speculative_tokens if msg.has_max_speculative_tokens else None,
            ignore_eos=msg.ignore_eos,
        )

    async def _deltas(self, msg: generate_pb2.GenerateRequest,
                      context: grpc.aio.ServicerContext) -> tuple[GenerationRequest, AsyncIterator[Delta]]:
        if not self.engine.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "target service unavailable")
        try:
            req = self._request(msg)
            self.engine.validate(req)
            return req, self.engine.generate(req)
        except RequestError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        raise AssertionError("unreachable")

    async def Generate(self, request: generate_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[generate_pb2.GenerateResponse]:
        req, stream = await self._deltas(request, context)
        try:
            async for delta in stream:
                await _check(delta, context)
                yield _response(req, [delta])
        except Overloaded as err:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        finally:
            await stream.aclose()  # cancelled call: frees the sequence in both services

    async def GenerateUnary(self, request: generate_pb2.GenerateRequest,
                            context: grpc.aio.ServicerContext) -> generate_pb2.GenerateResponse:
        req, stream = await self._deltas(request, context)
        deltas = []
        try:
            async for delta in stream:
                await _check(delta, context)
                deltas.append(delta)
        except Overloaded as err:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        finally:
            await stream.aclose()
        return _response(req, deltas)


async def _check(delta: Delta, context: grpc.aio.ServicerContext) -> None:
    if delta.error is not None:
        code = grpc.StatusCode.UNAVAILABLE if isinstance(delta.error, ServiceUnavailable) else grpc.StatusCode.INTERNAL
        await context.abort(code, str(delta.error))


def _response(req: GenerationRequest, deltas: list[Delta]) -> generate_pb2.GenerateResponse:
    last = deltas[-1] if deltas else None
    lps = [common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                   top_token_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top])
           for d in deltas for lp in (d.logprobs or [])]
    return generate_pb2.GenerateResponse(
        request_id=req.request_id, text="".join(d.text for d in deltas),
        token_ids=[t for d in deltas for t in d.token_ids], logprobs=lps,
        finish_reason=last.finish_reason.value if last and last.finish_reason else "",
        prompt_tokens=len(req.prompt_ids), completion_tokens=last.completion_tokens if last else 0,
    )


def register(server: grpc.aio.Server, engine: RouterEngine) -> None:
    generate_pb2_grpc.add_GenerateServicer_to_server(GenerateServicer(engine), server)
