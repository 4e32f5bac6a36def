"""The anchor a user would pick on one device: transformers `generate(assistant_model=draft)` on the
same pair, greedy, one request at a time, on the device and in the dtype the services use (CUDA and
bfloat16 where there is a GPU, else CPU and float32). It runs as its own process after the last stack of a
mode has stopped, under that mode's pinning:

    python -m bench.anchor --models DIR --prompts IN.json --out OUT.json [--threads N]

Both models load with model_zoo.hf_draft.load_causal_lm (a reduced-vocabulary draft included).
Each distinct prompt is served once; a streamer timestamps every batch of tokens generate emits,
which gives TTFT and ITL the same way the HTTP client does. Loads with more than one request in
flight are then served one after another (FIFO): their latencies are the measured service times
plus the queueing wait that order implies (simulate())."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.client import RequestResult
from bench.modes import ROOT, Mode
from bench.plans import Load
from bench.workloads import Prompt


def serve_all(models: Path, prompts: list[Prompt], on_done: Callable[[RequestResult], None]) -> list[RequestResult]:
    """Each prompt served alone: greedy, exactly max_tokens new tokens (EOS does not stop it, like
    the router's ignore_eos), transformers' default assistant schedule."""
    import torch
    import transformers
    from transformers.generation.streamers import BaseStreamer

    from engine.config import EngineConfig
    from model_zoo.hf_draft import load_causal_lm

    class Clock(BaseStreamer):
        def __init__(self, t0: float, result: RequestResult) -> None:
            self.t0, self.result, self.prompt_seen = t0, result, False

        def put(self, value: torch.Tensor) -> None:
            if not self.prompt_seen:  # generate() streams the prompt first
                self.prompt_seen = True
                return
            now = time.perf_counter() - self.t0
            ids = value.reshape(-1).tolist()
            if not self.result.chunks:
                self.result.ttft = now
            self.result.chunks.append((now, len(ids)))
            self.result.tokens.extend(ids)

        def end(self) -> None:
            pass

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    where = EngineConfig()  # the device and dtype the bench's services resolve ("auto"): same work, same numbers
    device, dtype = where.resolved_device(), where.resolved_dtype()
    target = load_causal_lm(models / "target", dtype).to(device)
    draft = load_causal_lm(models / "draft", dtype).to(device)
    gc = target.generation_config
    eos = gc.eos_token_id[0] if isinstance(gc.eos_token_id, list) else gc.eos_token_id
    pad = gc.pad_token_id if gc.pad_token_id is not None else (eos if eos is not None else 0)
    kwargs = {"assistant_model": draft, "do_sample": False, "eos_token_id": None, "pad_token_id": pad}

    @torch.inference_mode()
    def run(p: Prompt) -> RequestResult:
        res = RequestResult(p.pid, 0.0)
        ids = torch.tensor([p.ids], device=device)
        t0 = time.perf_counter()
        target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=p.max_tokens,
                        streamer=Clock(t0, res), **kwargs)
        res.e2e = time.perf_counter() - t0
        if len(res.tokens) != p.max_tokens:
            res.error = f"anchor produced {len(res.tokens)} tokens, asked for {p.max_tokens}"
        return res

    for p in (min(prompts, key=lambda p: len(p.ids)), max(prompts, key=lambda p: len(p.ids))):
        run(p)  # warm-up, unmeasured
    out = []
    for p in prompts:
        out.append(run(p))
        on_done(out[-1])
    return out


def run_anchor(models: Path, prompts: list[Prompt], mode: Mode, work: Path,
               on_done: Callable[[], None]) -> dict[int, RequestResult]:
    """Serve `prompts` in a child process pinned like `mode` says; its log goes to work/anchor.log."""
    work.mkdir(parents=True, exist_ok=True)
    src, dst = work / "anchor-prompts.json", work / "anchor-results.json"
    src.write_text(json.dumps([p.__dict__ for p in prompts]))
    cmd = [*mode.prefix("anchor"), sys.executable, "-m", "bench.anchor", "--models", str(models), "--prompts",
           str(src), "--out", str(dst), "--threads", str(mode.threads)]
    with open(work / "anchor.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, cwd=ROOT, text=True)
        for line in proc.stdout or ():
            if line.startswith("served "):
                on_done()
        if proc.wait():
            raise RuntimeError(f"the transformers anchor exited with {proc.returncode}; see {work / 'anchor.log'}")
    rows = json.loads(dst.read_text())
    return {r["pid"]: RequestResult(r["pid"], 0.0, r["ttft"], r["e2e"], [tuple(c) for c in r["chunks"]], r["tokens"],
                                    r["error"]) for r in rows}


def simulate(load: Load, requests: list[Prompt], served: dict[int, RequestResult], rate: float,
             arrivals: list[float]) -> tuple[list[RequestResult], float]:
    """The load's requests served one after another in arrival order, each taking its measured
    time. Closed loop: a client sends its next request when its previous answer arrives."""
    free_at = 0.0
    client_free = [0.0] * load.concurrency
    out = []
    for i, p in enumerate(requests):
        m = served[p.pid]
        if load.kind == "closed":
            c = min(range(load.concurrency), key=client_free.__getitem__)
            sent = client_free[c]
        else:
            sent = arrivals[i] / rate
        start = max(sent, free_at)
        free_at = start + m.e2e
        wait = start - sent
        r = RequestResult(p.pid, sent, ttft=wait + m.ttft, e2e=wait + m.e2e,
                          chunks=[(wait + t, n) for t, n in m.chunks], tokens=m.tokens, error=m.error)
        if load.kind == "closed":
            client_free[c] = sent + r.e2e
        out.append(r)
    return out, free_at - min((r.sent for r in out), default=0.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.anchor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=Path, required=True, help="pair directory (target/ and draft/)")
    p.add_argument("--prompts", type=Path, required=True, help="JSON list of prompts (bench.workloads.Prompt)")
    p.add_argument("--out", type=Path, required=True, help="where the results go (JSON)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = [Prompt(**d) for d in json.loads(args.prompts.read_text())]
    results = serve_all(args.models, prompts, lambda r: print(f"served {r.pid}", flush=True))
    args.out.write_text(json.dumps([{"pid": r.pid, "ttft": r.ttft, "e2e": r.e2e, "chunks": r.chunks,
                                     "tokens": r.tokens, "error": r.error} for r in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
