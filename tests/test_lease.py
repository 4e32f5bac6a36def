"""Ownership leases on a model service, over real gRPC: one router at a time, the others refused;
an expired or handed-over lease frees every block; the service tells how many routers share it."""

from __future__ import annotations

import time

import grpc
import pytest

from common.protocol import NOT_OWNER_METADATA, ROUTER_METADATA
from tandem.v1 import common_pb2, target_pb2, target_pb2_grpc
from tests.stack import start_target, wait_until


@pytest.fixture()
def served(model_pair):
    server, runner = start_target(model_pair[0])
    channel = grpc.insecure_channel(server.address)
    yield target_pb2_grpc.TargetServiceStub(channel), runner
    channel.close()
    server.stop()


def lease(stub, router: str, ttl_ms: int = 2000, release: bool = False) -> common_pb2.LeaseResponse:  # noqa: ANN001
    return stub.Lease(common_pb2.LeaseRequest(router_id=router, ttl_ms=ttl_ms, release=release), timeout=10)


def step(stub, router: str, seq_id: int, tokens: list[int]):  # noqa: ANN001, ANN201
    entry = target_pb2.StepEntry(seq_id=seq_id, start_pos=0, tokens=tokens, emit=True,
                                 sampling=common_pb2.SamplingParams(temperature=0.0))
    return stub.Step(target_pb2.StepRequest(entries=[entry]), timeout=30, metadata=((ROUTER_METADATA, router),))


def test_one_router_at_a_time_and_the_others_are_refused_by_name(served):
    stub, runner = served
    assert lease(stub, "a").granted
    step(stub, "a", 1, [5, 6, 7])
    with pytest.raises(grpc.RpcError) as refused:
        step(stub, "b", 2, [5, 6])
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert dict(refused.value.trailing_metadata())[NOT_OWNER_METADATA] == "a"
    answer = lease(stub, "b")
    assert not answer.granted and answer.owner == "a" and sorted(answer.routers) == ["a", "b"]
    assert lease(stub, "a").granted, "renewal"
    assert runner.blocks.num_sequences == 1, "nothing of a's was touched"


def test_an_expired_lease_frees_everything_and_passes_on(served):
    stub, runner = served
    assert lease(stub, "a", ttl_ms=500).granted
    step(stub, "a", 1, list(range(5, 40)))
    assert runner.blocks.num_free < runner.config.num_blocks
    assert wait_until(lambda: runner.blocks.num_free == runner.config.num_blocks, 10), "expiry frees a's blocks"
    assert lease(stub, "b").granted
    step(stub, "b", 1, [5, 6])


def test_a_router_taking_over_a_lapsed_lease_gets_an_empty_service(served):
    stub, runner = served
    assert lease(stub, "a", ttl_ms=300).granted
    step(stub, "a", 1, list(range(5, 40)))
    time.sleep(0.35)
    assert lease(stub, "b").granted and runner.blocks.num_free == runner.config.num_blocks


def test_giving_the_lease_up_frees_at_once(served):
    stub, runner = served
    assert lease(stub, "a", ttl_ms=60_000).granted
    step(stub, "a", 1, list(range(5, 40)))
    answer = lease(stub, "a", release=True)
    assert not answer.granted and answer.owner == "" and runner.blocks.num_free == runner.config.num_blocks


def test_without_a_lease_holder_calls_are_served_as_before(served):
    stub, _ = served
    step(stub, "", 1, [5, 6, 7])  # a single router that never asks for a lease, or a test's own client
    with pytest.raises(grpc.RpcError) as bad:
        stub.Lease(common_pb2.LeaseRequest(router_id="", ttl_ms=1000), timeout=10)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
