"""DraftService over real gRPC on loopback, against transformers' greedy continuation of the
same tiny random-init checkpoint."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenizers import Tokenizer, models
from transformers import LlamaConfig

from draft_service import SERVICE_NAME, create_servicer, register
from engine import EngineConfig, ModelRunner
from engine.sampling import SamplingSpec, filtered_probs, sample, truncate_top, uniforms
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from tests.conftest import SMALL, hf_greedy, hf_logits, write_checkpoint
from tests.servers import start_server

VOCAB = SMALL["vocab_size"]
MAX_K = 8
TOP_N = 16
REPO = Path(__file__).resolve().parents[1]


def toks(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_checkpoint(directory: Path, seed: int) -> Path:
    write_checkpoint(LlamaConfig(**SMALL), directory, seed=seed)
    vocab = {f"t{i}": i for i in range(VOCAB)}  # a shared tokenizer gives equal fingerprints
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(directory / "tokenizer.json"))
    return directory


def serve_runner(runner: ModelRunner, **kwargs) -> SimpleNamespace:
    servicer = create_servicer(runner, **kwargs)
    server = start_server(lambda s: register(s, servicer), SERVICE_NAME)
    channel = grpc.insecure_channel(server.address)
    return SimpleNamespace(runner=runner, server=server, channel=channel, stub=draft_pb2_grpc.DraftServiceStub(channel))


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("draft"), seed=3)


@pytest.fixture(scope="module")
def svc(draft_dir):
    runner = ModelRunner.load(draft_dir, EngineConfig(num_blocks=1024, block_size=4, device="cpu"))
    s = serve_runner(runner, max_draft_tokens=MAX_K, sparse_top_n=TOP_N, sparse_q_mass=1.0)
    yield s
    s.channel.close()
    s.server.stop()


def entry(seq_id: int, start_pos: int, tokens: list[int], k: int, temperature: float = 0.0,
          seed: int | None = None, top_k: int = 0, top_p: float = 0.0, num_verifying: int = 0,
          branches: tuple[tuple[int, int], ...] = ()) -> draft_pb2.ProposeEntry:
    sp = common_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p or 1.0, seed=seed)
    return draft_pb2.ProposeEntry(seq_id=seq_id, start_pos=start_pos, tokens=tokens, k=k, sampling=sp,
                                  num_verifying=num_verifying,
                                  branches=[draft_pb2.Branch(accepted=j, rank=r) for j, r in branches])


def propose(stub, *entries: draft_pb2.ProposeEntry) -> list[draft_pb2.Proposal]:
    return list(stub.Propose(draft_pb2.ProposeRequest(entries=entries), timeout=30).proposals)


def sync(stub, *chunks: tuple[int, int, list[int]]) -> draft_pb2.SyncResponse:
    return stub.Sync(draft_pb2.SyncRequest(chunks=[draft_pb2.Chunk(seq_id=s, start_pos=p, tokens=t)
                                                   for s, p, t in chunks]), timeout=30)


def test_greedy_proposals_equal_hf_greedy_continuation(svc, draft_dir):
    p1, p2, p3, p4 = toks(1, 23), toks(2, 17), toks(3, 30), toks(4, 9)
    # prompts arrive in chunks across calls, several sequences per call; the draft never saw the last token
    assert list(sync(svc.stub, (101, 0, p1[:8]), (102, 0, p2[:10])).cached_len) == [8, 10]
    assert list(sync(svc.stub, (101, 8, p1[8:22]), (102, 10, p2[10:16]), (103, 0, p3)).cached_len) == [22, 16, 30]
    calls = svc.runner.forward_calls
    got = propose(svc.stub,
                  entry(101, 22, p1[22:], k=5),
                  entry(102, 16, p2[16:], k=3),
                  entry(103, 27, p3[27:], k=4),  # trims 3 cached tokens and recomputes them
                  entry(104, 0, p4, k=0))  # k = 0: only caches
    assert svc.runner.forward_calls - calls == 5  # max(k), not the sum
    for prompt, k, prop in [(p1, 5, got[0]), (p2, 3, got[1]), (p3, 4, got[2])]:
        assert list(prop.tokens) == hf_greedy(draft_dir, prompt, k)
        assert len(prop.probs) == 0  # greedy ships ids only
        assert prop.cached_len == len(prompt) + k - 1
    assert (list(got[3].tokens), got[3].cached_len) == ([], len(p4))
    # the k = 0 entry is really cached: the next proposal starts from it
    [nxt] = propose(svc.stub, entry(104, len(p4), [7], k=3))
    assert list(nxt.tokens) == hf_greedy(draft_dir, p4 + [7], 3)


def test_a_rejection_trims_the_stale_drafts(svc, draft_dir):
    prompt = toks(5, 20)
    sync(svc.stub, (201, 0, prompt[:-1]))
    [first] = propose(svc.stub, entry(201, 19, prompt[-1:], k=5))
    d = list(first.tokens)
    assert d == hf_greedy(draft_dir, prompt, 5) and first.cached_len == 24
    # target accepts d1, d2 and corrects d3: the draft's d3.. must go, c follows d2
    c = (d[2] + 1) % VOCAB
    hist = prompt + d[:2] + [c]
    [part] = propose(svc.stub, entry(201, len(prompt) + 2, [c], k=4))
    assert list(part.tokens) == hf_greedy(draft_dir, hist, 4) and part.cached_len == len(hist) + 3
    svc.stub.Release(common_pb2.ReleaseRequest(seq_ids=[201]), timeout=10)


def test_branches_over_grpc_match_transformers(svc, draft_dir):
    """The verification of d1 d2 is in flight; branches for 'd1 rejected' and 'both accepted' come back
    as transformers' greedy continuations of those histories, and leave only the inputs cached."""
    prompt, d = toks(6, 15), toks(7, 2)
    sync(svc.stub, (202, 0, prompt[:-1]))
    [prop] = propose(svc.stub, entry(202, 14, prompt[-1:] + d, k=3, num_verifying=2, branches=((0, 1), (2, 1))))
    assert prop.cached_len == len(prompt) + 2 and not prop.tokens
    for b, accepted in zip(prop.branches, (0, 2), strict=True):
        base = prompt + d[:accepted]
        assert b.accepted == accepted
        assert list(b.drafts) == hf_greedy(draft_dir, base + [b.token], 3)
        first = torch.softmax(hf_logits(draft_dir, base + [b.token])[-1], -1).max().item()
        assert len(b.confidence) == 3 and b.confidence[0] == pytest.approx(first, rel=1e-3), "the draft's p(draft)"
    assert prop.branches[1].token == hf_greedy(draft_dir, prompt + d, 1)[0]
    assert prop.branches[0].token != d[0]
    svc.stub.Release(common_pb2.ReleaseRequest(seq_ids=[202]), timeout=10)


