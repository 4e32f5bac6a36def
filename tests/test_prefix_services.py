"""Prefix caching over real gRPC on loopback: target and draft attach cached blocks named by hash
(outputs equal transformers), answer a cache miss when a block was evicted (the router resends
from 0), and never publish a block holding a draft that is not history."""

from __future__ import annotations

import grpc
import pytest
import torch
from transformers import LlamaConfig

from common.block_hash import ROOT, chain_hashes, salt_digest, salted_root
from common.protocol import CACHE_MISS_METADATA
from draft_service import server as draft_server
from engine import EngineConfig, ModelRunner
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from target_service import server as target_server
from tests.conftest import SMALL, hf_greedy, write_checkpoint
from tests.servers import start_server

BS = 4
GREEDY = common_pb2.SamplingParams(temperature=0.0, top_p=1.0)


def toks(seed: int, n: int) -> list[int]:
    return torch.randint(0, SMALL["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(LlamaConfig(**SMALL), tmp_path_factory.mktemp("prefix-llama"), seed=5)


def _serve(module, model_dir, num_blocks: int):
    runner = ModelRunner.load(model_dir, EngineConfig(num_blocks=num_blocks, block_size=BS, device="cpu"))
    servicer = module.create_servicer(runner, max_draft_tokens=4)
    server = start_server(lambda s: module.register(s, servicer), module.SERVICE_NAME)
    channel = grpc.insecure_channel(server.address)
    return runner, server, channel


@pytest.fixture
def target(model_dir):
    runner, server, channel = _serve(target_server, model_dir, num_blocks=16)
    yield runner, target_pb2_grpc.TargetServiceStub(channel)
    channel.close()
    server.stop()


@pytest.fixture
def draft(model_dir):
    runner, server, channel = _serve(draft_server, model_dir, num_blocks=64)
    yield runner, draft_pb2_grpc.DraftServiceStub(channel)
    channel.close()
    server.stop()


def step(stub, seq_id: int, start: int, tokens: list[int], k: int = 0, prefix=()) -> target_pb2.EntryResult:
    e = target_pb2.StepEntry(seq_id=seq_id, start_pos=start, tokens=tokens, emit=True, num_draft_tokens=k,
                             sampling=GREEDY, logprobs=-1, prefix_block_hashes=prefix)
    return stub.Step(target_pb2.StepRequest(entries=[e]), timeout=30).results[0]


def missed(call) -> list[int]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    return [int(s) for k, v in err.value.trailing_metadata() for s in v.split(",") if k == CACHE_MISS_METADATA]


def test_target_continues_from_a_released_conversation_like_transformers(target, model_dir):
    runner, stub = target
    turn1 = toks(1, 21)
    reply = step(stub, 1, 0, turn1).tokens[0]
    stub.Release(common_pb2.ReleaseRequest(seq_ids=[1]), timeout=5)
    info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=5)
    assert info.prefix_caching and info.free_blocks == info.num_blocks, "cached blocks count as free"
    turn2 = turn1 + [reply] + toks(2, 6)
    hashes = chain_hashes(turn2, BS)[:5]  # the 20 prompt tokens of full blocks turn 1 published
    ref = hf_greedy(model_dir, turn2, 3)
    out = step(stub, 2, 20, turn2[20:], prefix=hashes)
    assert (list(out.tokens), out.cached_len) == (ref[:1], len(turn2))
    out = step(stub, 2, len(turn2), [ref[0], ref[1], ref[2]], k=2)  # drafts that happen to be right
    assert list(out.tokens)[:2] == ref[1:3] and out.num_accepted == 2


def test_target_publishes_accepted_drafts_never_rejected_ones(target, model_dir):
    runner, stub = target
    prompt = toks(3, 14)
    ref = hf_greedy(model_dir, prompt, 6)
    assert step(stub, 1, 0, prompt).tokens[0] == ref[0]
    wrong = [(t + 1) % SMALL["vocab_size"] for t in ref[1:5]]
    out = step(stub, 1, 14, [ref[0], *wrong], k=4)  # positions 14..18: block 3 would hold t0 and d1
    assert out.num_accepted == 0 and out.cached_len == 15
    assert runner.blocks.cached_prefix(chain_hashes(prompt + [ref[0], *wrong], BS)) == 3
    out = step(stub, 1, 15, [ref[1], *ref[2:6]], k=4)  # all right: positions 15..19 are history
    assert out.num_accepted == 4 and out.cached_len == 20
    assert runner.blocks.cached_prefix(chain_hashes(prompt + ref[:6], BS)) == 5


def test_target_evicted_prefix_is_a_cache_miss_then_a_recompute_from_0(target, model_dir):
    runner, stub = target
    first = toks(4, 24)  # 6 blocks, published
    step(stub, 1, 0, first)
    stub.Release(common_pb2.ReleaseRequest(seq_ids=[1]), timeout=5)
    step(stub, 2, 0, toks(5, 47))  # 12 of 16 blocks: 10 truly free, then 2 evictions (first's tail)
    hashes = chain_hashes(first, BS)
    assert runner.blocks.cached_prefix(hashes) == 4
    assert missed(lambda: step(stub, 3, 24, [7], prefix=hashes)) == [3]
    assert not runner.blocks.has(3)
    stub.Release(common_pb2.ReleaseRequest(seq_ids=[2]), timeout=5)
    assert list(step(stub, 3, 0, first + [7]).tokens) == hf_greedy(model_dir, first + [7], 1)


def propose(stub, seq_id: int, start: int, tokens: list[int], k: int, v: int = 0, branches=(),
            prefix: list[int] = ()) -> draft_pb2.Proposal:
    e = draft_pb2.ProposeEntry(seq_id=seq_id, start_pos=start, tokens=tokens, k=k, sampling=GREEDY, num_verifying=v,
                               branches=[draft_pb2.Branch(accepted=j, rank=r) for j, r in branches],
                               prefix_block_hashes=prefix)
    return stub.Propose(draft_pb2.ProposeRequest(entries=[e]), timeout=30).proposals[0]


def test_draft_skips_the_sync_of_a_cached_prefix(draft, model_dir):
    runner, stub = draft
    system = toks(6, 18)
    stub.Sync(draft_pb2.SyncRequest(chunks=[draft_pb2.Chunk(seq_id=1, start_pos=0, tokens=system + toks(7, 5))]),
              timeout=30)
    prompt = system + toks(8, 9)
    hashes = chain_hashes(prompt, BS)[:4]
    free = runner.blocks.num_free
    out = propose(stub, 2, 16, prompt[16:], k=3, prefix=hashes)  # while seq 1 still holds them
    assert list(out.tokens) == hf_greedy(model_dir, prompt, 3) and out.cached_len == len(prompt) + 2
    assert free - runner.blocks.num_free == 4, "4 blocks for positions 16..28 only: the prefix is shared"
    assert missed(lambda: propose(stub, 3, 16, prompt[16:], k=3, prefix=chain_hashes(toks(9, 16), BS))) == [3]


def test_draft_never_publishes_drafts_under_verification_or_branches(draft, model_dir):
    runner, stub = draft
    prompt = toks(10, 11)
    out = propose(stub, 1, 0, prompt, k=4)
    drafts = list(out.tokens)  # positions 11..14 if accepted; d1..d3 are cached now
    assert runner.blocks.cached_prefix(chain_hashes(prompt + drafts, BS)) == 2, "only positions 0..7 are final"
    # the next call: the target's token t at 11, then e1..e4 under verification (positions 12..15, a full
    # block), and a branch that forks after t and drafts x e1' e2' e3' into a full block of its own
    t = (drafts[0] + 1) % SMALL["vocab_size"]
    verifying = [3, 4, 5, 6]
    propose(stub, 1, 11, [t, *verifying], k=4, v=4, branches=((0, 1), (4, 1)))
    assert runner.blocks.cached_prefix(chain_hashes(prompt + [t, *verifying], BS)) == 3, "positions 0..11 are final"
    assert runner.blocks.num_cached == 3, "nothing else: not the drafts under verification, not the branches"


def test_salted_blocks_are_published_and_attached_under_their_salt_only(target, draft, model_dir):
    """StepEntry, Chunk and ProposeEntry carry cache_salt: blocks hash from salted_root(ROOT, salt)."""
    (_, tstub), (_, dstub) = target, draft
    salt, prompt = salt_digest("tenant-a"), toks(11, 21)
    salted, plain = chain_hashes(prompt, BS, salted_root(ROOT, salt))[:5], chain_hashes(prompt, BS)[:5]
    ref = hf_greedy(model_dir, prompt, 1)
    entry = target_pb2.StepEntry(seq_id=1, start_pos=0, tokens=prompt, emit=True, sampling=GREEDY, logprobs=-1,
                                 cache_salt=salt)
    assert list(tstub.Step(target_pb2.StepRequest(entries=[entry]), timeout=30).results[0].tokens) == ref
    tstub.Release(common_pb2.ReleaseRequest(seq_ids=[1]), timeout=5)
    assert missed(lambda: step(tstub, 2, 20, prompt[20:], prefix=plain)) == [2], "the unsalted chain finds nothing"
    entry = target_pb2.StepEntry(seq_id=3, start_pos=20, tokens=prompt[20:], emit=True, sampling=GREEDY,
                                 logprobs=-1, prefix_block_hashes=salted, cache_salt=salt)
    assert list(tstub.Step(target_pb2.StepRequest(entries=[entry]), timeout=30).results[0].tokens) == ref
    dstub.Sync(draft_pb2.SyncRequest(chunks=[draft_pb2.Chunk(seq_id=1, start_pos=0, tokens=prompt, cache_salt=salt)]),
               timeout=30)
    assert missed(lambda: propose(dstub, 2, 20, prompt[20:], k=2, prefix=plain)) == [2]
    e = draft_pb2.ProposeEntry(seq_id=3, start_pos=20, tokens=prompt[20:], k=2, sampling=GREEDY,
                               prefix_block_hashes=salted, cache_salt=salt)
    out = dstub.Propose(draft_pb2.ProposeRequest(entries=[e]), timeout=30).proposals[0]
    assert list(out.tokens) == hf_greedy(model_dir, prompt, 2)
