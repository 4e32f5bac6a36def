"""`tandem serve PAIR`, what `make run` runs: three real processes, ready when it says so, named
after the pair, warning about a pair installed below its gates, stopped cleanly by SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from router.stack import Stack, _http_ok, free_port, free_ports, stack_ports


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:  # noqa: S310 - loopback
        return json.loads(r.read())


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:  # noqa: S310 - loopback
        return json.loads(r.read())


def test_serve_a_pair_directory_end_to_end(model_pair, tmp_path):
    target_dir, _ = model_pair
    pair = target_dir.parent
    report = pair / "report.json"
    report.write_text(json.dumps({"partial": True, "gates": [
        {"name": "acceptance_k4_chat", "ok": False, "text": "chat acceptance at k=4 0.092, need >= 0.55"}]}))
    port = free_port()
    ports = [str(x) for x in free_ports(3)]
    err = (tmp_path / "stderr").open("w")
    from tests.test_lora import write_adapter

    adapter = write_adapter(target_dir, tmp_path / "sql", seed=0)
    proc = subprocess.Popen([sys.executable, "-m", "router.launch", str(pair), "--port", str(port),
                             "--grpc-port", ports[0], "--target-port", ports[1], "--draft-port", ports[2],
                             "--tool-call-parser", "hermes", "--lora-modules", f"sql={adapter}",
                             "--enable-runtime-lora"],
                            stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    try:
        out = ""
        deadline = time.monotonic() + 120
        while "Ctrl-C stops all three" not in out and time.monotonic() < deadline and proc.poll() is None:
            out += proc.stdout.readline()  # type: ignore[union-attr]
        assert "Tandem is ready" in out, Path(err.name).read_text()[-2000:]
        base = f"http://127.0.0.1:{port}"
        assert [m["id"] for m in _get(f"{base}/v1/models")["data"]] == [pair.name, "sql"], \
            "named after the pair directory; the adapter --lora-modules gave the target"
        assert f'"model": "{pair.name}"' in out, "the printed examples work as printed"
        with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:  # noqa: S310 - loopback
            up = [line for line in r.read().decode().splitlines() if line.startswith("tandem:replica_up")]
        assert any('service="draft"' in line and line.endswith(" 1.0") for line in up), \
            f"the draft serves when the stack says it is ready: {up}"
        done = _post(f"{base}/v1/completions", {"model": pair.name, "prompt": "hello", "max_tokens": 8,
                                                "temperature": 0})
        assert done["usage"]["completion_tokens"] == 8
        answer = _post(f"{base}/v1/responses", {"model": pair.name, "input": "hello", "max_output_tokens": 4})
        assert answer["usage"]["output_tokens"] == 4, "the printed Responses example"
        message = _post(f"{base}/v1/messages", {"model": pair.name, "max_tokens": 4, "messages": [
            {"role": "user", "content": "hello"}]})
        assert message["type"] == "message" and message["usage"]["output_tokens"] <= 4, "the printed Messages example"
        tools = [{"type": "function", "function": {"name": "f"}}]
        auto = _post(f"{base}/v1/chat/completions", {"model": pair.name, "max_tokens": 4, "tools": tools,
                                                     "temperature": 0, "ignore_eos": True,
                                                     "messages": [{"role": "user", "content": "hi"}]})
        assert auto["choices"][0]["finish_reason"] == "length", "--tool-call-parser reached the router: auto is served"
        req = urllib.request.Request(f"{base}/v1/load_lora_adapter", data=json.dumps(
            {"lora_name": "poet", "lora_path": str(write_adapter(target_dir, tmp_path / "poet", seed=1))}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:  # noqa: S310 - loopback
            assert r.read().decode() == "Success: LoRA adapter 'poet' added successfully.", \
                "--enable-runtime-lora reached the target"
        assert [m["id"] for m in _get(f"{base}/v1/models")["data"]] == [pair.name, "poet", "sql"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        stderr = Path(err.name).read_text()
        assert "installed below its quality gates (chat acceptance at k=4 0.092" in stderr
        assert "unavailable" not in stderr, "the router started after the draft served: no refused connection"
    finally:
        if proc.poll() is None:  # a failed assertion: the launcher's three children go with it
            os.killpg(proc.pid, signal.SIGKILL)
        report.unlink()


def test_a_draft_that_does_not_start_leaves_the_stack_serving_without_it(model_pair, tmp_path, capfd):
    target_dir, _ = model_pair
    stack = Stack(target_dir, tmp_path / "no-such-draft", served_model_name="pair", log_dir=tmp_path, **stack_ports())
    try:
        stack.start(timeout=120)
        assert stack.procs["draft"].poll() not in (None, 0), "the draft exited: its model directory is missing"
        assert "draft exited with code" in capfd.readouterr().err
        done = _post(f"{stack.url}/v1/completions", {"model": "pair", "prompt": "hello", "max_tokens": 8,
                                                     "temperature": 0})
        assert done["usage"]["completion_tokens"] == 8, "served at k = 0 without its draft"
    finally:
        stack.stop()


def test_ports_asked_together_are_distinct_and_free():
    import socket

    for _ in range(50):
        ports = free_ports(4)
        assert len(set(ports)) == 4
    assert set(stack_ports()) == {"http_port", "grpc_port", "target_port", "draft_port"}
    for port in free_ports(4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # nobody holds it


def test_readiness_probe_says_not_ready_when_something_else_answers_on_the_port():
    """A gRPC (HTTP/2) server on the router's port answers /ready with bytes that are not HTTP/1:
    not ready, not a crash of whoever is waiting."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def answer() -> None:
        conn, _ = srv.accept()
        conn.recv(1024)
        conn.sendall(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00\x00\x03\x7f\xff\xff\xff")  # an HTTP/2 SETTINGS frame
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    try:
        assert _http_ok(f"http://127.0.0.1:{srv.getsockname()[1]}/ready", timeout=5) is False
    finally:
        srv.close()
