"""TargetService over real gRPC on loopback, against transformers' greedy decoding of the same
tiny checkpoint: whole prompts, chunked prompts, verification mixed with prefill, rollback,
logprobs, bad requests (nothing changes, the next step still works), capacity and release."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import LlamaConfig

from common.protocol import CACHE_MISS_METADATA
from engine import EngineConfig, ModelRunner
from engine.rpc import DeadlineExpired
from tandem.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.server import SERVICE_NAME, create_servicer, register
from tests.conftest import SMALL, hf_greedy, hf_logits, write_checkpoint
from tests.servers import start_server

VOCAB = SMALL["vocab_size"]
MAX_K = 4


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(LlamaConfig(**SMALL), tmp_path_factory.mktemp("target-llama"), seed=3)


def _serve(model_dir, num_blocks: int):
    runner = ModelRunner.load(model_dir, EngineConfig(num_blocks=num_blocks, block_size=4, device="cpu"))
    servicer = create_servicer(runner, "tiny-target", max_draft_tokens=MAX_K)
    server = start_server(lambda s: register(s, servicer), SERVICE_NAME)
    channel = grpc.insecure_channel(server.address)
    return server, channel, servicer


@pytest.fixture(scope="module")
def service(model_dir):
    server, channel, servicer = _serve(model_dir, num_blocks=64)
    yield target_pb2_grpc.TargetServiceStub(channel), channel, servicer
    channel.close()
    server.stop()


@pytest.fixture
def stub(service):
    stub, _, _ = service
    yield stub
    stub.Release(common_pb2.ReleaseRequest(seq_ids=list(range(1000))), timeout=10)


def entry(seq_id: int, start_pos: int, toks: list[int], emit: bool = True, k: int = 0, logprobs: int = -1,
          sampling: common_pb2.SamplingParams | None = None, draft_probs=()) -> target_pb2.StepEntry:
    return target_pb2.StepEntry(seq_id=seq_id, start_pos=start_pos, tokens=toks, emit=emit, num_draft_tokens=k,
                                logprobs=logprobs, sampling=sampling, draft_probs=list(draft_probs))


def step(stub, *entries: target_pb2.StepEntry) -> list[target_pb2.EntryResult]:
    return list(stub.Step(target_pb2.StepRequest(entries=entries), timeout=30).results)


def test_whole_prompt_then_decode_matches_transformers(stub, model_dir):
    prompt = tokens(1, 20)
    ref = hf_greedy(model_dir, prompt, 8)
    [r] = step(stub, entry(1, 0, prompt))
    assert (list(r.tokens), r.num_accepted, r.cached_len) == ([ref[0]], 0, 20)
    got = [ref[0]]
    for i in range(7):
        [r] = step(stub, entry(1, 20 + i, [got[-1]]))
        assert r.cached_len == 21 + i
        got += list(r.tokens)
    assert got == ref


def test_chunked_prompt_matches_transformers(stub, model_dir):
    prompt = tokens(2, 23)
    ref = hf_greedy(model_dir, prompt, 4)
    pos = 0
    for size in (7, 9):
        [r] = step(stub, entry(2, pos, prompt[pos:pos + size], emit=False))
        pos += size
        assert (list(r.tokens), r.cached_len) == ([], pos)
    [r] = step(stub, entry(2, pos, prompt[pos:]))
    got = list(r.tokens)
    while len(got) < 4:
        [r] = step(stub, entry(2, len(prompt) + len(got) - 1, [got[-1]]))
        got += list(r.tokens)
    assert got == ref


def test_verification_mixed_with_prefill_matches_transformers(stub, model_dir):
    """One batch: a partly wrong draft, a fully right draft (bonus), a first prompt chunk and a
    last prompt chunk. Then the rejected sequence continues from the corrected position."""
    pa, pb, pc, pd = tokens(3, 15), tokens(4, 12), tokens(5, 18), tokens(6, 9)
    ga, gc, gd = hf_greedy(model_dir, pa, 10), hf_greedy(model_dir, pc, 1), hf_greedy(model_dir, pd, 6)
    first = step(stub, entry(10, 0, pa), entry(13, 0, pd), entry(12, 0, pc[:10], emit=False))
    assert [list(r.tokens) for r in first] == [[ga[0]], [gd[0]], []]

    bad = ga[1:5]
    bad[2] = (bad[2] + 1) % VOCAB  # the third draft is wrong: 2 accepted, then the true token
    results = step(stub,
                   entry(10, 15, [ga[0], *bad], k=4, logprobs=3),
                   entry(11, 0, pb[:6], emit=False),
                   entry(12, 10, pc[10:]),
                   entry(13, 9, [gd[0], *gd[1:5]], k=4))
    a, b, c, d = results
    assert [r.seq_id for r in results] == [10, 11, 12, 13]
    assert (list(a.tokens), a.num_accepted, a.cached_len) == (ga[1:4], 2, 15 + 1 + 2)
    assert (list(b.tokens), b.num_accepted, b.cached_len) == ([], 0, 6)
    assert (list(c.tokens), c.cached_len) == (gc, 18)
    assert (list(d.tokens), d.num_accepted, d.cached_len) == (gd[1:6], 4, 9 + 1 + 4)

    # logprobs of the emitted tokens under the raw distribution, with the top-3 alternatives
    ref_lp = hf_logits(model_dir, pa + ga[:3]).log_softmax(-1)[-3:]
    assert [lp.token_id for lp in a.logprobs] == ga[1:4]
    for row, lp in zip(ref_lp, a.logprobs, strict=True):
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        assert list(lp.top_token_ids) == row.topk(3).indices.tolist()
        assert list(lp.top_logprobs) == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)

    # continue seq 10 after the rollback: first draft wrong this time (0 accepted)
    wrong = [(ga[4] + 5) % VOCAB, ga[5]]
    [a] = step(stub, entry(10, 18, [ga[3], *wrong], k=2))
    assert (list(a.tokens), a.num_accepted, a.cached_len) == ([ga[4]], 0, 19)
    [a] = step(stub, entry(10, 19, [ga[4], *ga[5:9]], k=4))
    assert (list(a.tokens), a.num_accepted, a.cached_len) == (ga[5:10], 4, 24)


def test_prompt_logprobs_of_a_chunked_prompt_match_transformers(stub, model_dir):
    """Two chunks asking for their prompt tokens' logprobs (what echo with logprobs shows): every
    prompt token but the first is scored once, by the chunk holding the position before it, as
    transformers' log_softmax over the whole prompt; a decode beside them is unchanged."""
    prompt, other = tokens(7, 17), tokens(8, 6)
    ref = hf_logits(model_dir, prompt).log_softmax(-1)
    first, _ = step(stub, target_pb2.StepEntry(seq_id=20, start_pos=0, tokens=prompt[:10], emit=False,
                                               prompt_logprobs=2, next_prompt_token=prompt[10]),
                    entry(21, 0, other))
    last, decode = step(stub, target_pb2.StepEntry(seq_id=20, start_pos=10, tokens=prompt[10:], emit=True,
                                                   prompt_logprobs=0, logprobs=1),
                        entry(21, 6, [hf_greedy(model_dir, other, 1)[0]]))
    scored = list(first.prompt_logprobs) + list(last.prompt_logprobs)
    assert [lp.token_id for lp in scored] == prompt[1:]
    assert len(first.prompt_logprobs) == 10 and len(last.prompt_logprobs) == 6
    for pos, lp in enumerate(scored):
        assert lp.logprob == pytest.approx(ref[pos, prompt[pos + 1]].item(), abs=1e-4)
        assert lp.rank == int((ref[pos] > ref[pos, prompt[pos + 1]]).sum()) + 1  # 1: the most likely
    for pos, lp in enumerate(first.prompt_logprobs):
        assert list(lp.top_token_ids) == ref[pos].topk(2).indices.tolist()
    assert all(not lp.top_token_ids for lp in last.prompt_logprobs)
    # the last chunk still emits the first token, with its own logprob, and decodes go on as before
    assert list(last.tokens) == hf_greedy(model_dir, prompt, 1) and len(last.logprobs) == 1
    assert last.logprobs[0].logprob == pytest.approx(ref[-1].max().item(), abs=1e-4)
    assert list(decode.tokens) == hf_greedy(model_dir, other, 2)[1:] and not decode.prompt_logprobs


