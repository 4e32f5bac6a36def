"""Chained steps (router/chain.py, target_service/chaining.py): the router sends step t+1 while the
target still computes step t, each entry carrying proposals keyed by step t's outcome.

Specified here: the target takes the alternative whose outcome happened (else k = 0), and the
router books the same one; a chained entry is refused where it cannot be resolved; over real gRPC
two steps sent back to back decode exactly as transformers does, and a failed step takes the step
chained behind it along without harming the stream that follows; through the whole stack, chained
decoding matches transformers, greedy and sampled requests complete, and a target restart while
steps are chained loses nothing; a router without a draft chains its k = 0 decode steps too."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import pytest
import torch
from transformers import LlamaConfig

from common.sampling import SamplingParams
from engine.runner import InvalidInput
from router.chain import alternatives, chainable, resolve, with_lookup
from router.clients import CacheMissError, ServiceDown, TargetClient
from router.config import RouterConfig
from router.core import Request
from router.loop import StepLoop
from router.scheduler import Chunk, StepPlan
from router.sequence import Sequence
from router.speculation import Prepared
from tandem.v1 import common_pb2, target_pb2
from target_service.chaining import remember, resolve_chained
from tests.conftest import SMALL, hf_greedy, write_checkpoint
from tests.stack import REALISTIC_STEP_S, complete, running_stack, start_router, start_target, wait_until
from tests.test_router_integration import metric, prompts

T = TypeVar("T")


def chained(seq_id: int, *alts: tuple[list[int], list[int]]) -> target_pb2.StepEntry:
    return target_pb2.StepEntry(seq_id=seq_id, emit=True, chained=True, alternatives=[
        target_pb2.Alternative(after=after, drafts=drafts) for after, drafts in alts])


def sequence(tokens: list[int], prepared: list[Prepared] = ()) -> Sequence:
    seq = Sequence(seq_id=7, request=Request(request_id="r", prompt_ids=tokens[:2], sampling=SamplingParams(0.0),
                                             max_tokens=100), tokens=list(tokens))
    seq.prepared = list(prepared)
    return seq


# ---- the target's rule, without a model ---------------------------------------------------------
def test_a_chained_entry_verifies_the_alternative_whose_outcome_happened():
    request = target_pb2.StepRequest(entries=[chained(7, ([5, 8], [1, 2]), ([5, 9], [3, 4]))])
    chosen = resolve_chained(request, {7: (10, [5, 9])})
    e = request.entries[0]
    assert chosen == {0: 2}  # 1 + the index of the alternative taken
    assert (e.start_pos, list(e.tokens), e.num_draft_tokens) == (10, [9, 3, 4], 2)


def test_a_chained_entry_without_a_matching_alternative_decodes_at_k_0():
    request = target_pb2.StepRequest(entries=[chained(7, ([5, 8], [1, 2]))])
    assert resolve_chained(request, {7: (10, [6])}) == {0: 0}
    e = request.entries[0]
    assert (e.start_pos, list(e.tokens), e.num_draft_tokens) == (10, [6], 0)


@pytest.mark.parametrize(("entry", "chain", "field"), [
    (chained(7), None, "entries[0].chained"),  # a unary Step has no step before it
    (chained(7), {8: (3, [1])}, "entries[0].chained"),  # the sequence emitted nothing in the last step
    (target_pb2.StepEntry(seq_id=7, emit=True, chained=True, tokens=[4]), {7: (3, [1])}, "entries[0]"),
    (target_pb2.StepEntry(seq_id=7, chained=True), {7: (3, [1])}, "entries[0].emit"),
    (target_pb2.StepEntry(seq_id=7, emit=True, tokens=[4], alternatives=[target_pb2.Alternative(after=[1])]),
     {7: (3, [1])}, "entries[0].alternatives"),
])
def test_a_chained_entry_that_cannot_be_resolved_is_refused(entry, chain, field):
    with pytest.raises(InvalidInput) as err:
        resolve_chained(target_pb2.StepRequest(entries=[entry]), chain)
    assert err.value.field == field


def test_the_router_books_the_alternative_the_target_takes():
    rng = random.Random(0)
    for _ in range(500):
        alts = [target_pb2.Alternative(after=[rng.randrange(4) for _ in range(rng.randint(1, 3))],
                                       drafts=[rng.randrange(9)]) for _ in range(rng.randint(0, 4))]
        emitted = [rng.randrange(4) for _ in range(rng.randint(1, 3))]
        request = target_pb2.StepRequest(entries=[target_pb2.StepEntry(seq_id=1, emit=True, chained=True,
                                                                       alternatives=alts)])
        [target_chose] = resolve_chained(request, {1: (5, emitted)}).values()
        router_chose, (drafts, _) = resolve(alts, emitted)
        assert router_chose == target_chose
        assert drafts == list(request.entries[0].tokens[1:])


def test_what_a_step_emitted_is_what_the_next_one_chains_to():
    chain = {99: (1, [1])}
    entries = [target_pb2.StepEntry(seq_id=1, emit=True), target_pb2.StepEntry(seq_id=2, emit=False)]
    results = [target_pb2.EntryResult(seq_id=1, tokens=[4, 5], cached_len=12), target_pb2.EntryResult(seq_id=2)]
    remember(chain, entries, results)
    assert chain == {1: (12, [4, 5])}


# ---- the router's alternatives ------------------------------------------------------------------
def test_alternatives_key_each_prepared_branch_by_its_outcome():
    history, verifying = [1, 2, 3], [10, 11, 12]
    branches = [Prepared(3, (10, 40), (41, 42, 43), accepted=1, rank=1),  # d1 accepted, then 40
                Prepared(3, (10, 11, 12, 50), (51, 52), accepted=3, rank=1),  # all accepted, bonus 50
                Prepared(6, (), (60, 61, 62)),  # the plain proposal after all three: its first token is the bonus guess
                Prepared(3, (99, 1), (2,), accepted=1, rank=1)]  # bet on a d1 that was not drafted: never happens
    alts = alternatives(sequence(history, branches), verifying, k=2, greedy=True)
    assert {tuple(a.after): list(a.drafts) for a in alts} == {
        (10, 40): [41, 42], (10, 11, 12, 50): [51, 52], (10, 11, 12, 60): [61, 62]}
    assert alternatives(sequence(history, branches), verifying, k=0, greedy=True) == []


def test_alternatives_carry_their_q_when_sampling():
    q = [common_pb2.SparseDist(token_ids=[t], probs=[0.5]) for t in (41, 42, 43)]
    alts = alternatives(sequence([1, 2, 3], [Prepared(3, (40,), (41, 42, 43), tuple(q))]), [], k=2, greedy=False)
    assert [list(d.token_ids) for d in alts[0].draft_probs] == [[41], [42]]


def test_lookup_guesses_the_outcomes_with_what_followed_them_earlier():
    # verifying 20 21: lookup after "... 7 8" guesses 20 (d1's own outcome), after "... 7 8 20" 5, not 21
    history = [7, 8, 20, 5, 6, 9, 1, 7, 8]
    seq = sequence(history)
    alts, looked = with_lookup(seq, [20, 21], k=2, drafted=[])
    assert {tuple(a.after): list(a.drafts) for a in alts} == {(20, 5): [6, 9]}, \
        "after 20, the target's own token: lookup's guess 5, then what followed it"
    assert looked == {1: False}
    alts, _ = with_lookup(sequence(history), [20, 5], k=2, drafted=[])
    assert {tuple(a.after) for a in alts} == {(20, 5, 6)}, "all accepted: lookup guesses the bonus"
    assert with_lookup(seq, [20, 21], k=0, drafted=[]) == ([], {})


def test_where_draft_and_lookup_name_one_outcome_the_likelier_proposal_goes():
    history = [7, 8, 20, 5, 6, 9, 1, 7, 8]
    drafted = alternatives(sequence(history, [Prepared(9, (20, 5), (60, 61), accepted=1, rank=1)]), [20, 21],
                           k=3, greedy=True)
    for draft_rate, lookup_rate, taken, looked in ((0.9, 0.3, [60, 61], {}), (0.2, 0.8, [6, 9, 1], {1: True})):
        seq = sequence(history)
        seq.tracker.accepted, seq.tracker.tried = draft_rate * 100, 100
        seq.lookup_tracker.accepted, seq.lookup_tracker.tried = lookup_rate * 100, 100
        alts, lk = with_lookup(seq, [20, 21], k=3, drafted=drafted)
        assert [(tuple(a.after), list(a.drafts)) for a in alts] == [((20, 5), taken)]
        assert lk == looked


def test_a_sampled_requests_lookup_alternatives_are_point_guesses():
    seq = sequence([7, 8, 20, 5, 6, 9, 7, 8])
    seq.request = Request(request_id="s", prompt_ids=[7], sampling=SamplingParams(0.8), max_tokens=9)
    [alt], _ = with_lookup(seq, [20, 21], k=2, drafted=[])
    assert [(list(d.token_ids), list(d.probs)) for d in alt.draft_probs] == [([6], [1.0]), ([9], [1.0])]


def test_only_decode_steps_of_every_running_sequence_chain():
    a, b = sequence([1, 2, 3]), sequence([4, 5, 6])
    b.seq_id = 8
    assert chainable(StepPlan(decodes=[(a, 2), (b, 1)]), [a, b], waiting=False)
    assert not chainable(StepPlan(decodes=[(a, 2)]), [a, b], waiting=False)  # b waits for its proposal
    assert not chainable(StepPlan(decodes=[(a, 2), (b, 1)]), [a, b], waiting=True)  # admit the newcomer first
    assert not chainable(StepPlan(decodes=[(a, 2)], chunks=[Chunk(b, 0, 2)]), [a, b], waiting=False)
    for max_tokens, chains in ((6, True), (5, False)):  # b has 3 output tokens, and this step adds up to 1 + 1
        b.request = Request(request_id="m", prompt_ids=[4], sampling=SamplingParams(0.0), max_tokens=max_tokens)
        assert chainable(StepPlan(decodes=[(a, 2), (b, 1)]), [a, b], waiting=False) is chains
    # seeded sampling: its k must not depend on timing
    b.request = Request(request_id="s", prompt_ids=[4], sampling=SamplingParams(0.8, seed=3), max_tokens=9)
    assert not chainable(StepPlan(decodes=[(a, 2), (b, 1)]), [a, b], waiting=False)


# ---- over real gRPC -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(LlamaConfig(**SMALL), tmp_path_factory.mktemp("chain-target"), seed=5)


def over_grpc(model_dir, body: Callable[[TargetClient], Awaitable[T]]) -> T:
    """body(client) against a fresh target service; both closed after."""
    server, _ = start_target(model_dir, num_blocks=64, block_size=4)

    async def run() -> T:
        client = TargetClient(server.address, timeout_s=30)
        try:
            return await body(client)
        finally:
            await client.close()

    try:
        return asyncio.run(run())
    finally:
        server.stop()


def test_steps_sent_back_to_back_decode_like_transformers(model_dir):
    ids = torch.randint(0, SMALL["vocab_size"], (12,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = hf_greedy(model_dir, ids, 10)
    wrong = (ref[3] + 1) % SMALL["vocab_size"]

    async def steps(client: TargetClient) -> list[target_pb2.StepResponse]:
        [first] = (await client.step([target_pb2.StepEntry(seq_id=1, tokens=ids, emit=True)])).results
        assert list(first.tokens) == ref[:1]
        tickets = [
            await client.send_step([target_pb2.StepEntry(seq_id=1, start_pos=12, emit=True, num_draft_tokens=3,
                                                         tokens=[ref[0], ref[1], ref[2], wrong])]),
            await client.send_step([chained(1, ([ref[1], 0], [5]), (ref[1:4], ref[4:6]))]),  # the second happens
            await client.send_step([chained(1, ([0], [1, 2]))]),  # none happens: k = 0
        ]
        return [await client.receive_step(t) for t in tickets]

    [a], [b], [c] = (r.results for r in over_grpc(model_dir, steps))
    assert (list(a.tokens), a.num_accepted, a.cached_len) == (ref[1:4], 2, 15)
    assert (list(b.tokens), b.num_accepted, b.alternative, b.cached_len) == (ref[4:7], 2, 2, 18)
    assert (list(c.tokens), c.num_accepted, c.alternative) == (ref[7:8], 0, 0)


def test_a_failed_step_takes_the_chained_one_along_and_the_next_stream_serves(model_dir):
    ids = list(range(3, 15))

    async def steps(client: TargetClient) -> None:
        [r] = (await client.step([target_pb2.StepEntry(seq_id=1, tokens=ids, emit=True)])).results
        failing = await client.send_step([target_pb2.StepEntry(seq_id=1, start_pos=40, tokens=[r.tokens[0]],
                                                               emit=True)])  # it holds 12, not 40
        try:
            behind = await client.send_step([chained(1)])
        except ServiceDown:  # the stream already ended with the step ahead of it
            behind = None
        # the step ahead fails as itself; if the write behind it met the ended stream, gRPC reports the
        # call as broken instead (the router then recomputes as for a lost service): never as a success
        with pytest.raises(CacheMissError if behind is not None else (CacheMissError, ServiceDown)):
            await client.receive_step(failing)
        if behind is not None:
            with pytest.raises(ServiceDown):  # never run: the stream ended with the step ahead of it
                await client.receive_step(behind)
        [r2] = (await client.step([target_pb2.StepEntry(seq_id=1, start_pos=12, tokens=[r.tokens[0]],
                                                        emit=True)])).results
        assert r2.cached_len == 13

    over_grpc(model_dir, steps)


# ---- the whole stack ----------------------------------------------------------------------------
@pytest.fixture()
def stack(model_pair):
    config = RouterConfig(max_num_batched_tokens=64, max_num_seqs=8, dynamic_k=False, target_grace_s=20.0)
    with running_stack(model_pair, config) as s:
        yield s


def test_chained_decoding_matches_transformers(stack, caplog):
    router, (target_dir, _) = stack["router"], stack["dirs"]
    ps = prompts(4)
    for p in ps[:2]:  # one at a time: every decode step may chain
        assert complete(router.url, p, 40)["choices"][0]["token_ids"] == hf_greedy(target_dir, p, 40)
    with cf.ThreadPoolExecutor(2) as pool:  # two that finish apart: one ends while steps are chained
        outs = list(pool.map(lambda pn: complete(router.url, *pn), [(ps[2], 30), (ps[3], 45)]))
    for (p, n), out in zip([(ps[2], 30), (ps[3], 45)], outs, strict=True):
        assert out["choices"][0]["token_ids"] == hf_greedy(target_dir, p, n)
    assert metric(router.url, "tandem:chained_steps_total") > 10
    assert metric(router.url, "tandem:pipeline_hits_total") > 0  # chained steps verify the draft's branches
    # the first decode-only steps ran with the draft resting, to time the target alone (router.pacing)
    assert metric(router.url, 'tandem:draft_rests_total{reason="probe"}') >= 1
    # a sequence that finished at a step with one chained behind it is released after that one ran
    assert not [r for r in caplog.records if "lost the cache" in r.getMessage() or r.levelname == "ERROR"]


@contextmanager
def target_only(model_pair: tuple, lookup: bool) -> Iterator[tuple]:
    """A target and a router without a draft: with no lookup match either, every decode step after a
    sequence's first runs at k = 0 whatever the one before emits, so it is chained."""
    target_dir, _ = model_pair
    target, _ = start_target(target_dir, step_delay_s=REALISTIC_STEP_S)
    router = start_router(RouterConfig(prompt_lookup=lookup), target.address, None, target_dir)
    try:
        yield router, target_dir
    finally:
        router.stop()
        target.stop()


