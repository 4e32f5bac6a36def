"""The pipelined step loop waits for a draft call about to finish (its proposals would land just
after the step that needs them), at most NEARLY_DONE_SHARE of a step; never for a slow or stuck call,
and never when no decoding sequence needs proposals. The call here is a real task that sleeps."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.config import RouterConfig
from router.core import GREEDY, Request, SeqStatus, Sequence
from router.drafting import DraftLane
from router.metrics import Metrics
from router.scheduler import CacheGeometry, Scheduler
from router.speculator import NEARLY_DONE_SHARE, Speculator
from tandem.v1 import common_pb2

STEP_MS = 20.0
ALLOWANCE_MS = NEARLY_DONE_SHARE * STEP_MS


def speculator(decoding: bool = True) -> tuple[Speculator, DraftLane]:
    config = RouterConfig()
    scheduler = Scheduler(config, CacheGeometry(1000, 16), CacheGeometry(1000, 16))
    lane = DraftLane(None, Metrics(config.k_max), retry_s=1.0)
    lane.up = True
    lane.info = common_pb2.ModelInfo(max_draft_tokens=8, max_model_len=4096, max_batch_tokens=1024)
    spec = Speculator(config, scheduler, lane, max_model_len=4096, target_max_k=8)
    seq = Sequence(seq_id=1, request=Request(request_id="r1", prompt_ids=[1, 2, 3], sampling=GREEDY, max_tokens=50))
    seq.tokens, seq.num_prompt, seq.target_cached, seq.status = [1, 2, 3, 4], 3, 3, SeqStatus.RUNNING
    assert not seq.prefilling
    if decoding:
        scheduler.running.append(seq)
    spec.last_step_ms = STEP_MS
    return spec, lane


def start_call(lane: DraftLane, takes_ms: float, due_in_ms: float) -> None:
    lane._call = asyncio.ensure_future(asyncio.sleep(takes_ms / 1000))  # stands in for a Propose in flight
    lane.due = time.perf_counter() + due_in_ms / 1000


@pytest.mark.parametrize(("takes_ms", "due_in_ms", "waits"), [
    (2.0, 2.0, True),  # about to finish: waited for, and done when the step is planned
    (2.0, -1.0, True),  # a little overdue: still waited for
    (50.0, 2.0, True),  # due soon but slower than expected: waited for the allowance only
    (50.0, 40.0, False),  # due after the allowance: the target goes on without it
    (200.0, -100.0, False),  # long overdue (slow or stuck): never waited for again
])
def test_waits_only_for_a_call_about_to_finish_and_never_past_the_allowance(takes_ms, due_in_ms, waits):
    async def scenario() -> tuple[float, bool]:
        spec, lane = speculator()
        start_call(lane, takes_ms, due_in_ms)
        waited = await spec.await_nearly_done()
        done = lane.idle
        await lane.wait()
        return waited, done

    waited, done = asyncio.run(scenario())
    assert waited <= ALLOWANCE_MS + 3.0, "never past the allowance (plus scheduling slack)"
    if not waits:
        assert waited == 0.0 and not done
    elif takes_ms < ALLOWANCE_MS:
        assert done, "the call finished while the loop waited"
    else:
        assert waited >= ALLOWANCE_MS * 0.9 and not done


def test_no_wait_without_a_decoding_sequence_or_without_pipelining():
    async def scenario() -> list[float]:
        out = []
        for decoding, pipeline in ((False, True), (True, False)):
            spec, lane = speculator(decoding)
            spec.config = RouterConfig(pipeline=pipeline)
            start_call(lane, 2.0, 2.0)
            out.append(await spec.await_nearly_done())
            await lane.wait()
        return out

    assert asyncio.run(scenario()) == [0.0, 0.0]