def _reference_draw(draft_dir, history: list[int], spec: SamplingSpec) -> tuple[dict[int, float], int]:
    """transformers' q after the history, and the token the seeded draw for position len(history) picks."""
    logits = hf_logits(draft_dir, history)[-1:]
    ids, q = truncate_top(filtered_probs(logits, [spec]), TOP_N)
    pick = sample(q, uniforms([(spec.seed, len(history), 0)], q.device))
    return {i: p for i, p in zip(ids[0].tolist(), q[0].tolist(), strict=True) if p > 0}, int(ids[0, pick])


SAMPLED = [  # (seq_id, temperature, top_k, top_p, seed)
    (301, 0.7, 0, 0.0, 11), (302, 1.0, 0, 0.0, 12), (303, 1.3, 20, 0.0, 13), (304, 1.0, 0, 0.9, 14),
    (305, 1.0, 5, 0.8, 15),
]


def test_sampled_tokens_follow_their_shipped_sparse_q(svc, draft_dir):
    prompts = {s: toks(s, 12) for s, *_ in SAMPLED}
    k = 4
    batch = [entry(s, 0, prompts[s], k, temperature=t, top_k=tk, top_p=tp, seed=seed) for s, t, tk, tp, seed in SAMPLED]
    got = propose(svc.stub, *batch, entry(306, 0, toks(306, 12), k))  # one greedy neighbour
    assert len(got[-1].probs) == 0
    for (s, t, tk, tp, seed), prop in zip(SAMPLED, got, strict=False):
        assert len(prop.tokens) == len(prop.probs) == k
        hist = prompts[s]
        for tok, dist in zip(prop.tokens, prop.probs, strict=True):
            ids, probs = list(dist.token_ids), list(dist.probs)
            assert tok in ids and len(set(ids)) == len(ids) <= TOP_N
            assert all(0.0 < p <= 1.0 for p in probs) and sum(probs) <= 1 + 1e-5
            # q shipped is the target's filtered distribution at this position, truncated to TOP_N
            ref, ref_tok = _reference_draw(draft_dir, hist, SamplingSpec(temperature=t, top_k=tk, top_p=tp or 1.0,
                                                                         seed=seed))
            assert tok == ref_tok  # drawn with draw_uniform(seed, absolute position, stream 0)
            assert sorted(ids) == sorted(ref)
            for i, p in zip(ids, probs, strict=True):
                assert abs(p - ref[i]) < 1e-4
            hist = hist + [tok]
        if tk:
            assert all(len(dist.token_ids) <= tk for dist in prop.probs)

    # seeded proposals reproduce whatever shares the batch (here: reversed, plus unseeded neighbours)
    again = propose(svc.stub, entry(307, 0, toks(307, 5), 3, temperature=1.0), *reversed(batch),
                    entry(308, 0, toks(308, 9), 2, temperature=1.0))
    for prop, rep in zip(got, reversed(again[1:-1]), strict=False):
        assert list(rep.tokens) == list(prop.tokens)
        assert [list(q.token_ids) for q in rep.probs] == [list(q.token_ids) for q in prop.probs]
        for q_rep, q_got in zip(rep.probs, prop.probs, strict=True):  # equal up to batch-shape float rounding
            torch.testing.assert_close(torch.tensor(q_rep.probs), torch.tensor(q_got.probs), atol=1e-6, rtol=0)
    # ... and the seed matters
    reseeded = propose(svc.stub, *[entry(s, 0, prompts[s], k, temperature=t, top_k=tk, top_p=tp, seed=seed + 100)
                                   for s, t, tk, tp, seed in SAMPLED])
    assert [list(p.tokens) for p in reseeded] != [list(p.tokens) for p in got[:-1]]
    svc.stub.Release(common_pb2.ReleaseRequest(seq_ids=list(range(301, 309))), timeout=10)


