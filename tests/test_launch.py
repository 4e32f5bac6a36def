"""`tandem serve PAIR`, what `make run` runs: three real processes, ready when it says so, named
after the pair, warning about a pair installed below its gates, stopped cleanly by SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from router.launch import free_port


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
    ports = [str(free_port()) for _ in range(3)]
    err = (tmp_path / "stderr").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "router.launch", str(pair), "--port", str(port),
                             "--grpc-port", ports[0], "--target-port", ports[1], "--draft-port", ports[2]],
                            stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    try:
        out = ""
        deadline = time.monotonic() + 120
        while "Ctrl-C stops all three" not in out and time.monotonic() < deadline and proc.poll() is None:
            out += proc.stdout.readline()  # type: ignore[union-attr]
        assert "Tandem is ready" in out, Path(err.name).read_text()[-2000:]
        base = f"http://127.0.0.1:{port}"
        assert [m["id"] for m in _get(f"{base}/v1/models")["data"]] == [pair.name], "named after the pair directory"
        assert f'"model": "{pair.name}"' in out, "the printed examples work as printed"
        done = _post(f"{base}/v1/completions", {"model": pair.name, "prompt": "hello", "max_tokens": 8,
                                                "temperature": 0})
        assert done["usage"]["completion_tokens"] == 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        stderr = Path(err.name).read_text()
        assert "installed below its quality gates (chat acceptance at k=4 0.092" in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
        report.unlink()