def _sampled(seed: int, temperature: float = 0.9) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=temperature, top_k=40, seed=seed)


def _dists(draft: list[int]) -> list[common_pb2.SparseDist]:
    return [common_pb2.SparseDist(token_ids=[t, (t + 1) % VOCAB, (t + 2) % VOCAB], probs=[0.5, 0.3, 0.2])
            for t in draft]


def test_sampled_steps_reproduce_with_the_same_seed(stub):
    prompt, draft = tokens(7, 14), tokens(8, 3)

    def run(seq_id: int, seed: int, neighbours: bool) -> list[list[int]]:
        extra = [entry(seq_id + 500, 0, tokens(9, 11), sampling=_sampled(99, 1.0))] if neighbours else []
        [r1, *_] = step(stub, entry(seq_id, 0, prompt, sampling=_sampled(seed)), *extra)
        more = [entry(seq_id + 500, 11, [5, 6], k=1, sampling=_sampled(3), draft_probs=_dists([6]))] * neighbours
        [r2, *_] = step(stub, entry(seq_id, 14, [r1.tokens[0], *draft], k=3, sampling=_sampled(seed),
                                    draft_probs=_dists(draft)), *more)
        return [list(r1.tokens), list(r2.tokens)]

    a = run(20, seed=5, neighbours=False)
    assert a == run(21, seed=5, neighbours=True)
    firsts = {run(30 + s, seed=s, neighbours=False)[0][0] for s in range(6)}
    assert len(firsts) > 1, "different seeds should give different samples"