@pytest.mark.parametrize("lookup", [False, True])
def test_a_router_without_a_draft_chains_its_k_0_decode_steps_and_decodes_as_transformers(model_pair, lookup):
    """Its work between steps then overlaps the target's, and the answer is still transformers'.
    Where lookup finds a match the next step waits for the outcome (lookup proposes after it)."""
    with target_only(model_pair, lookup) as (router, target_dir):
        for p in prompts(3)[:2]:
            assert complete(router.url, p, 40)["choices"][0]["token_ids"] == hf_greedy(target_dir, p, 40)
        if not lookup:
            chained = metric(router.url, "tandem:chained_steps_total")
            assert metric(router.url, "tandem:draft_rests_total") == 0, "no draft: nothing sat out"
            assert chained >= 60, f"{chained} of ~78 decode steps chained"


def test_each_step_is_timed_from_where_the_one_before_ended(model_pair, monkeypatch):
    """step_time{part} splits each step's interval: over back-to-back chained steps the router's work
    on one answer belongs to that answer's step, so no two steps' intervals overlap (their parts add
    up to no more than the wall time). (Steps chained at k = 0, which do not depend on when a draft
    call lands: with one that lands late under load, too few steps chained to tell.)"""
    intervals: list[tuple[float, float]] = []
    record = StepLoop._record

    def timed(loop: StepLoop, plan, response, draft_ms, target_wall_ms, t_start, draft_busy, chained,
              progress) -> None:
        record(loop, plan, response, draft_ms, target_wall_ms, t_start, draft_busy, chained, progress)
        intervals.append((t_start, time.perf_counter()))

    monkeypatch.setattr(StepLoop, "_record", timed)
    with target_only(model_pair, lookup=False) as (router, _):
        complete(router.url, prompts(2)[0], 120)
        assert metric(router.url, "tandem:chained_steps_total") > 100
    overlaps = [n for n in range(1, len(intervals)) if intervals[n][0] < intervals[n - 1][1]]
    assert not overlaps, f"{len(overlaps)} of {len(intervals)} steps began before the one ahead was booked"


def test_sampled_requests_complete_over_chained_steps(stack):
    router = stack["router"]
    out = complete(router.url, prompts(2)[1], 48, temperature=0.9)
    assert len(out["choices"][0]["token_ids"]) == 48
    assert metric(router.url, "tandem:chained_steps_total") > 0


def test_a_target_restart_while_steps_are_chained_loses_nothing(stack):
    router, (target_dir, _), parts = stack["router"], stack["dirs"], stack["parts"]
    p = prompts(3)[2]
    with cf.ThreadPoolExecutor(1) as pool:
        future = pool.submit(complete, router.url, p, 120)
        assert wait_until(lambda: metric(router.url, "tandem:chained_steps_total") > 5, 30)
        port = parts["target"].port
        parts["target"].stop(timeout=15)
        parts["target"], _ = start_target(target_dir, port=port, step_delay_s=REALISTIC_STEP_S)
        out = future.result(timeout=120)
    assert out["choices"][0]["token_ids"] == hf_greedy(target_dir, p, 120)
