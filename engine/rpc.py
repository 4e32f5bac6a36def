"""What every RPC handler of the model services shares: engine exceptions mapped to gRPC status
codes, deadlines checked on arrival and again on the model thread, sampling parameters parsed."""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from common.protocol import CACHE_MISS_METADATA, MISSING_ADAPTER_METADATA, NOT_OWNER_METADATA
from common.sampling import SamplingParams
from engine.kv_cache import KVCacheExhausted
from engine.lease import NotOwner
from engine.rpc_trace import annotate, rpc_scope
from engine.runner import AdapterNotLoaded, CacheMiss, InvalidInput
from engine.sampling import SamplingSpec, validate_sampling
from tandem.v1 import common_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")


Handler = Callable[..., Awaitable[T]]


def rpc_errors(method: Handler | None = None, *, name: str = "") -> Handler | Callable[[Handler], Handler]:
    """Map engine exceptions to gRPC status codes; nothing but the failing call is affected.
    Each call logs with its sequences' ids and is traced when its caller traces (engine.rpc_trace).
    `@rpc_errors(name="StepStream")` names a message handler of a stream after its RPC."""
    if method is None:
        return functools.partial(rpc_errors, name=name)  # type: ignore[return-value]

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        rpc = f"{getattr(self, 'rpc_service', type(self).__name__)}/{name or method.__name__}"
        with rpc_scope(getattr(self, "tracing", None), rpc, request, context) as span:
            try:
                response = await method(self, request, context)
                annotate(span, response)
                return response
            except grpc.aio.AbortError:
                raise
            except Exception as e:  # noqa: BLE001 - every failure becomes a status: _abort raises
                await _abort(rpc, e, context)
        raise AssertionError("unreachable")  # abort() raises

    return wrapper


async def _abort(rpc: str, e: Exception, context: grpc.aio.ServicerContext) -> None:
    """End the call with the status `e` maps to (abort raises AbortError)."""
    if isinstance(e, AdapterNotLoaded):
        log.warning("%s refused: %s", rpc, e)
        context.set_trailing_metadata(((MISSING_ADAPTER_METADATA, e.adapter),))
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
    elif isinstance(e, InvalidInput):
        log.warning("%s refused: %s", rpc, e)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    elif isinstance(e, CacheMiss):
        log.info("%s: %s", rpc, e)
        context.set_trailing_metadata(((CACHE_MISS_METADATA, ",".join(map(str, e.seq_ids))),))
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
    elif isinstance(e, NotOwner):
        log.info("%s: %s", rpc, e)
        context.set_trailing_metadata(((NOT_OWNER_METADATA, e.owner),))
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
    elif isinstance(e, KVCacheExhausted):
        log.warning("%s: %s", rpc, e)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    elif isinstance(e, Refused):
        log.warning("%s refused: %s", rpc, e)
        await context.abort(e.code, str(e))
    elif isinstance(e, DeadlineExpired):
        log.info("%s: %s", rpc, e)
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
    else:  # a bug or a fault: the caller gets a short answer, the log the whole story
        log_id = uuid.uuid4().hex[:12]
        log.error("%s failed [log id %s]", rpc, log_id, exc_info=e)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error (log id {log_id})")


class Refused(Exception):
    """A call the service will not do, with the status code that says why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class DeadlineExpired(Exception):
    """The call's deadline passed before its work could start."""


def check_deadline(context: grpc.aio.ServicerContext) -> None:
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        raise DeadlineExpired("deadline already passed")


def call_deadline(context: grpc.aio.ServicerContext) -> float | None:
    """Refuse a call already expired on arrival; otherwise its absolute deadline (monotonic)."""
    check_deadline(context)
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def still_wanted(deadline: float | None) -> None:
    """On the model thread: calls queue behind the forward in flight, and one whose caller gave
    up meanwhile must not cost a forward."""
    if deadline is not None and time.monotonic() >= deadline:
        raise DeadlineExpired("deadline passed while the call waited for the model thread")


def sampling_spec(params: common_pb2.SamplingParams, field: str) -> SamplingSpec:
    """Proto -> SamplingSpec; InvalidInput naming the field when a value is out of range."""
    # the router sets every field; an unset one means greedy, no top-p, no top-k, unseeded
    p = SamplingParams(temperature=0.0).updated(**SamplingParams.given_in(params))
    problems = validate_sampling(p.temperature, p.top_p, p.top_k, field, p.min_p)
    if problems:
        raise InvalidInput(field, "; ".join(problems))
    return SamplingSpec(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p, seed=p.seed)
