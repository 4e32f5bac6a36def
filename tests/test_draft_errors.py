"""DraftService refusals over real gRPC: every bad request gets its documented code, changes
no cache and leaves the service ready for the next call; capacity and deadlines are checked
before any forward."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from common.protocol import CACHE_MISS_METADATA
from common.tokenizer import tokenizer_fingerprint
from draft_service import create_servicer
from engine import EngineConfig, ModelRunner
from tandem.v1 import common_pb2, draft_pb2
from tests.conftest import hf_greedy
from tests.test_draft_service import MAX_K, VOCAB, entry, make_checkpoint, propose, serve_runner, sync, toks


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("draft-errors"), seed=3)


@pytest.fixture(scope="module")
def svc(draft_dir):
    s = serve_runner(ModelRunner.load(draft_dir, EngineConfig(num_blocks=256, block_size=4, device="cpu")),
                     max_draft_tokens=MAX_K)
    yield s
    s.channel.close()
    s.server.stop()


def _with(e: draft_pb2.ProposeEntry, **sampling: object) -> draft_pb2.ProposeEntry:
    """The entry with these SamplingParams fields merged in."""
    e.sampling.MergeFrom(common_pb2.SamplingParams(**sampling))
    return e


BAD_PROPOSALS = [
    ("empty batch", [], "entries"),
    ("duplicate", [entry(601, 10, [1], 2), entry(601, 10, [1], 2)], "entries[1].seq_id"),
    ("empty tokens", [entry(601, 10, [], 2)], "entries[0].tokens"),
    ("token id", [entry(601, 10, [VOCAB], 2)], "entries[0].tokens"),
    ("k too large", [entry(601, 10, [1], MAX_K + 1)], "entries[0].k"),
    ("temperature", [entry(601, 10, [1], 2), entry(602, 0, [1], 2, temperature=-1.0)],
     "entries[1].sampling.temperature"),
    ("top_p", [entry(601, 10, [1], 2, temperature=1.0, top_p=1.5)], "entries[0].sampling.top_p"),
    ("top_k", [entry(601, 10, [1], 2, temperature=1.0, top_k=-3)], "entries[0].sampling.top_k"),
    ("past max_model_len", [entry(601, 250, [1, 2], 5)], "entries[0].k"),
    ("start past max_model_len", [entry(601, 256, [1], 0)], "entries[0].start_pos"),
    ("max_batch_tokens", [entry(700 + i, 0, [1] * 200, 0) for i in range(11)], "max_batch_tokens"),
    ("logit_bias id", [_with(entry(601, 10, [1], 2), logit_bias={VOCAB: 1.0})], "entries[0].sampling"),
    ("allowed id", [_with(entry(601, 10, [1], 2), allowed_token_ids=[3, VOCAB])], "entries[0].sampling"),
    ("bad word id", [_with(entry(601, 10, [1], 2), bad_words=[common_pb2.TokenIds(ids=[4, VOCAB + 7])])],
     "entries[0].sampling"),
    ("empty bad word", [_with(entry(601, 10, [1], 2), bad_words=[common_pb2.TokenIds()])],
     "entries[0].sampling.bad_words"),
]


@pytest.mark.parametrize("name, entries, field", BAD_PROPOSALS, ids=[b[0] for b in BAD_PROPOSALS])
def test_bad_proposals_are_refused_and_change_nothing(svc, name, entries, field):
    runner = svc.runner
    prefix = toks(600, 10)
    sync(svc.stub, (601, 0, prefix))
    before = (runner.forward_calls, runner.blocks.num_free, runner.cached_len(601), runner.blocks.num_sequences)
    with pytest.raises(grpc.RpcError) as err:
        propose(svc.stub, *entries)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    after = (runner.forward_calls, runner.blocks.num_free, runner.cached_len(601), runner.blocks.num_sequences)
    assert after == before
    [ok] = propose(svc.stub, entry(601, 10, [1], 2))  # a valid call right after succeeds
    assert len(ok.tokens) == 2 and ok.cached_len == 12
    svc.stub.Release(common_pb2.ReleaseRequest(seq_ids=[601]), timeout=10)


def test_cache_miss_names_the_sequences(svc, draft_dir):
    sync(svc.stub, (611, 0, toks(611, 6)))
    free = svc.runner.blocks.num_free
    calls = [(lambda: propose(svc.stub, entry(611, 6, [1], 2), entry(612, 4, [1], 2), entry(613, 1, [2], 1)),
              "612,613"),
             (lambda: sync(svc.stub, (611, 7, [1]), (612, 3, [1])), "611,612")]
    for call, missing in calls:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert dict(err.value.trailing_metadata())[CACHE_MISS_METADATA] == missing
        assert svc.runner.cached_len(611) == 6 and svc.runner.blocks.num_free == free
    # recovery: resend the history from 0
    [ok] = propose(svc.stub, entry(612, 0, toks(612, 5), 3))
    assert list(ok.tokens) == hf_greedy(draft_dir, toks(612, 5), 3)
    svc.stub.Release(common_pb2.ReleaseRequest(seq_ids=[611, 612]), timeout=10)


@pytest.mark.parametrize("chunks, field", [([], "chunks"), ([(621, 0, [])], "chunks[0].tokens"),
                                           ([(621, 0, [1]), (621, 0, [2])], "chunks[1].seq_id"),
                                           ([(621, 250, [1] * 7)], "chunks[0].start_pos")])
def test_bad_sync_is_refused(svc, chunks, field):
    with pytest.raises(grpc.RpcError) as err:
        sync(svc.stub, *chunks)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
    assert svc.runner.cached_len(621) == 0
    assert list(sync(svc.stub, (621, 0, [1, 2, 3])).cached_len) == [3]
    svc.stub.Release(common_pb2.ReleaseRequest(seq_ids=[621]), timeout=10)


def test_capacity_is_checked_for_the_whole_proposal(draft_dir, tmp_path, svc):
    other = make_checkpoint(tmp_path / "other", seed=9)  # different weights, same tokenizer
    small = serve_runner(ModelRunner.load(other, EngineConfig(num_blocks=8, block_size=4, device="cpu")))
    try:
        info = small.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
        assert info.tokenizer_fingerprint == svc.stub.GetInfo(common_pb2.GetInfoRequest()).tokenizer_fingerprint
        assert info.tokenizer_fingerprint == tokenizer_fingerprint(other) != ""
        runner = small.runner
        sync(small.stub, (1, 0, toks(1, 20)))  # 5 of 8 blocks
        calls = runner.forward_calls
        # round 0 (8 tokens, 2 blocks) would fit; the whole call (8 + 6 - 1 drafts cached = 13 tokens) does not
        for call in (lambda: propose(small.stub, entry(2, 0, toks(2, 8), k=6)),
                     lambda: sync(small.stub, (2, 0, toks(2, 13)))):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert runner.forward_calls == calls and runner.blocks.num_free == 3 and not runner.blocks.has(2)
        [ok] = propose(small.stub, entry(2, 0, toks(2, 8), k=4))  # caches 8 + 3 = 11 tokens: 3 blocks
        assert ok.cached_len == 11 and runner.blocks.num_free == 0
        runner.blocks.check_invariants()
    finally:
        small.channel.close()
        small.server.stop()


class _Aborted(Exception):
    pass


class _Context:
    """The few ServicerContext methods the servicer uses, with a chosen time budget."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining

    def invocation_metadata(self) -> tuple:
        return ()

    def set_trailing_metadata(self, metadata) -> None:
        pass

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)


