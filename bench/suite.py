"""One run: every pair x mode x config x load, then the anchor per pair x mode, the figures,
and the files. `run()` is what `python -m bench` calls after parsing its flags."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from bench import anchor, features, plans, report, ties
from bench.figures import feature_figures, figures
from bench.modes import Mode
from bench.pairs import Pair
from bench.plans import Load, Plan, Profile
from bench.runner import LoadRun, Settings, run_config
from bench.stats import ANCHOR, CONFIGS, Config, Correctness, itl_samples, summarize
from bench.workloads import Prompt, build_pool, pool_summary


@dataclass
class PairWork:
    """A pair's plan and prompts, shared by its modes (same prompts, same arrivals)."""

    pair: Pair
    profile: Profile
    plan: Plan
    pool: list[Prompt]
    loads: list[tuple[Load, list[Prompt], list[float]]]
    notes: list[str]
    check: Correctness = field(default_factory=Correctness)

    @property
    def requests(self) -> int:
        """Requests per config in one mode: the chosen loads' together."""
        return sum(ld.n_requests for ld, _, _ in self.loads)

    @property
    def used(self) -> list[Prompt]:
        pids = sorted({p.pid for _, reqs, _ in self.loads for p in reqs})
        return [self.pool[i] for i in pids]


def prepare(pair: Pair, quick: bool, budget: int, seed: int, only_loads: list[str] | None) -> PairWork:
    profile = plans.profile_for(pair.name, pair.params("target"))
    plan = profile.plan(quick)
    pool, notes = build_pool(pair, plan, budget, seed)
    unknown = set(only_loads or ()) - {ld.name for ld in plan.loads}
    if unknown:
        names = ", ".join(ld.name for ld in plan.loads)
        raise SystemExit(f"--loads: {sorted(unknown)} not in {pair.name}'s plan ({names})")
    chosen = [ld for ld in plan.loads if not only_loads or ld.name in only_loads]
    loads = [(ld, [pool[i % len(pool)] for i in range(ld.n_requests)], plans.arrivals(ld, seed)) for ld in chosen]
    return PairWork(pair, profile, plan, pool, loads, notes)


