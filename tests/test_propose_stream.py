"""DraftService.ProposeStream through the router's DraftClient, over real gRPC on loopback: proposals
over the stream are the unary Propose's; a call that fails ends the stream with its error and the next
opens a new one; a service shutting down does not wait its grace period for a waiting stream."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from transformers import LlamaConfig

from router.clients import CacheMissError, DraftClient, ServiceDown
from tandem.v1 import common_pb2, draft_pb2
from tests.conftest import SMALL, write_checkpoint
from tests.stack import start_draft

GREEDY = common_pb2.SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(LlamaConfig(**SMALL), tmp_path_factory.mktemp("stream-draft"), seed=6)


def entry(seq_id: int, start_pos: int, tokens: list[int], k: int = 3) -> draft_pb2.ProposeEntry:
    return draft_pb2.ProposeEntry(seq_id=seq_id, start_pos=start_pos, tokens=tokens, k=k, sampling=GREEDY)


def prompt(n: int) -> list[int]:
    return torch.randint(0, SMALL["vocab_size"], (n,), generator=torch.Generator().manual_seed(n)).tolist()


def test_proposals_over_the_stream_are_the_unary_calls_and_a_failed_call_costs_only_itself(model_dir):
    server, _ = start_draft(model_dir)
    ids = prompt(10)

    async def run() -> tuple[list[int], list[int]]:
        client = DraftClient(server.address, timeout_s=30)
        try:
            [streamed] = (await client.propose([entry(1, 0, ids)])).proposals
            first = client.proposals._stream
            assert first is not None, "the stream stays open for the next call"
            with pytest.raises(CacheMissError):  # seq 1's cache ends well before position 40
                await client.propose([entry(1, 40, [5])])
            assert client.proposals._stream is None, "the failed call ended the stream"
            unary = await client._call(client.stub.Propose, draft_pb2.ProposeRequest(entries=[entry(2, 0, ids)]))
            [again] = (await client.propose([entry(3, 0, ids)])).proposals
            assert client.proposals._stream is not None and client.proposals._stream is not first
            assert list(again.tokens) == list(streamed.tokens)
            return list(streamed.tokens), list(unary.proposals[0].tokens)
        finally:
            await client.close()

    try:
        streamed, unary = asyncio.run(run())
        assert len(streamed) == 3 and streamed == unary
    finally:
        server.stop()


def test_shutdown_ends_a_proposal_stream_waiting_for_its_next_call_at_once(model_dir):
    grace = 60.0
    server, _ = start_draft(model_dir, grace_seconds=grace)

    async def run() -> None:
        client = DraftClient(server.address, timeout_s=30)
        try:
            await client.propose([entry(1, 0, prompt(8))])  # the stream stays open, waiting
            t0 = time.monotonic()
            await asyncio.to_thread(server.stop, grace + 10)
            assert time.monotonic() - t0 < grace / 3, "shutdown waited for the idle stream"
            with pytest.raises(ServiceDown):
                await client.propose([entry(1, 8, [1])])
        finally:
            await client.close()

    asyncio.run(run())


def test_a_call_launched_with_a_plan_is_planned_after_the_launcher_yields_and_a_failed_plan_costs_no_step(model_dir):
    """The step loop launches the draft's call with a function that plans it, then sends the target's
    Step: the planning runs in the call's task, once the loop yields (the Step is on its way). A plan
    that raises is logged; the step that launched it goes on."""
    from router.core import GREEDY, Request, SeqStatus
    from router.draft_work import DraftWork
    from router.drafting import DraftLane
    from router.metrics import Metrics
    from router.sequence import Sequence

    server, _ = start_draft(model_dir)
    ids = prompt(12)

    async def run() -> list[str]:
        lane = DraftLane(DraftClient(server.address, timeout_s=30, router_id="r1"), Metrics(4), retry_s=0.1)
        await lane.connect("", SMALL["vocab_size"])
        assert lane.up
        seq = Sequence(seq_id=1, request=Request(request_id="r", prompt_ids=ids, sampling=GREEDY, max_tokens=8),
                       tokens=list(ids), num_prompt=len(ids), status=SeqStatus.RUNNING)
        events: list[str] = []

        def plan() -> DraftWork:
            events.append("planned")
            work = DraftWork()
            assert work.add(seq, list(ids), 3, 0, seq.request.sampling_proto, [], lane.budget)
            return work

        try:
            t0 = time.perf_counter()
            lane.launch(plan)
            events.append("step sent")
            assert lane.in_flight is None and not lane.idle, "not planned yet, but the lane is taken"
            await asyncio.sleep(0)
            assert events == ["step sent", "planned"] and lane.in_flight is not None
            await lane.wait()
            assert lane.idle and lane.busy_since(t0) and not lane.busy_since(time.perf_counter())
            assert seq.draft_cached >= len(ids) and len(seq.prepared) == 1, "the call's proposal landed"

            def broken() -> DraftWork:
                raise RuntimeError("a planning bug")

            lane.launch(broken)
            await lane.wait()
            assert lane.idle and lane.in_flight is None and lane.up, "nothing was sent; the draft is still up"
        finally:
            await lane.close()
            await lane.client.close()
        return events

    try:
        asyncio.run(run())
    finally:
        server.stop()


def test_a_call_due_before_its_drafts_are_done_stops_early_and_is_costed_as_run(model_dir):
    """A call prepared beside a target step is due when that step answers (DraftWork.due): one already
    past due stops after each continuation's first draft, books the rounds it ran (its cost sample)
    and counts as stopped; one with time to spare drafts its k."""
    from router.core import GREEDY as GREEDY_SPEC
    from router.core import Request, SeqStatus
    from router.draft_work import DraftWork
    from router.drafting import DraftLane
    from router.metrics import Metrics
    from router.sequence import Sequence

    server, _ = start_draft(model_dir)

    async def run() -> None:
        metrics = Metrics(4)
        lane = DraftLane(DraftClient(server.address, timeout_s=30, router_id="r1"), metrics, retry_s=0.1)
        await lane.connect("", SMALL["vocab_size"])
        costed: list[int] = []
        lane.on_cost = lambda work, ms: costed.append(work.rounds)
        try:
            for seq_id, due_in_s, drafts in ((1, -1.0, 1), (2, 60.0, 4)):
                ids = prompt(10 + seq_id)
                seq = Sequence(seq_id=seq_id, request=Request(request_id=f"r{seq_id}", prompt_ids=ids,
                                                              sampling=GREEDY_SPEC, max_tokens=8),
                               tokens=list(ids), num_prompt=len(ids), status=SeqStatus.RUNNING)
                work = DraftWork()
                assert work.add(seq, list(ids), 4, 0, seq.request.sampling_proto, [], lane.budget)
                assert work.rounds == 4
                work.due = time.perf_counter() + due_in_s
                await lane.run(work)
                assert [len(p.drafts) for p in seq.prepared] == [drafts]
                assert seq.draft_cached == len(ids) + drafts - 1
            assert costed == [1, 4]
            assert metrics.draft_stops._value.get() == 1
        finally:
            await lane.close()
            await lane.client.close()

    try:
        asyncio.run(run())
    finally:
        server.stop()
