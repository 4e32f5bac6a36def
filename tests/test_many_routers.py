"""Two routers over two target + draft pairs, every part its own process: the routers split the pairs
through the services' leases, both serve at once, and when one is killed the other takes its pair
within the lease time plus one renewal; the services free what the dead router held."""

from __future__ import annotations

import concurrent.futures as cf
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from router.stack import free_port
from tandem.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc
from tests.conftest import hf_greedy
from tests.stack import wait_until
from tests.test_router_integration import prompts

REPO = Path(__file__).resolve().parents[1]
TTL = 3.0


class Procs:
    def __init__(self, logs: Path) -> None:
        self.logs, self.procs = logs, {}

    def spawn(self, name: str, *args: str) -> None:
        out = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        self.procs[name] = subprocess.Popen([sys.executable, "-m", *args], stdout=out, stderr=subprocess.STDOUT,
                                            cwd=REPO)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def ready(url: str) -> dict | None:
    try:
        r = httpx.get(f"{url}/ready", timeout=2)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


def held(url: str) -> int:
    answer = ready(url)
    return len(answer["replicas"]) if answer else 0


def complete(url: str, prompt: list[int], n: int) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "target", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def stream_until_cut(url: str, prompt: list[int], n: int, started: threading.Event) -> str:
    """Stream a completion; 'whole' if it ends normally, 'cut' if the router goes away mid-stream
    (its clients see the connection close: a clean error, and they may retry on another router)."""
    body = {"model": "target", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                if line == "data: [DONE]":
                    return "whole"
    except httpx.HTTPError:
        return "cut"
    return "cut"  # the stream ended without [DONE]


def free_blocks(address: str, stub_class) -> tuple[int, int]:  # noqa: ANN001
    with grpc.insecure_channel(address) as channel:
        info = stub_class(channel).GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    return info.free_blocks, info.num_blocks


@pytest.fixture()
def pairs(model_pair, tmp_path):
    target_dir, draft_dir = model_pair
    procs = Procs(tmp_path)
    ports = {n: free_port() for n in ("t0", "t1", "d0", "d1")}
    for name, port in ports.items():
        module, model = ("target_service", target_dir) if name[0] == "t" else ("draft_service", draft_dir)
        procs.spawn(name, module, "--model", str(model), "--port", str(port), "--threads", "1", "--num-blocks", "256")
    addresses = {n: f"127.0.0.1:{p}" for n, p in ports.items()}
    routers = {}
    for name in ("a", "b"):
        http = free_port()
        procs.spawn(name, "router", "--target", f"{addresses['t0']},{addresses['t1']}", "--draft",
                    f"{addresses['d0']},{addresses['d1']}", "--tokenizer", str(target_dir), "--port", str(http),
                    "--grpc-port", str(free_port()), "--lease-ttl", str(TTL), "--max-num-batched-tokens", "64",
                    "--max-num-seqs", "16", "--target-grace", "30")
        routers[name] = f"http://127.0.0.1:{http}"
    try:
        yield procs, routers, addresses, target_dir
    finally:
        procs.stop()


def test_two_routers_share_two_pairs_and_the_survivor_takes_over(pairs):
    procs, routers, addresses, target_dir = pairs
    assert wait_until(lambda: held(routers["a"]) == 1 and held(routers["b"]) == 1, 90), \
        f"the routers did not split the pairs: a holds {held(routers['a'])}, b holds {held(routers['b'])}"
    mine = {name: ready(url)["replicas"][0]["target"] for name, url in routers.items()}
    assert mine["a"] != mine["b"]

    ps = prompts(8)
    with cf.ThreadPoolExecutor(8) as pool:  # both serve at once, exactly
        outs = list(pool.map(lambda ip: complete(routers["ab"[ip[0] % 2]], ip[1], 24), enumerate(ps)))
    for p, out in zip(ps, outs, strict=True):
        assert out == hf_greedy(target_dir, p, 24)

    started = threading.Event()
    with cf.ThreadPoolExecutor(4) as pool:  # a is killed with requests of its own in flight
        doomed = [pool.submit(stream_until_cut, routers["a"], p, 400, started) for p in ps[:4]]
        assert started.wait(60), "no stream started on router a"
        procs.procs["a"].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        assert wait_until(lambda: held(routers["b"]) == 2, 4 * TTL)
        taken = time.monotonic() - killed
        outcomes = [f.result(timeout=60) for f in doomed]
    assert "cut" in outcomes, "the kill interrupted nothing: the scenario did not happen"
    assert set(outcomes) <= {"cut", "whole"}
    assert taken <= TTL + TTL / 3 + 2.0, f"took {taken:.1f}s to take over (lease {TTL}s, renewal every {TTL / 3}s)"

    for p in ps[:3]:  # new requests through the survivor succeed, on either pair
        assert complete(routers["b"], p, 24) == hf_greedy(target_dir, p, 24)
    for name, stub in (("t0", target_pb2_grpc.TargetServiceStub), ("t1", target_pb2_grpc.TargetServiceStub),
                       ("d0", draft_pb2_grpc.DraftServiceStub), ("d1", draft_pb2_grpc.DraftServiceStub)):
        assert wait_until(lambda n=name, s=stub: free_blocks(addresses[n], s)[0] == free_blocks(addresses[n], s)[1],
                          20), f"{name} still holds blocks"
