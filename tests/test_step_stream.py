"""TargetService.StepStream through the router's TargetClient, over real gRPC on loopback: the
steps a router sends on its long-lived stream answer exactly as transformers decodes; a step that
fails ends the stream with that step's error and the next step opens a new one; a step slower than
its deadline fails as ServiceDown; a service shutting down does not wait its grace period for a
stream that waits for its next step."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch
from transformers import LlamaConfig

from router.clients import CacheMissError, ServiceDown, ServiceError, TargetClient, _translate
from tandem.v1 import target_pb2
from tests.conftest import SMALL, hf_greedy, write_checkpoint
from tests.stack import start_target


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(LlamaConfig(**SMALL), tmp_path_factory.mktemp("stream-target"), seed=5)


def serve(model_dir, grace_seconds: float = 5.0, step_delay_s: float = 0.0):
    server, _ = start_target(model_dir, num_blocks=64, block_size=4, step_delay_s=step_delay_s,
                             grace_seconds=grace_seconds)
    return server


def prompt(n: int) -> list[int]:
    return torch.randint(0, SMALL["vocab_size"], (n,), generator=torch.Generator().manual_seed(n)).tolist()


def entry(seq_id: int, start_pos: int, tokens: list[int]) -> target_pb2.StepEntry:
    return target_pb2.StepEntry(seq_id=seq_id, start_pos=start_pos, tokens=tokens, emit=True)


def test_steps_over_the_stream_decode_like_transformers_and_a_failed_step_costs_only_itself(model_dir):
    server = serve(model_dir)
    ids = prompt(12)
    ref = hf_greedy(model_dir, ids, 6)

    async def run() -> list[int]:
        client = TargetClient(server.address, timeout_s=30)
        try:
            [r] = (await client.step([entry(1, 0, ids)])).results
            got = list(r.tokens)
            first = client.steps._stream
            with pytest.raises(CacheMissError):  # seq 1 holds 12 tokens, not 40
                await client.step([entry(1, 40, [got[-1]])])
            assert client.steps._stream is None  # the failed step ended the stream
            for _ in range(5):
                [r] = (await client.step([entry(1, 12 + len(got) - 1, [got[-1]])])).results
                got += list(r.tokens)
            assert client.steps._stream is not None and client.steps._stream is not first  # a new one, kept open
            return got
        finally:
            await client.close()

    try:
        assert asyncio.run(run()) == ref
    finally:
        server.stop()


def test_a_step_slower_than_its_deadline_is_service_down_and_the_next_step_works(model_dir):
    server = serve(model_dir, step_delay_s=1.5)

    async def run() -> None:
        client = TargetClient(server.address, timeout_s=0.5)
        try:
            with pytest.raises(ServiceDown, match="DEADLINE_EXCEEDED"):
                await client.step([entry(1, 0, prompt(8))])
            assert client.steps._stream is None
            client.timeout_s = 30  # the service is slow, not gone: a patient step gets its answer
            [r] = (await client.step([entry(2, 0, prompt(8))])).results
            assert r.cached_len == 8 and len(r.tokens) == 1
        finally:
            await client.close()

    try:
        asyncio.run(run())
    finally:
        server.stop()


def test_shutdown_ends_a_stream_waiting_for_its_next_step_at_once(model_dir):
    grace = 60.0
    server = serve(model_dir, grace_seconds=grace)

    async def run() -> None:
        client = TargetClient(server.address, timeout_s=30)
        try:
            await client.step([entry(1, 0, prompt(8))])  # the stream stays open, waiting
            t0 = time.monotonic()
            await asyncio.to_thread(server.stop, grace + 10)
            assert time.monotonic() - t0 < grace / 3, "shutdown waited for the idle stream"
            with pytest.raises(ServiceDown):
                await client.step([entry(1, 8, [1])])
        finally:
            await client.close()

    asyncio.run(run())


def test_a_new_client_reaches_a_replica_back_on_the_same_address_at_once(model_dir):
    """gRPC shares subchannels process-wide per address by default: a new channel to a replica that
    restarted on its old address inherited the old channel's connection backoff and failed its first
    call with "connection refused" (seen once in CI, where a test's ephemeral port had been another's)."""
    gone = serve(model_dir)
    address, port = gone.address, gone.port
    gone.stop()

    async def run() -> None:
        old = TargetClient(address, timeout_s=0.5)
        for _ in range(3):  # the old channel's subchannel fails and backs off
            with pytest.raises(ServiceDown):
                await old.step([entry(1, 0, prompt(8))])
        back, _ = await asyncio.to_thread(start_target, model_dir, 64, port, 4)
        new = TargetClient(address, timeout_s=5)
        try:
            res = await new.step([entry(1, 0, prompt(8))])
            assert len(res.results[0].tokens) == 1
        finally:
            await asyncio.gather(old.close(), new.close())
            await asyncio.to_thread(back.stop)

    asyncio.run(run())


def test_a_transport_torn_down_under_a_stream_reads_as_the_service_going_away_not_breaking():
    def error(details: str) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), details)

    assert isinstance(_translate(error("Internal error from Core")), ServiceDown)
    assert isinstance(_translate(error("internal error (log id 7f3a)")), ServiceError)
