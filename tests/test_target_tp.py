"""`python -m target_service --tensor-parallel-size 2` as a real process on CPU (gloo): the same Step
results as a 1-rank service over real gRPC (greedy: prefill chunks, decodes and verification mixed,
rollback after rejected drafts), then a clean stop on SIGTERM, and no orphan when rank 0 is killed."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from transformers import LlamaConfig

from tandem.v1 import target_pb2, target_pb2_grpc
from tests.conftest import SMALL, hf_greedy, write_checkpoint
from tests.test_target_main import ROOT, free_port, wait_serving

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds child processes through /proc")


def start(model_dir: Path, tp: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "target_service", "--model", str(model_dir), "--port", str(port),
         "--num-blocks", "64", "--block-size", "4", "--device", "cpu", "--threads", "1",
         "--tensor-parallel-size", str(tp), "--max-draft-tokens", "4"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    return proc, port


def children(pid: int) -> list[int]:
    """The tensor-parallel followers of `pid` (not multiprocessing's resource tracker)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cmdline = (stat.parent / "cmdline").read_bytes() if int(fields[1]) == pid else b""
        if fields[0] != "Z" and b"spawn_main" in cmdline:
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def entry(seq_id: int, start_pos: int, toks: list[int], emit: bool = True, k: int = 0) -> target_pb2.StepEntry:
    return target_pb2.StepEntry(seq_id=seq_id, start_pos=start_pos, tokens=toks, emit=emit, num_draft_tokens=k,
                                logprobs=2 if emit else -1)


def drive(stub: target_pb2_grpc.TargetServiceStub, model_dir: Path) -> list[tuple]:
    """A fixed script of steps; each step's next inputs depend on what the service emitted."""
    vocab = SMALL["vocab_size"]
    prompts = {s: torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(s)).tolist()
               for s, n in ((1, 23), (2, 9), (3, 14))}
    hist = {s: list(p) for s, p in prompts.items()}
    truth = prompts[3] + hf_greedy(model_dir, prompts[3], 40)  # seq 3's right drafts
    seen = []

    def step(*entries):
        res = stub.Step(target_pb2.StepRequest(entries=entries), timeout=30).results
        seen.extend((r.seq_id, list(r.tokens), r.num_accepted, r.cached_len,
                     [round(lp.logprob, 4) for lp in r.logprobs]) for r in res)
        return {r.seq_id: list(r.tokens) for r in res}

    out = step(entry(1, 0, hist[1][:10], emit=False), entry(2, 0, hist[2]), entry(3, 0, hist[3]))
    hist[2] += out[2]
    hist[3] += out[3]
    for i in range(6):
        # seq 2 decodes; seq 3 verifies 3 drafts (right ones every other step, else wrong); seq 1 prefills
        n = len(hist[3])
        drafts = truth[n:n + 3] if i % 2 == 0 else [(truth[n] + 1 + j) % vocab for j in range(3)]
        entries = [entry(2, len(hist[2]) - 1, hist[2][-1:]), entry(3, len(hist[3]) - 1, hist[3][-1:] + drafts, k=3)]
        if i == 0:
            entries.append(entry(1, 10, hist[1][10:]))
        else:
            entries.append(entry(1, len(hist[1]) - 1, hist[1][-1:]))
        out = step(*entries)
        for s, toks in out.items():
            hist[s] += toks
    return seen


def test_two_ranks_serve_what_one_rank_serves_and_stop_cleanly(tmp_path):
    model_dir = write_checkpoint(LlamaConfig(**SMALL), tmp_path / "tiny-target", seed=7)
    results = {}
    for tp in (1, 2):
        proc, port = start(model_dir, tp)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                wait_serving(channel, proc, timeout=90)
                followers = children(proc.pid)
                results[tp] = drive(target_pb2_grpc.TargetServiceStub(channel), model_dir)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
            assert proc.returncode == 0, err
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        if tp == 2:
            assert len(followers) == 1 and "tensor parallel over 2 ranks" in err, err
            assert "rank 1 stopping after" in err, err
            assert not any(alive(p) for p in followers)
    assert results[2] == results[1]
    assert {n for _, _, n, _, _ in results[1]} >= {0, 3}, "drafts both accepted and rejected"


def test_no_orphan_when_rank_0_is_killed(tmp_path):
    model_dir = write_checkpoint(LlamaConfig(**SMALL), tmp_path / "tiny-target", seed=7)
    proc, port = start(model_dir, 2)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            wait_serving(channel, proc, timeout=90)
        followers = children(proc.pid)
        assert len(followers) == 1
        proc.kill()
        proc.communicate(timeout=10)
        deadline = time.monotonic() + 10
        while any(alive(p) for p in followers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in followers)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
