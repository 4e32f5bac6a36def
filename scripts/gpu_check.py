"""make gpu-check: everything in Tandem that only a CUDA GPU can check, in one run of at most 8 minutes,
written to one markdown report.

    python scripts/gpu_check.py [--out gpu-check-report.md] [--budget-s 480]

Without CUDA it says so and exits 0, claiming nothing. With CUDA, in order, each step bounded by
what is left of the budget (a step that no longer fits is reported as not run):
  1. engine parity against transformers on the GPU: float32 with SDPA (eager), bfloat16 with
     CUDA graphs over SDPA and over flash-attn                         tests/test_gpu_parity.py
  2. sampling and acceptance on CUDA give the CPU's tokens              tests/test_device_agreement.py
  3. CUDA graphs replayed give the eager logits (float32, bfloat16)     tests/test_cuda_graphs.py
     (+ the attention choice, and tensor parallelism over NCCL when 2 GPUs are present)
  4. where a target step's time goes (model on the device vs host), python -m bench.step_profile
  5. `make bench BENCH_ARGS=--quick` on each model pair present (models/demo, models/smollm2, models/tiny), as
     `python -m bench --quick --models PAIR` so that an absent pair is skipped, never built
Exit 0 when every step that ran passed.
"""

from __future__ import annotations

import argparse
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
PAIRS = ("models/demo", "models/smollm2", "models/tiny")
PYTEST_STEPS = [
    ("engine parity vs transformers (fp32 SDPA eager; bf16 + CUDA graphs over SDPA and flash-attn)",
     ["tests/test_gpu_parity.py"], 150),
    ("sampling and acceptance on CUDA == CPU",
     ["tests/test_device_agreement.py", "tests/test_attention_choice.py"], 60),
    ("CUDA graphs vs eager, tensor parallel (NCCL, 2+ GPUs)",
     ["tests/test_cuda_graphs.py", "tests/test_tensor_parallel.py", "-m", "cuda or device"], 120),
]
PROFILE_S = 120  # bench.step_profile: two loads of the target, 8 x 45 steps each
BENCH_S = 300  # --quick: ~3 min on 2 CPU cores; 3.6 min on an H200 machine before its anchor (2026-12-04)


@dataclass
class Result:
    name: str
    status: str  # passed | FAILED | not run
    seconds: float
    summary: str
    tail: str = ""


def run(name: str, cmd: list[str], limit: float) -> Result:
    if limit < 20:
        return Result(name, "not run", 0.0, "the 8-minute budget was spent before this step")
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit)
        out, ok = proc.stdout + proc.stderr, proc.returncode == 0
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        out, ok = out + f"\n(timed out after {limit:.0f}s)", False
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error)", ln)), "")
    summary = summary or (lines[-1] if lines else "")
    return Result(name, "passed" if ok else "FAILED", time.monotonic() - t0, summary.strip("= "),
                  "\n".join(lines[-40:]))


def environment() -> dict[str, str]:
    import torch

    info = {"commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                     text=True).stdout.strip() or "unknown",
            "torch": torch.__version__, "CUDA (torch)": str(torch.version.cuda), "python": platform.python_version(),
            "GPUs": ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))}
    try:
        import flash_attn

        info["flash-attn"] = flash_attn.__version__
    except ImportError:
        info["flash-attn"] = "not installed (bf16 flash parity is skipped)"
    return info


def report(path: Path, info: dict[str, str], results: list[Result], started: float) -> None:
    lines = ["# make gpu-check", ""]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    lines += [f"- wall time: {time.monotonic() - started:.0f} s", "", "| step | result | time | summary |",
              "|---|---|---|---|"]
    lines += [f"| {r.name} | {r.status} | {r.seconds:.0f} s | {r.summary} |" for r in results]
    for r in results:
        if r.tail:
            lines += ["", f"## {r.name}", "", "```", r.tail, "```"]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/gpu_check.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "gpu-check-report.md", help="the markdown report")
    p.add_argument("--budget-s", type=float, default=480.0, help="whole-run limit in seconds")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine (torch "
              f"{torch.__version__}, CUDA build {torch.version.cuda}): nothing was checked, nothing is claimed.")
        return 0
    started = time.monotonic()
    deadline = started + args.budget_s
    info = environment()
    print(f"gpu-check on {info['GPUs']} at {info['commit'][:12]}; report: {args.out}", flush=True)
    results = []
    for name, targets, cap in PYTEST_STEPS:
        cmd = [PY, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *targets]
        results.append(run(name, cmd, min(cap, deadline - time.monotonic())))
        print(f"  {results[-1].status:8} {name}: {results[-1].summary}", flush=True)
    for pair in PAIRS:  # where a target step's time goes: the model on the GPU, or the host around it
        if (ROOT / pair / "target" / "config.json").is_file():
            name = f"step profile of {pair}/target"
            cmd = [PY, "-m", "bench.step_profile", "--model", str(ROOT / pair / "target"), "--chunks", "0,128"]
            results.append(run(name, cmd, min(PROFILE_S, deadline - time.monotonic())))
            print(f"  {results[-1].status:8} {name}", flush=True)
    for pair in PAIRS:
        name = f"make bench BENCH_ARGS=--quick on {pair}"
        if not (ROOT / pair / "target" / "config.json").is_file():
            results.append(Result(name, "not run", 0.0, f"{pair} is absent (`make models` / `make models-tiny`)"))
        else:
            out = ROOT / "bench" / "results" / "quick" / f"gpu-{Path(pair).name}"
            # shared mode only: pinning each service to a CPU core means nothing on a GPU machine
            cmd = [PY, "-m", "bench", "--quick", "--mode", "shared", "--models", pair, "--out", str(out)]
            results.append(run(name, cmd, min(BENCH_S, deadline - time.monotonic())))
        print(f"  {results[-1].status:8} {name}: {results[-1].summary}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report(args.out, info, results, started)
    print(f"wrote {args.out} in {time.monotonic() - started:.0f}s")
    return 0 if all(r.status != "FAILED" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