def _code(stub, request: target_pb2.StepRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        stub.Step(request, timeout=30)
    return err.value


def test_bad_requests_change_nothing(stub, model_dir):
    prompt = tokens(10, 16)
    ref = hf_greedy(model_dir, prompt, 2)
    [r] = step(stub, entry(40, 0, prompt[:12], emit=False))
    # each bad batch also carries a valid entry that would trim seq 40 to 5 tokens if it ran
    trims = entry(40, 5, prompt[5:12], emit=False)

    def one_draft(ids: list[int], probs: list[float]) -> target_pb2.StepEntry:  # draft token 2 with this q
        return entry(41, 0, [1, 2], k=1, sampling=_sampled(1),
                     draft_probs=[common_pb2.SparseDist(token_ids=ids, probs=probs)])

    e1 = "entries[1]"  # entries[0] is `trims`
    cases = [
        ([entry(41, 0, [1, 2], sampling=common_pb2.SamplingParams(temperature=-1))], f"{e1}.sampling.temperature"),
        ([entry(41, 0, [1, 2], sampling=common_pb2.SamplingParams(temperature=1, top_p=1.5))], f"{e1}.sampling.top_p"),
        ([entry(41, 0, [1, 2], sampling=common_pb2.SamplingParams(acceptance=7))], f"{e1}.sampling.acceptance"),
        ([entry(41, 0, [1, 2], sampling=common_pb2.SamplingParams(typical_epsilon=-1))], "typical_epsilon"),
        ([], "empty batch"),
        ([entry(41, 0, [1, 2, 3, 4, 5, 6], k=MAX_K + 1)], "max_draft_tokens"),
        ([entry(41, 0, [1, 2, 3], k=3)], f"{e1}.num_draft_tokens"),
        ([entry(41, 0, [1, 2, 3], emit=False, k=1)], f"{e1}.num_draft_tokens"),
        ([entry(41, 0, [])], f"{e1}.tokens"),
        ([entry(41, 0, [VOCAB])], "token id"),
        ([entry(41, 0, [1]), entry(41, 0, [2])], "twice"),
        ([entry(41, 250, [1] * 7, emit=False)], "max_model_len"),
        ([entry(41, 250, [1] * 6)], "no room"),  # the emitted token would be position 256
        ([entry(41, 0, [1, 2], logprobs=21)], f"{e1}.logprobs"),
        ([target_pb2.StepEntry(seq_id=41, tokens=[1, 2], emit=True, prompt_logprobs=21)], f"{e1}.prompt_logprobs"),
        ([target_pb2.StepEntry(seq_id=41, tokens=[1, 2], emit=False, prompt_logprobs=1)],
         f"{e1}.next_prompt_token"),
        ([target_pb2.StepEntry(seq_id=41, tokens=[1, 2], emit=False, next_prompt_token=3)],
         "only with prompt_logprobs"),
        ([target_pb2.StepEntry(seq_id=41, tokens=[1, 2], emit=True, prompt_logprobs=1, next_prompt_token=3)],
         f"{e1}.next_prompt_token"),
        ([target_pb2.StepEntry(seq_id=41, tokens=[1, 2], emit=False, prompt_logprobs=1, next_prompt_token=VOCAB)],
         f"{e1}.next_prompt_token"),
        ([target_pb2.StepEntry(seq_id=41, tokens=[1, 2, 3], emit=True, num_draft_tokens=2, prompt_logprobs=1)],
         f"{e1}.prompt_logprobs"),
        ([entry(41, 0, [1, 2, 3], k=2, sampling=_sampled(1))], f"{e1}.draft_probs"),
        ([entry(41, 0, [1, 2, 3], k=2, sampling=_sampled(1), draft_probs=_dists([2]))], f"{e1}.draft_probs"),
        ([one_draft([2, 3], [1.0])], f"{e1}.draft_probs[0]"),
        ([one_draft([2, VOCAB], [.5, .5])], f"{e1}.draft_probs[0].token_ids"),
        ([one_draft([2, 2], [.5, .5])], "distinct"),
        ([one_draft([2, 3], [1.2, -.2])], f"{e1}.draft_probs[0].probs"),
        ([one_draft([2, 3], [float("nan"), .5])], f"{e1}.draft_probs[0].probs"),
        ([one_draft([2, 3], [.7, .7])], "exceeds 1"),
        ([one_draft([3, 4], [.5, .5])], "draft token 2"),
        ([one_draft([2, 4], [0.0, .5])], "draft token 2"),
    ]
    for bad, needle in cases:
        err = _code(stub, target_pb2.StepRequest(entries=[trims, *bad] if bad else []))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (needle, err.details())
        assert needle in err.details(), (needle, err.details())

    # cache misses: unknown sequence, and a known one asked to resume past what it holds
    for bad, missing in [(entry(42, 3, [1]), "42"), (entry(40, 13, [1]), "40")]:
        err = _code(stub, target_pb2.StepRequest(entries=[bad]))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
        assert dict(err.trailing_metadata())[CACHE_MISS_METADATA] == missing

    [r] = step(stub, entry(40, 12, prompt[12:]))  # still holds exactly the 12 tokens
    assert (list(r.tokens), r.cached_len) == ([ref[0]], 16)
    [r] = step(stub, entry(40, 16, [ref[0]]))
    assert list(r.tokens) == [ref[1]]


def test_kv_exhaustion_then_recovery(model_dir):
    server, channel, _ = _serve(model_dir, num_blocks=4)  # 16 token slots
    try:
        small = target_pb2_grpc.TargetServiceStub(channel)
        prompt = tokens(11, 12)
        ref = hf_greedy(model_dir, prompt, 2)
        err = _code(small, target_pb2.StepRequest(entries=[entry(1, 0, tokens(12, 17))]))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
        [r] = step(small, entry(1, 0, prompt))
        assert list(r.tokens) == [ref[0]]
        # the lookahead slots count: 12 cached + 1 + 4 drafts need 5 blocks
        err = _code(small, target_pb2.StepRequest(entries=[entry(1, 12, [ref[0], 1, 2, 3, 4], k=4)]))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        [r] = step(small, entry(1, 12, [ref[0], ref[1], 1], k=2))
        assert r.tokens[0] == ref[1] and r.num_accepted >= 1 and r.cached_len == 13 + r.num_accepted
    finally:
        channel.close()
        server.stop()


def test_release_frees_blocks_and_is_idempotent(stub):
    info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=5)
    assert (info.protocol, info.model_id, info.vocab_size, info.max_draft_tokens) == ("tandem.v1", "tiny-target",
                                                                                      VOCAB, MAX_K)
    assert info.free_blocks == info.num_blocks
    step(stub, entry(50, 0, tokens(13, 9)), entry(51, 0, tokens(14, 20), emit=False))
    busy = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=5)
    assert (busy.free_blocks, busy.num_sequences) == (info.num_blocks - 3 - 5, 2)
    for _ in range(2):
        freed = stub.Release(common_pb2.ReleaseRequest(seq_ids=[50, 51, 777]), timeout=5)
        assert freed.free_blocks == info.num_blocks
    assert stub.GetInfo(common_pb2.GetInfoRequest(), timeout=5).num_sequences == 0


def test_health_serving(service):
    _, channel, _ = service
    check = health_pb2_grpc.HealthStub(channel).Check
    for name in ("", SERVICE_NAME):
        assert check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING


class _Aborted(Exception):
    pass


class _ExpiredContext:
    code: grpc.StatusCode | None = None

    def time_remaining(self) -> float:
        return 0.0

    def invocation_metadata(self) -> tuple:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self.code = code
        raise _Aborted(details)


def test_expired_deadline_is_refused_without_touching_the_cache(service):
    _, _, servicer = service
    request = target_pb2.StepRequest(entries=[entry(60, 0, [1, 2, 3])])
    ctx = _ExpiredContext()
    with pytest.raises(_Aborted):
        asyncio.run(servicer.Step(request, ctx))
    assert ctx.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(DeadlineExpired):  # expired while waiting for the model thread
        servicer.step(request, deadline=time.monotonic() - 0.1)
    assert not servicer.runner.blocks.has(60)
