"""`python -m target_service` as a real process: comes up SERVING, answers, and exits 0 on SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import LlamaConfig

from tandem.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.server import SERVICE_NAME
from tests.conftest import SMALL, write_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(channel: grpc.Channel, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    check = health_pb2_grpc.HealthStub(channel).Check
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, f"server exited early: {proc.communicate()[1]}"
        try:
            if check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=1).status == \
                    health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    raise AssertionError("server never reported SERVING")


def test_cli_serves_and_stops_on_sigterm(tmp_path):
    model_dir = write_checkpoint(LlamaConfig(**SMALL), tmp_path / "tiny-target")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "target_service", "--model", str(model_dir), "--port", str(port),
         "--num-blocks", "32", "--block-size", "4", "--device", "cpu", "--threads", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            wait_serving(channel, proc)
            stub = target_pb2_grpc.TargetServiceStub(channel)
            info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=5)
            assert (info.model_id, info.num_blocks, info.block_size, info.device) == ("tiny-target", 32, 4, "cpu")
            first = target_pb2.StepEntry(seq_id=1, tokens=[1, 2, 3], emit=True, logprobs=-1)
            step = stub.Step(target_pb2.StepRequest(entries=[first]), timeout=10)
            assert step.results[0].cached_len == 3 and len(step.results[0].tokens) == 1
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
        assert proc.returncode == 0, err
        assert time.monotonic() - t0 < 10
        assert "KV cache: 32 blocks x 4 tokens" in err and "serving tandem.v1.TargetService" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