def estimate_minutes(w: PairWork, mode: str, quick: bool, configs: int, anchor: bool, rounds: int) -> float:
    """The profile's rough minutes for a whole run of the pair in this mode, scaled to the loads, configs
    and rounds asked for (the anchor counts as half a config, as the progress estimate does)."""
    minutes = (w.profile.minutes_quick if quick else w.profile.minutes)[mode]
    loads = w.requests / sum(ld.n_requests for ld in w.plan.loads)
    return minutes * loads * (configs * rounds + 0.5 * anchor) / (len(CONFIGS) + 0.5)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def run_mode(w: PairWork, mode: Mode, configs: list[Config], with_anchor: bool, args: argparse.Namespace,
             samples: dict) -> dict:
    """Every config (and the anchor) on one pair in one mode; returns the run's entry for results.json."""
    from tqdm import tqdm

    t0 = time.monotonic()
    tag = f"{w.pair.name} {mode.name}"
    log_dir = args.out / "logs" / w.pair.name / mode.name
    settings = Settings(w.pair.path, args.budget, args.k_max, mode, log_dir)
    capacity = [args.capacity or None]
    warm = [Prompt(p.pid, p.ids, 8, p.kind, p.source, p.workload) for p in w.pool[:4]]
    results: dict[str, dict] = {}
    itl: dict[str, dict] = {}
    rows: dict[str, dict] = {}
    rounds = args.rounds
    total = w.requests * len(configs) * rounds + (len(w.used) if with_anchor else 0)
    bar = tqdm(total=total, unit="req", dynamic_ncols=True, smoothing=0.05, desc=tag)

    def rate_of(load: Load, done: list[LoadRun]) -> float:
        if capacity[0] is None:  # the first config's c=16 (config (1) in a full run) sets the scale
            capacity[0] = next((lr.summary["requests_per_s"] for lr in done if lr.load.name == "c16"), 1.0)
        return load.rate_frac * capacity[0]

    failures = []
    measured: dict[str, dict[str, list[LoadRun]]] = {}  # config -> load -> its runs, one per round
    turns = [(r, cfg) for r in range(rounds) for cfg in configs]
    for i, (rnd, cfg) in enumerate(turns):
        done_before = bar.n
        name = f"{tag} ({cfg.key})" + (f" round {rnd + 1}/{rounds}" if rounds > 1 else "")
        try:
            runs = run_config(cfg, settings, w.pair.name, w.loads, rate_of, warm, lambda r: bar.update(1),
                              lambda load, n=name: bar.set_description(f"{n} {load.name}"))
        except Exception as err:  # noqa: BLE001 - one broken config must not sink an hour's run
            failures.append(f"({cfg.key}): {err}")
            bar.write(f"{name} FAILED: {err} (logs in {log_dir}/config-{cfg.key}); going on")
            bar.update(w.requests - (bar.n - done_before))
            continue
        for lr in runs:
            measured.setdefault(cfg.key, {}).setdefault(lr.load.name, []).append(lr)
            w.check.check(f"{mode.name} ({cfg.key}) {lr.load.name}", lr.results)
        elapsed = time.monotonic() - t0
        bar.write(f"{name} done: {elapsed / 60:.1f} min into this mode, about "
                  f"{(len(turns) - i - 1 + 0.5 * with_anchor) * elapsed / (i + 1) / 60:.1f} min left in it")
    for key, by_load in measured.items():
        results[key], itl[key], rows[key] = {}, {}, {}
        for load_name, lrs in by_load.items():
            lr = median_round(lrs)
            results[key][load_name] = lr.summary
            if len(lrs) > 1:
                lr.summary["rounds_tokens_per_s"] = [x.summary["tokens_per_s"] for x in lrs]
            itl[key][load_name] = lr.itl
            rows[key][load_name] = [r.row() for r in lr.results]

    agreement = "not run"
    served = None
    if with_anchor:
        bar.set_description(f"{tag} (hf) anchor")
        try:
            served = anchor.run_anchor(w.pair.path, w.used, mode, log_dir, lambda: bar.update(1))
        except Exception as err:  # noqa: BLE001 - as a config
            failures.append(f"(hf): {err}")
            bar.write(f"{tag} (hf) FAILED: {err}")
    anchor_mismatches: list[dict] = []
    if served is not None:
        same, anchor_mismatches = w.check.against_anchor(served)
        agreement = f"{same}/{len(served)} prompts token-for-token identical"
        if anchor_mismatches:
            bar.set_description(f"{tag} judging {len(anchor_mismatches)} anchor differences")
            pairs = [(w.check.reference[d["pid"]][1], served[d["pid"]].tokens) for d in anchor_mismatches]
            _judge(w, anchor_mismatches, pairs)
            agreement += " (first differences: " + "; ".join(
                f"prompt {d['pid']} at token {d['first_diff_at']}, {d['verdict']['text']}"
                for d in anchor_mismatches[:5]) + ")"
        results["hf"], itl["hf"], rows["hf"] = {}, {}, {}
        for load, reqs, arr in w.loads:
            rate = load.rate_frac * capacity[0] if load.kind == "open" and capacity[0] else 1.0
            rs, wall = anchor.simulate(load, reqs, served, rate, arr)
            results["hf"][load.name] = summarize(rs, wall)
            itl["hf"][load.name] = itl_samples(rs)
            rows["hf"][load.name] = [r.row() for r in rs]
    bar.close()
    samples["itl_samples"][f"{w.pair.name}/{mode.name}"] = itl
    samples["requests"][f"{w.pair.name}/{mode.name}"] = rows
    return {"pair": w.pair.name, "mode": mode.name, "pinning": mode.describe(), "threads": mode.threads or "default",
            "capacity_req_s": capacity[0] or 0.0, "mixed": w.plan.mixed, "anchor_agreement": agreement,
            "anchor_mismatches": anchor_mismatches, "failures": failures,
            "seconds": time.monotonic() - t0, "results": results}


