"""python -m bench [--quick] [--models models/demo] [--out bench/results]: latency and throughput, side by side."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

DESCRIPTION = """\
Tandem's latency and throughput story, side by side in one run. For each configuration it starts
the stack (target + draft + router, three processes on loopback, via router.launch.Stack), warms it
up, and drives the same prompts with the same seeds through the OpenAI HTTP door (SSE streaming):

  (1) target only, prefill-first            --no-chunked-prefill, no draft
  (2) target only + chunked prefill         no draft
  (3) speculation, no chunking, sequential  --no-chunked-prefill --no-pipeline --no-dynamic-k
  (4) speculation + chunked, sequential     --no-pipeline --no-dynamic-k
  (5) (4) + pipelining                      --no-dynamic-k
  (6) (5) + dynamic k                       the defaults
  (hf) the anchor: transformers generate(assistant_model=draft) on the same pair, greedy, in this
       process, one request at a time (under load: served one after another, FIFO)

Loads: closed loop with 1 (single stream), 4 and 16 clients; open-loop Poisson arrivals at
fractions of config (1)'s measured c=16 capacity. Prompts are cut from the held-out stdlib files
(never trained on): 50% short, 30% medium, 20% long (2.3-3.5x the step budget: they force
chunking). Greedy, ignore_eos: every config must produce identical tokens, and this is checked.

Measures per config and load: TTFT, ITL p50/p90/p99 (per token from SSE chunk arrival times: a
chunk with n tokens counts n intervals of dt/n), end-to-end latency, output tokens/s; and from
/metrics deltas: acceptance rate, emitted tokens per step, pipeline hit rate, target busy
fraction (target forward time / wall time), draft and router+RPC time per step.

