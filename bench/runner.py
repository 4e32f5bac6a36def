"""One Tandem configuration: start target (+ draft) + router on free loopback ports, pinned as the
mode says, warm it up, drive every load with /metrics scraped around it, stop it."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import prom
from bench.client import RequestResult, run_load, warm_up
from bench.modes import Mode, PinnedStack
from bench.plans import Load
from bench.stats import Config, itl_samples, summarize
from bench.workloads import Prompt
from router.stack import stack_ports


@dataclass
class Settings:
    models: Path
    budget: int
    k_max: int
    mode: Mode
    log_dir: Path


@dataclass
class LoadRun:
    load: Load
    results: list[RequestResult]
    summary: dict
    itl: list[float]


def _draft_up(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=2.0) as r:  # noqa: S310 - loopback only
            return bool(json.loads(r.read()).get("draft_available"))
    except OSError:
        return False


def start_stack(cfg: Config, s: Settings) -> PinnedStack:
    log_dir = s.log_dir / f"config-{cfg.key}"
    log_dir.mkdir(parents=True, exist_ok=True)
    for f in log_dir.glob("*.log"):
        f.unlink()
    router_args = [*cfg.flags, "--max-num-batched-tokens", str(s.budget), "--k-max", str(s.k_max),
                   "--max-waiting", "4096", "--log-level", "WARNING"]
    stack = PinnedStack(s.models / "target", s.models / "draft" if cfg.draft else None,
                        served_model_name=s.models.name, **stack_ports(), service_args=s.mode.service_args(),
                        router_args=router_args, log_dir=log_dir, mode=s.mode)
    try:
        stack.start(timeout=180.0)
        deadline = time.monotonic() + 60.0
        while cfg.draft and not _draft_up(stack.url):
            if time.monotonic() > deadline:
                raise RuntimeError(f"config ({cfg.key}): the router never reported the draft available")
            time.sleep(0.2)
        stack.check_pinning()
    except BaseException:
        stack.stop()
        raise
    return stack


def run_config(cfg: Config, s: Settings, model_name: str, loads: list[tuple[Load, list[Prompt], list[float]]],
               rate_of: Callable[[Load, list[LoadRun]], float], warm: list[Prompt],
               on_done: Callable[[RequestResult], None], on_load: Callable[[Load], None]) -> list[LoadRun]:
    """rate_of(load, runs so far) gives an open-loop load its arrival rate just before it runs."""
    stack = start_stack(cfg, s)
    runs = []
    try:
        with s.mode.client_affinity():
            asyncio.run(warm_up(stack.url, model_name, warm))
            for load, requests, arrivals in loads:
                on_load(load)
                rate = rate_of(load, runs) if load.kind == "open" else 0.0
                before = prom.scrape(stack.url)
                cpu_before = stack.cpu_seconds()
                results, wall = asyncio.run(run_load(stack.url, model_name, load, requests, rate, arrivals, on_done))
                cpu_after = stack.cpu_seconds()
                after = prom.scrape(stack.url)
                summary = summarize(results, wall)
                summary["cpu_busy"] = {n: (cpu_after[n] - cpu_before[n]) / wall for n in cpu_after} if wall else {}
                engine = prom.derive(prom.delta(before, after), wall)
                summary["engine"] = (engine | prom.gauges(after)) if cfg.draft else engine
                if load.kind == "open":
                    summary["rate_req_s"] = rate
                runs.append(LoadRun(load, results, summary, itl_samples(results)))
    finally:
        codes = stack.stop()
        bad = {n: c for n, c in codes.items() if c not in (0, -15)}
        if bad:
            print(f"config ({cfg.key}): processes exited with {bad}; logs in {s.log_dir}/config-{cfg.key}")
    return runs
