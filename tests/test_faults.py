"""Faults and odd situations, each with real servers on loopback: nothing hangs, nothing leaks,
a fault in one request fails that request only, and no request fails because of the draft."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import time

import httpx
import pytest

from router.config import RouterConfig
from router.lanes import IncompatibleLimits
from tandem.v1 import draft_pb2
from tests.conftest import hf_greedy
from tests.stack import REALISTIC_STEP_S, alter_proposals, complete, start_draft, start_router, start_target, wait_until
from tests.test_router_integration import metric, prompts

POISON = 311  # the fault-injecting target fails every step starting a sequence with it


def post(url: str, prompt: list[int], max_tokens: int) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0.0, "ignore_eos": True, "return_token_ids": True},
                      timeout=120)


def test_a_target_failing_one_sequence_fails_that_request_only(model_pair):
    """The target answers INTERNAL whenever the poisoned prompt is in a step: before, the router took
    the target for down and resent the same step forever. Now the step's sequences are retried one at
    a time: the poisoned one gets a 500 with a log id and nothing else, the others finish exactly."""
    target_dir, draft_dir = model_pair
    target, trunner = start_target(target_dir, step_delay_s=REALISTIC_STEP_S, fail_on_token=POISON)
    draft, drunner = start_draft(draft_dir)
    router = start_router(RouterConfig(max_num_batched_tokens=64, max_num_seqs=16), target.address, draft.address,
                          target_dir)
    try:
        good = prompts(6)
        bad = [POISON, 5, 6, 7]  # the target fails any step that starts a sequence with POISON
        with cf.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(post, router.url, p, 30) for p in good[:3]]
            poisoned = pool.submit(post, router.url, bad, 30)
            futures += [pool.submit(post, router.url, p, 30) for p in good[3:]]
            answers = [f.result(timeout=120) for f in futures]
            failed = poisoned.result(timeout=120)
        for p, r in zip(good, answers, strict=True):
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == hf_greedy(target_dir, p, 30)
        assert failed.status_code == 500
        message = failed.json()["error"]["message"]
        assert message.startswith("internal error (log id ") and "injected" not in message and "Runtime" not in message
        errors = metric(router.url, "tandem:target_step_errors_total")
        assert 1 <= errors <= 3, f"{errors} failed steps: a retry loop without a bound"
        # one poisoned prompt of a list fails the whole request, its other prompts stopped with it
        batch = httpx.post(f"{router.url}/v1/completions", json={
            "model": "tiny", "prompt": [good[0], bad], "max_tokens": 200, "temperature": 0.0, "ignore_eos": True},
            timeout=120)
        assert batch.status_code == 500 and batch.json()["error"]["message"].startswith("internal error (log id ")
        assert metric(router.url, 'tandem:requests_total{finish_reason="abort"}') == 1  # not run to 200 tokens
        assert httpx.get(f"{router.url}/ready").status_code == 200, "a service error is not the target being down"
        assert wait_until(lambda: trunner.blocks.num_free == trunner.config.num_blocks, 15)
        assert wait_until(lambda: drunner.blocks.num_free == drunner.config.num_blocks, 15)
    finally:
        router.stop(), target.stop(), draft.stop()


def test_placement_only_among_replicas_that_can_ever_hold_the_request(model_pair):
    """Two targets: one whose KV cache can never hold a long request. Before, the least loaded lane got
    it and its queue waited forever; now only the big one takes it, however loaded it is."""
    target_dir, _ = model_pair
    small, _ = start_target(target_dir, num_blocks=8)  # 128 tokens
    big, big_runner = start_target(target_dir, num_blocks=256)
    router = start_router(RouterConfig(max_num_batched_tokens=64, max_num_seqs=8, k_max=0),
                          f"{small.address},{big.address}", None, target_dir)
    try:
        long_prompt = prompts(5)[4]  # 150 tokens
        with cf.ThreadPoolExecutor(6) as pool:
            busy = [pool.submit(post, router.url, p, 40) for p in prompts(4)]  # load the big one first
            time.sleep(0.3)
            answers = [pool.submit(post, router.url, long_prompt, 20) for _ in range(2)]
            for f in [*busy, *answers]:
                assert f.result(timeout=120).status_code == 200
        assert answers[0].result().json()["choices"][0]["token_ids"] == hf_greedy(target_dir, long_prompt, 20)
    finally:
        router.stop(), small.stop(), big.stop()


def test_the_targets_limits_clamp_the_routers_or_refuse_to_start(model_pair, caplog):
    target_dir, _ = model_pair
    target, _ = start_target(target_dir, max_batch_tokens=32)
    try:
        router = start_router(RouterConfig(max_num_batched_tokens=64, max_num_seqs=8), target.address, None,
                              target_dir)
        try:
            out = complete(router.url, prompts(5)[4], 10)  # 150 prompt tokens: chunks of at most 32
            assert out["choices"][0]["token_ids"] == hf_greedy(target_dir, prompts(5)[4], 10)
            assert "clamped" in caplog.text
        finally:
            router.stop()
        with pytest.raises(IncompatibleLimits, match="--max-num-seqs 48"):
            start_router(RouterConfig(max_num_batched_tokens=64, max_num_seqs=48), target.address, None, target_dir)
    finally:
        target.stop()


def test_any_draft_failure_is_k_0_never_a_failed_request(model_pair):
    """A draft whose answers make no sense (one proposal too few) trips the router's own checks: the
    affected sequences run at k = 0 and every request still finishes exactly."""
    target_dir, draft_dir = model_pair
    target, _ = start_target(target_dir, step_delay_s=REALISTIC_STEP_S)

    def short(propose):  # noqa: ANN001, ANN202
        async def broken(request, context):  # noqa: ANN001, ANN202
            response = await propose(request, context)
            return draft_pb2.ProposeResponse(proposals=list(response.proposals)[1:], forward_ms=response.forward_ms)
        return broken

    def one_proposal_short(servicer) -> None:  # noqa: ANN001
        alter_proposals(servicer, short)

    draft, _ = start_draft(draft_dir, alter=one_proposal_short)
    # a fixed k: the draft is asked every step (with dynamic k, on the target's cores, it rests until measured to pay)
    router = start_router(RouterConfig(max_num_batched_tokens=64, max_num_seqs=16, dynamic_k=False), target.address,
                          draft.address, target_dir)
    try:
        ps = prompts(6)
        with cf.ThreadPoolExecutor(6) as pool:
            outs = list(pool.map(lambda p: complete(router.url, p, 24), ps))
        for p, out in zip(ps, outs, strict=True):
            assert out["choices"][0]["token_ids"] == hf_greedy(target_dir, p, 24)
        assert metric(router.url, 'tandem:draft_fallbacks_total{reason="error"}') >= 1
    finally:
        router.stop(), target.stop(), draft.stop()


def test_an_unreachable_target_gets_a_503_that_names_no_address(model_pair):
    target_dir, _ = model_pair
    target, _ = start_target(target_dir)
    router = start_router(RouterConfig(target_grace_s=1.0), target.address, None, target_dir)
    try:
        target.stop()
        assert wait_until(lambda: httpx.get(f"{router.url}/ready").status_code == 503, 15)
        r = post(router.url, [5, 6, 7], 5)
        assert r.status_code == 503 and "127.0.0.1" not in r.text and "UNAVAILABLE" not in r.text
    finally:
        router.stop()



def _load_wall(url: str, ps: list[list[int]], n: int) -> float:
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(ps)) as pool:
        outs = list(pool.map(lambda p: complete(url, p, n), ps))
    assert all(len(o["choices"][0]["token_ids"]) == n for o in outs)
    return time.perf_counter() - t0


def test_a_draft_slower_than_its_deadline_costs_no_throughput(model_pair):
    """Every Propose outlasts --draft-timeout. The step loop never waits for a draft that slow, so the same load
    takes about as long as with no draft at all (before: 3.4x as long, the draft pacing every step)."""
    target_dir, draft_dir = model_pair
    target, _ = start_target(target_dir, step_delay_s=REALISTIC_STEP_S)

    def slowed(propose):  # noqa: ANN001, ANN202
        async def slow(request, context):  # noqa: ANN001, ANN202
            await asyncio.sleep(1.5)
            return await propose(request, context)
        return slow

    def too_slow(servicer) -> None:  # noqa: ANN001
        alter_proposals(servicer, slowed)

    draft, _ = start_draft(draft_dir, alter=too_slow)
    # a fixed k keeps the draft asked every step (with dynamic k, sharing the target's cores here, it would
    # rest until measured to pay, router.regime, and might never be asked in so short a load)
    config = RouterConfig(max_num_batched_tokens=64, max_num_seqs=16, draft_timeout_s=1.0, dynamic_k=False)
    with_draft = start_router(config, target.address, draft.address, target_dir)
    without = start_router(config, target.address, None, target_dir)
    try:
        ps = prompts(8)
        _load_wall(without.url, ps[:2], 8)  # warm-up
        walls: dict[str, list[float]] = {"without": [], "with": []}
        for _ in range(2):  # interleaved, best of two: the machine's own noise hits both alike
            for name, router in (("without", without), ("with", with_draft)):
                walls[name].append(_load_wall(router.url, ps, 48))
        assert min(walls["with"]) <= 1.2 * min(walls["without"]), walls
        assert metric(with_draft.url, "tandem:draft_fallbacks_total") >= 1, "the draft really timed out"
    finally:
        with_draft.stop(), without.stop(), target.stop(), draft.stop()


def test_the_drafts_blocks_all_come_back_after_two_restarts_under_load(model_pair):
    """Releases made while the draft is away are kept and sent when it is back, and a restarted draft
    is refilled from the router's history: after the load it holds nothing."""
    target_dir, draft_dir = model_pair
    target, trunner = start_target(target_dir, step_delay_s=REALISTIC_STEP_S)
    draft, drunner = start_draft(draft_dir)
    router = start_router(RouterConfig(max_num_batched_tokens=64, max_num_seqs=16, draft_retry_s=0.2),
                          target.address, draft.address, target_dir)
    try:
        ps = prompts(10)
        with cf.ThreadPoolExecutor(10) as pool:
            futures = [pool.submit(complete, router.url, p, 60) for p in ps]
            for restart in range(2):
                assert wait_until(lambda r=restart: metric(router.url, "tandem:generation_tokens_total") > 80 * (r + 1),
                                  60)
                port = draft.port
                draft.stop(timeout=15)
                time.sleep(0.3)  # requests finish while it is away: their releases wait for it
                draft, drunner = start_draft(draft_dir, port=port)
            outs = [f.result(timeout=120) for f in futures]
        for p, out in zip(ps, outs, strict=True):
            assert out["choices"][0]["token_ids"] == hf_greedy(target_dir, p, 60)
        assert wait_until(lambda: metric(router.url, "tandem:draft_available") == 1, 30)
        complete(router.url, ps[0], 10)  # the draft takes part again ...
        assert wait_until(lambda: drunner.blocks.num_free == drunner.config.num_blocks, 15)  # ... and holds nothing
        assert wait_until(lambda: trunner.blocks.num_free == trunner.config.num_blocks, 15)
    finally:
        router.stop(), target.stop(), draft.stop()