def test_32_sequences_with_4_branches_of_k4_take_5_forwards(svc, draft_dir):
    prompts = {400 + i: toks(400 + i, 5 + i % 13) for i in range(32)}
    sync(svc.stub, *[(s, 0, p[:-3]) for s, p in prompts.items()])
    calls = svc.runner.forward_calls
    got = propose(svc.stub, *[entry(s, len(p) - 3, p[-3:], k=4, num_verifying=2,
                                    branches=((0, 1), (1, 1), (2, 1), (2, 2))) for s, p in prompts.items()])
    assert svc.runner.forward_calls - calls == 5  # not 32 * 4 * 4
    for (s, p), prop in zip(prompts.items(), got, strict=True):
        assert prop.seq_id == s
        top = prop.branches[2]  # both drafts accepted, the draft's favourite next: its own greedy run
        assert [top.token, *top.drafts] == hf_greedy(draft_dir, p, 5)
        assert prop.cached_len == len(p)
    svc.stub.Release(common_pb2.ReleaseRequest(seq_ids=list(prompts)), timeout=10)


def test_info_release_and_health(svc, draft_dir):
    stub = svc.stub
    info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    assert (info.protocol, info.vocab_size, info.block_size, info.num_blocks, info.max_draft_tokens) == (
        "tandem.v1", VOCAB, 4, 1024, MAX_K)
    assert info.model_id == draft_dir.name and info.max_model_len == 256
    sync(stub, (801, 0, toks(801, 30)), (802, 0, toks(802, 3)))
    held = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    assert held.free_blocks == info.free_blocks - 8 - 1
    assert held.num_sequences == info.num_sequences + 2
    for _ in range(2):  # idempotent, unknown ids ignored
        freed = stub.Release(common_pb2.ReleaseRequest(seq_ids=[801, 802, 999_999]), timeout=10)
        assert freed.free_blocks == info.free_blocks
    assert stub.GetInfo(common_pb2.GetInfoRequest()).num_sequences == info.num_sequences
    svc.runner.blocks.check_invariants()
    health = health_pb2_grpc.HealthStub(svc.channel)
    for name in ("", SERVICE_NAME):
        resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serves_until_sigterm(draft_dir):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "draft_service", "--model", str(draft_dir), "--port", str(port),
                             "--num-blocks", "64", "--block-size", "4", "--threads", "1", "--log-level", "WARNING"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, proc.stdout.read().decode()
                try:
                    if health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=1).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, "draft service never became SERVING"
                time.sleep(0.2)
            [prop] = propose(draft_pb2_grpc.DraftServiceStub(channel), entry(1, 0, [5, 6, 7], 3))
            assert list(prop.tokens) == hf_greedy(draft_dir, [5, 6, 7], 3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, proc.stdout.read().decode()
        assert time.monotonic() - t0 < 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