def test_expired_deadlines_cost_no_forward(draft_dir):
    runner = ModelRunner.load(draft_dir, EngineConfig(num_blocks=16, block_size=4, device="cpu"))
    servicer = create_servicer(runner)
    request = draft_pb2.ProposeRequest(entries=[entry(1, 0, [1, 2, 3], 2)])

    async def scenario() -> None:
        with pytest.raises(_Aborted) as err:  # expired on arrival
            await servicer.Propose(request, _Context(0.0))
        assert err.value.args[0] == grpc.StatusCode.DEADLINE_EXCEEDED
        # expires while queued behind a forward in flight
        busy = asyncio.ensure_future(servicer.worker.run(time.sleep, 0.3))
        await asyncio.sleep(0.01)
        with pytest.raises(_Aborted) as err:
            await servicer.Propose(request, _Context(0.1))
        assert err.value.args[0] == grpc.StatusCode.DEADLINE_EXCEEDED
        await busy
        ok = await servicer.Propose(request, _Context(None))
        assert len(ok.proposals[0].tokens) == 2

    asyncio.run(scenario())
    assert runner.forward_calls == 2  # only the last call's two rounds


@pytest.mark.parametrize("stop_after_ms", [-1.0, float("nan"), float("inf")])
def test_a_bad_time_to_stop_by_is_refused(svc, stop_after_ms):
    runner = svc.runner
    sync(svc.stub, (611, 0, toks(610, 10)))
    before = (runner.forward_calls, runner.cached_len(611))
    with pytest.raises(grpc.RpcError) as err:
        svc.stub.Propose(draft_pb2.ProposeRequest(entries=[entry(611, 10, [1], 3)], stop_after_ms=stop_after_ms),
                         timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop_after_ms" in err.value.details()
    assert (runner.forward_calls, runner.cached_len(611)) == before
    svc.stub.Release(common_pb2.ReleaseRequest(seq_ids=[611]), timeout=10)


def test_a_call_out_of_time_answers_with_fewer_drafts_over_grpc(svc, draft_dir):
    """A moment to spare (0.01 ms): the branch's first draft (the plain entry rides along: two), no
    more, and cached_len says what stayed cached."""
    prompt = toks(620, 12)
    sync(svc.stub, (621, 0, prompt[:-1]))
    response = svc.stub.Propose(draft_pb2.ProposeRequest(
        entries=[entry(621, len(prompt) - 1, prompt[-1:], 4), entry(622, 0, toks(623, 8), 4, num_verifying=2,
                                                                 branches=((2, 1),))],
        stop_after_ms=0.01), timeout=10)
    plain, branched = response.proposals
    assert list(plain.tokens) == hf_greedy(draft_dir, prompt, 2) and plain.cached_len == len(prompt) + 1
    assert [len(b.drafts) for b in branched.branches] == [1] and response.forwards == 2
    svc.stub.Release(common_pb2.ReleaseRequest(seq_ids=[621, 622]), timeout=10)