Writes OUT/results.json, OUT/samples.json, OUT/results.md, OUT/itl_cdf.png and OUT/load.png
(plots need matplotlib; --replot redraws them from a saved run), service logs under OUT/logs/.
Prints the summary ratios. Exit 1 if outputs differ across configs or requests failed.
A full run takes about 12 min on a quiet 2-core machine (18 on a shared one), --quick about 3.
"""


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from bench.workload import plan

    def describe(quick: bool) -> str:
        pl = plan(quick)
        return (", ".join(f"{ld.label} x{ld.n_requests}" for ld in pl.loads)
                + f"; outputs {pl.out_tokens[0]}-{pl.out_tokens[1]} tokens; {pl.pool_size} distinct prompts")

    epilog = (f"loads of a full run: {describe(False)}\nloads with --quick:  {describe(True)}\n"
              "example: python -m bench --quick --models models/tiny --out /tmp/bench   (harness check only)")
    p = argparse.ArgumentParser(prog="python -m bench", description=DESCRIPTION, epilog=epilog, formatter_class=_Help)
    p.add_argument("--quick", action="store_true", help="fewer and shorter requests (~3 min): for iteration")
    p.add_argument("--models", type=Path, default=Path("models/demo"),
                   help="directory with target/, draft/ and report.json (`make models`; models/tiny to develop)")
    p.add_argument("--out", type=Path, default=None,
                   help="where results and plots go (default: bench/results, or bench/results/quick with --quick, "
                        "which is not committed)")
    p.add_argument("--configs", default="1,2,3,4,5,6,hf", help="comma-separated subset of 1..6 and hf")
    p.add_argument("--budget", type=int, default=256, help="router --max-num-batched-tokens (prompt lengths scale)")
    p.add_argument("--k-max", type=int, default=4, help="router --k-max")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads of each service and of the anchor (0: torch's default, all cores)")
    p.add_argument("--capacity", type=float, default=0.0,
                   help="req/s that Poisson rate fractions refer to (0: measure config (1) at c=16)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts, output lengths and arrivals")
    p.add_argument("--replot", type=Path, metavar="RESULTS_JSON", help="only draw the plots of a saved run")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.out is None:
        args.out = Path("bench/results/quick" if args.quick else "bench/results")
    from bench import plots, report
    if args.replot:
        data = report.load(args.replot)
        for path in plots.plot(data, args.replot.parent, args.replot):
            print(f"wrote {path}")
        return 0
    if not (args.models / "report.json").is_file() or not (args.models / "target" / "config.json").is_file():
        print(f"no model pair in {args.models}: run `make models` first (about 15 min once, cached), or develop "
              "against the tiny pair with --models models/tiny (`make models-tiny`; its numbers mean nothing)",
              file=sys.stderr)
        return 2
    wanted = [c.strip() for c in args.configs.split(",") if c.strip()]
    from bench.stats import ANCHOR, CONFIGS
    unknown = set(wanted) - {c.key for c in CONFIGS} - {"hf"}
    if unknown:
        print(f"--configs: unknown {sorted(unknown)}; choose from 1..6 and hf", file=sys.stderr)
        return 2
    return run(args, argv, [c for c in CONFIGS if c.key in wanted], "hf" in wanted, ANCHOR)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def run(args: argparse.Namespace, argv: list[str], configs: list, with_anchor: bool, anchor_cfg) -> int:  # noqa: ANN001
    import torch
    from tqdm import tqdm

    from bench import anchor, plots, report, workload
    from bench.runner import LoadRun, Settings, run_config
    from bench.stats import Correctness, itl_samples, ratio_lines, ratios, summarize

    t_start = time.monotonic()
    facts = workload.model_facts(args.models)
    if facts["variant"] != "full":
        print(f"note: {args.models} is the {facts['variant']!r} pair: fine for developing the harness, but its "
              "numbers mean nothing. Run `make models` for the demo pair, then `make bench`.")
    plan = workload.plan(args.quick)
    pool = workload.build_pool(args.models, plan.pool_size, plan.out_tokens, args.budget, args.seed)
    loads = [(ld, [pool[i % len(pool)] for i in range(ld.n_requests)], workload.arrivals(ld, args.seed))
             for ld in plan.loads]
    used = sorted({p.pid for _, reqs, _ in loads for p in reqs})
    total = sum(ld.n_requests for ld in plan.loads) * len(configs) + (len(used) if with_anchor else 0)
    print(f"bench: {len(configs)} Tandem configs x {len(plan.loads)} loads ({', '.join(ld.name for ld in plan.loads)})"
          f"{' + the transformers anchor' if with_anchor else ''}: {total} requests; expect about "
          f"{'3' if args.quick else '12-20'} min on a 2-core machine (the bar's ETA sharpens as it goes)", flush=True)
    settings = Settings(args.models, args.budget, args.k_max, args.threads, args.out / "logs")
    model_name = args.models.resolve().name
    capacity = [args.capacity or None]
    warm = [workload.Prompt(p.pid, p.ids, 8, p.kind, p.source) for p in pool[:4]]
    check = Correctness()
    results: dict[str, dict] = {}
    samples: dict[str, dict] = {}
    rows: dict[str, dict] = {}
    loadavg_start = os.getloadavg()
    if loadavg_start[0] > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {loadavg_start[0]:.1f} on {os.cpu_count()} cores before starting: something "
              "else is running, and these numbers will carry its noise (the load average is recorded)")
    bar = tqdm(total=total, unit="req", dynamic_ncols=True, smoothing=0.05)

    def rate_of(load: workload.Load, done: list[LoadRun]) -> float:
        if capacity[0] is None:  # the first config's c=16 (config (1) in a full run) sets the scale
            capacity[0] = next(lr.summary["requests_per_s"] for lr in done if lr.load.name == "c16")
        return load.rate_frac * capacity[0]

    for cfg in configs:
        results[cfg.key], samples[cfg.key], rows[cfg.key] = {}, {}, {}

        def on_load(load: workload.Load, key: str = cfg.key) -> None:
            bar.set_description(f"({key}) {load.name}")

        runs = run_config(cfg, settings, model_name, loads, rate_of, warm, lambda r: bar.update(1), on_load)
        for lr in runs:
            results[cfg.key][lr.load.name] = lr.summary
            samples[cfg.key][lr.load.name] = lr.itl
            rows[cfg.key][lr.load.name] = [r.row() for r in lr.results]
            check.check(f"({cfg.key}) {lr.load.name}", lr.results)
        elapsed, done = time.monotonic() - t_start, configs.index(cfg) + 1
        left = (len(configs) - done + (0.6 if with_anchor else 0)) * elapsed / done  # the anchor: ~0.6 config
        bar.write(f"({cfg.key}) done: {elapsed / 60:.1f} min elapsed, ETA ~{left / 60:.1f} min")

    agreement = "not run"
    if with_anchor:
        bar.set_description("(hf) anchor")
        if args.threads:
            torch.set_num_threads(args.threads)
        served = anchor.serve_all(args.models, [pool[i] for i in used], lambda r: bar.update(1))
        same = sum(1 for pid, r in served.items() if pid in check.reference and check.reference[pid][1] == r.tokens)
        agreement = f"{same}/{len(served)} prompts token-for-token identical"
        if not check.reference:
            check.check("(hf)", list(served.values()))
        results["hf"], samples["hf"], rows["hf"] = {}, {}, {}
        for load, reqs, arr in loads:
            rate = load.rate_frac * capacity[0] if load.kind == "open" and capacity[0] else 1.0
            rs, wall = anchor.simulate(load, reqs, served, rate, arr)
            results["hf"][load.name] = summarize(rs, wall)
            samples["hf"][load.name] = itl_samples(rs)
            rows["hf"][load.name] = [r.row() for r in rs]
    bar.close()

    data = {
        "meta": {"command": shlex.join(["python", "-m", "bench", *argv]),
                 "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
                 "quick": args.quick, "models": str(args.models), "budget": args.budget, "k_max": args.k_max,
                 "seed": args.seed, "out_tokens": list(plan.out_tokens), "capacity_req_s": capacity[0] or 0.0,
                 "seconds": time.monotonic() - t_start, "model_facts": facts,
                 "machine": {"cpus": os.cpu_count(), "cpu_model": _cpu_model(), "torch": torch.__version__,
                             "python": platform.python_version(),
                             "torch_threads_services": args.threads or f"default ({torch.get_num_threads()})",
                             "loadavg_start": [round(x, 2) for x in loadavg_start],
                             "loadavg_end": [round(x, 2) for x in os.getloadavg()]}},
        "configs": [{"key": c.key, "name": c.name, "flags": list(c.flags), "draft": c.draft}
                    for c in [*configs, *([anchor_cfg] if with_anchor else [])]],
        "plan": {"loads": [{"name": ld.name, "label": ld.label, "kind": ld.kind, "n_requests": ld.n_requests,
                            "concurrency": ld.concurrency, "rate_frac": ld.rate_frac} for ld in plan.loads]},
        "workload": workload.pool_summary(pool),
        "results": results, "correctness": check.report(), "anchor_agreement": agreement,
        "ratios": ratios(results, plan.mixed), "itl_samples": samples, "requests": rows,
    }
    js, md = report.write(args.out, data)
    pngs = plots.plot(data, args.out, js)
    print("\n" + "\n".join(ratio_lines(data["ratios"])))
    print(f"\nwrote {js}, {md}" + "".join(f", {p}" for p in pngs) + f"  ({data['meta']['seconds'] / 60:.1f} min)")
    errors = sum(s["errors"] for per in results.values() for s in per.values())
    if check.mismatches or errors:
        print(f"FAILED: {len(check.mismatches)} output mismatches across configs, {errors} failed requests "
              f"(details in {js})", file=sys.stderr)
        return 1
    print(f"correctness: {check.checked} greedy answers for {len(check.reference)} prompts identical across "
          f"configs; anchor: {agreement}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