def median_round(runs: list[LoadRun]) -> LoadRun:
    """The run of one config and load whose tokens/s is the median of its rounds (the lower middle of an
    even count): every figure of it comes from one real run."""
    ranked = sorted(runs, key=lambda lr: lr.summary["tokens_per_s"])
    return ranked[(len(ranked) - 1) // 2]


def _judge(w: PairWork, diffs: list[dict], answers: list[tuple[list[int], list[int]]]) -> None:
    """Give each difference between two greedy answers for a prompt its verdict: near-tie or not."""
    divergences = [ties.Divergence.between(w.pool[d["pid"]].ids, a, b) for d, (a, b) in zip(diffs, answers,
                                                                                             strict=True)]
    for d, v in zip(diffs, ties.judge(w.pair.path / "target", divergences), strict=True):
        d["verdict"] = v.as_dict()


def run(args: argparse.Namespace, argv: list[str], pairs: list[Pair], skipped: list[str], modes: list[Mode],
        configs: list[Config], with_anchor: bool) -> int:
    import torch

    from bench import plots
    from bench.figures import summary_lines

    t0 = time.monotonic()
    work = [prepare(p, args.quick, args.budget, args.seed, args.loads) for p in pairs]
    for w in work:
        minutes = {m.name: estimate_minutes(w, m.name, args.quick, len(configs), with_anchor, args.rounds)
                   for m in modes}
        print(f"{w.pair.name} ({w.pair.path}, profile {w.profile.name}): {w.plan.describe()}; "
              + ", ".join(f"{m} ~{t:.0f} min" if t >= 1 else f"{m} under a minute" for m, t in minutes.items()))
        for n in w.notes:
            print(f"note: {n}")
        if w.pair.report.get("variant") not in (None, "full"):
            print(f"note: {w.pair.path} is a {w.pair.report['variant']!r} build: fine for developing the harness, "
                  "but its numbers mean nothing")
    for m in modes:
        print(f"mode {m.describe()}")
    for s in skipped:
        print(f"SKIPPED {s}")
    loadavg = os.getloadavg()
    if loadavg[0] > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {loadavg[0]:.1f} on {os.cpu_count()} cores before starting: something else "
              "is running, and these numbers will carry its noise (the load average is recorded)")

    samples: dict = {"itl_samples": {}, "requests": {}}
    runs, figs, feats = [], [], []
    for w in work:
        for mode in modes if "main" in args.workloads else ():
            entry = run_mode(w, mode, configs, with_anchor, args, samples)
            runs.append(entry)
            report.save_partial(args.out, entry)
            figs += [f.row() for f in figures(w.pair.name, mode.name, entry["results"], w.profile)]
        for entry in features.run_features(w.pair, args.workloads, args.quick, args.seed, args.out, samples):
            feats.append(entry)
            report.save_partial(args.out, entry)
            figs += [f.row() for f in feature_figures(entry)]
    for w in work:
        if w.check.mismatches:
            print(f"{w.pair.name}: judging {len(w.check.mismatches)} differing greedy answers (float64 reference)")
            _judge(w, w.check.mismatches, w.check.answers)
    data = {
        "meta": {"command": shlex.join(["python", "-m", "bench", *argv]),
                 "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "quick": args.quick, "rounds": args.rounds,
                 "budget": args.budget, "k_max": args.k_max, "seed": args.seed,
                 "modes": [m.name for m in modes], "skipped": skipped, "seconds": time.monotonic() - t0,
                 "machine": {"cpus": os.cpu_count(), "cpu_model": _cpu_model(), "torch": torch.__version__,
                             "python": platform.python_version(), "torch_default_threads": torch.get_num_threads(),
                             "loadavg_start": [round(x, 2) for x in loadavg],
                             "loadavg_end": [round(x, 2) for x in os.getloadavg()]}},
        "configs": [{"key": c.key, "name": c.name, "flags": list(c.flags), "draft": c.draft}
                    for c in [*configs, *([ANCHOR] if with_anchor else [])]],
        "pairs": {w.pair.name: {"facts": w.pair.facts(), "profile": w.profile.name, "notes": w.notes,
                                "plan": {"mixed": w.plan.mixed, "out_tokens": list(w.plan.out_tokens),
                                         "loads": [report.load_dict(ld) for ld, _, _ in w.loads]},
                                "workload": pool_summary(w.pool), "correctness": w.check.report()}
                  for w in work},
        "runs": runs, "features": feats, "figures": figs,
    }
    js, md = report.write(args.out, data, samples)
    pngs = plots.plot_all({**data, **samples}, args.out, js)
    print("\n" + "\n".join(summary_lines(figs)))
    print(f"\nwrote {js}, {md}" + "".join(f", {p}" for p in pngs) + f"  ({data['meta']['seconds'] / 60:.1f} min)")
    for s in skipped:
        print(f"INCOMPLETE: {s}")
    errors = sum(s["errors"] for r in runs for per in r["results"].values() for s in per.values())
    mismatches = sum(w.check.report()["mismatches"] for w in work)
    failed = [f"{r['pair']} {r['mode']} {f}" for r in runs for f in r["failures"]] + features.problems(feats)
    if mismatches or errors or failed:
        print(f"FAILED: {mismatches} output mismatches across configs and modes (near-ties apart), {errors} failed "
              "requests, "
              f"{len(failed)} configs or workloads that did not run or answered wrong (details in {js})"
              + "".join(f"\n  {f}" for f in failed))
        return 1
    for w in work if "main" in args.workloads else ():
        c = w.check.report()
        agree = "; ".join(f"{r['mode']}: {r['anchor_agreement']}" for r in runs if r["pair"] == w.pair.name)
        ties_note = f" but {c['near_ties']} that differ at a float64 near-tie" if c["near_ties"] else ""
        print(f"correctness, {w.pair.name}: {c['answers_compared']} greedy answers for {c['prompts']} prompts "
              f"identical across configs, loads and modes{ties_note}; anchor: {agree}")
    for e in feats:
        print(features.correctness_line(e))
    return 0
