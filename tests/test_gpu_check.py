"""scripts/gpu_check.py (make gpu-check): without CUDA it claims nothing and exits 0; its steps and
report work (checked here with stand-in commands, since the real steps need a GPU)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: make gpu-check runs for real")
def test_without_cuda_it_says_so_and_exits_0(tmp_path):
    out = tmp_path / "report.md"
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "no CUDA device" in proc.stdout and "nothing is claimed" in proc.stdout
    assert not out.exists()


def test_steps_are_bounded_and_reported(tmp_path):
    ok = gpu_check.run("ok", [sys.executable, "-c", "print('3 passed, 1 skipped in 0.1s')"], 30)
    bad = gpu_check.run("bad", [sys.executable, "-c", "import sys; print('1 failed'); sys.exit(1)"], 30)
    slow = gpu_check.run("slow", [sys.executable, "-c", "import time; time.sleep(60)"], 21)
    late = gpu_check.run("late", ["true"], 5)
    assert (ok.status, ok.summary) == ("passed", "3 passed, 1 skipped in 0.1s")
    assert (bad.status, bad.summary) == ("FAILED", "1 failed")
    assert slow.status == "FAILED" and "timed out" in slow.tail and slow.seconds < 40
    assert late.status == "not run"
    path = tmp_path / "r.md"
    gpu_check.report(path, {"commit": "abc123", "GPUs": "none"}, [ok, bad, slow, late], time.monotonic())
    text = path.read_text()
    assert "- commit: abc123" in text and "| bad | FAILED |" in text and "| late | not run |" in text
