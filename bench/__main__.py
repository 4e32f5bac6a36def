"""python -m bench [--quick] [--models DIR,DIR] [--mode shared|two-device|both]: see --help."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from bench.features import DEFAULT_WORKLOADS
from router.config import RouterConfig

DESCRIPTION = """\
Tandem's latency and throughput story, side by side in one run, for each model pair and each
mode. For each configuration it starts the stack (target + draft + router, three processes on
loopback), warms it up, and drives the same prompts with the same seeds through the OpenAI HTTP
door (SSE streaming):

  (1) target only, prefill-first            --no-chunked-prefill --no-prompt-lookup, no draft
  (2) target only + chunked prefill         --no-prompt-lookup, no draft
  (3) speculation, no chunking, sequential  --no-chunked-prefill --no-pipeline --no-dynamic-k
  (4) speculation + chunked, sequential     --no-pipeline --no-dynamic-k
  (5) (4) + pipelining                      --no-dynamic-k
  (6) (5) + dynamic k                       the defaults (prompt lookup where it beats the draft)
  (7) target + prompt lookup                no draft: what the draft model adds beyond lookup
  (hf) the anchor: transformers generate(assistant_model=draft) on the same pair, greedy, in its own
       process, one request at a time (under load: served one after another, FIFO)

Modes (--mode):
  shared      today's `make run`: no pinning; every process uses torch's default threads (all cores),
              so the two services compete for the same cores. The anchor too.
  two-device  the design's premise, one device per model: `taskset -c` pins the target to the first
              core with --threads 1, the draft to the second with --threads 1; the router (a separate
              host in the design) and the load client share the draft's core. Target-only configs pin
              the target the same way. The anchor, a single-device program, gets the target's core
              and one thread. Needs taskset (util-linux) and at least two cores.

Pairs (--models): a comma list of pair directories (target/ and draft/, Hugging Face format). Each
gets a plan scaled to its speed (the profile: by directory name, else by target size):
  demo     code prompts cut from held-out stdlib files (50% short, 30% medium, 20% long: 2.3-3.5x
           the step budget, they force chunking)
  smollm2  half chat (questions in bench/workloads/chat_questions.txt rendered with the pair's chat
           template), half held-out code; fewer, shorter requests: its target costs ~10x the demo's
A pair directory that is missing is skipped with a message saying how to build it.

Loads: closed loop with 1 (single stream), 4 and 16 clients; open-loop Poisson arrivals at fractions
of the first config's c=16 capacity. Greedy, ignore_eos: every config and mode must produce
identical tokens for a prompt, and this is checked (exit 1 otherwise).

Measures per pair x mode x config x load: output tokens/s, TTFT, ITL p50/p90/p99 (per token from SSE
chunk arrival times), end-to-end latency; from /metrics deltas: acceptance, pipeline hit rate and
misses (late / wrong / unasked), target busy, target ms/step, router+RPC ms/step and its share of target;
from /proc: the cores each process kept busy (CPU seconds during the load / its wall time).

Feature workloads (--workloads), once per pair in shared mode, after the configs: structured
(bench/structured.py: the same prompts free and constrained to JSON schemas; every constrained
answer must parse and validate), multiturn (bench/multiturn.py: multi-turn chat with and without
prefix caching; greedy answers must be identical) and predicted (bench/predicted.py: the same code
prompts free, then with OpenAI's `prediction` exact and edited; greedy answers must be identical).

Writes OUT/results.md (the issues' figures with pass/fail first, then every table), results.json,
samples.json, PAIR-MODE-itl_cdf.png and PAIR-MODE-load.png (plots need matplotlib; --replot redraws
them), and every process's log under OUT/logs/PAIR/MODE/. Prints the figures at the end.
"""


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


FULL_MODELS = "models/demo,models/smollm2"
QUICK_MODELS = "models/demo"


def _epilog() -> str:
    from bench.plans import PROFILES

    lines = ["plans and rough times on a quiet 2-core machine (per mode; the progress bar's ETA is the truth):"]
    for p in PROFILES.values():
        for quick in (False, True):
            minutes = p.minutes_quick if quick else p.minutes
            lines.append(f"  {p.name:8s}{' --quick' if quick else '        '}  {p.plan(quick).describe()}; "
                         + ", ".join(f"{m} ~{t:.0f} min" for m, t in minutes.items()))
    lines += ["a full run (both pairs, both modes, the feature workloads): 40-110 min by the CPU; "
              "--quick (demo, both modes): about 9 min",
              "example: python -m bench --quick --models models/tiny --out /tmp/bench   (harness check only)"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=DESCRIPTION, epilog=_epilog(),
                                formatter_class=_Help)
    p.add_argument("--quick", action="store_true",
                   help="fewer and shorter requests, demo pair only: for iteration, not for ratios between configs "
                   "(its c=16 is one burst of 16 requests)")
    p.add_argument("--models", default=None,
                   help=f"comma-separated pair directories (default: {FULL_MODELS}; with --quick {QUICK_MODELS})")
    p.add_argument("--mode", choices=("shared", "two-device", "both"), default="both", help="how processes share "
                   "the cores (see above)")
    p.add_argument("--out", type=Path, default=None,
                   help="where results and plots go (default: bench/results, or bench/results/quick with --quick, "
                        "which is not committed)")
    p.add_argument("--configs", default="1,2,3,4,5,6,7,hf", help="comma-separated subset of 1..7 and hf")
    p.add_argument("--loads", default=None, help="comma-separated subset of the plan's loads (e.g. c1,c16)")
    p.add_argument("--budget", type=int, default=RouterConfig.max_num_batched_tokens,
                   help="router --max-num-batched-tokens (prompt lengths scale)")
    p.add_argument("--k-max", type=int, default=4, help="router --k-max")
    p.add_argument("--capacity", type=float, default=0.0,
                   help="req/s that Poisson rate fractions refer to (0: measure the first config at c=16)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the configs this many times in turn (1..7, 1..7, ...), each round a fresh stack, and "
                        "report each config and load from its median round by tokens/s (the others' tokens/s "
                        "kept beside it): drift over minutes then falls on every config in turn")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts, output lengths and arrivals")
    p.add_argument("--workloads", default=DEFAULT_WORKLOADS,
                   help="comma-separated subset of main (configs x loads x modes, above), structured (JSON-schema "
                        "constrained vs free answers, #18), multiturn (chat with and without prefix caching, "
                        "#17) and predicted (answers with OpenAI's prediction vs without); the last three run "
                        "once per pair, shared mode only")
    p.add_argument("--replot", type=Path, metavar="RESULTS_JSON", help="only draw the plots of a saved run")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.out is None:
        args.out = Path("bench/results/quick" if args.quick else "bench/results")
    if args.replot:
        from bench import plots, report

        for path in plots.plot_all(report.load(args.replot), args.replot.parent, args.replot):
            print(f"wrote {path}")
        return 0
    from bench.modes import MODES, ModeUnavailable, make_mode
    from bench.pairs import find_pairs
    from bench.stats import CONFIGS

    if args.rounds < 1:
        print("--rounds: at least 1", file=sys.stderr)
        return 2
    wanted = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(wanted) - {c.key for c in CONFIGS} - {"hf"}
    if unknown:
        print(f"--configs: unknown {sorted(unknown)}; choose from 1..7 and hf", file=sys.stderr)
        return 2
    from bench.features import parse_workloads

    try:
        args.workloads = parse_workloads(args.workloads)
    except ValueError as err:
        print(f"--workloads: {err}", file=sys.stderr)
        return 2
    args.loads = [x.strip() for x in args.loads.split(",") if x.strip()] if args.loads else None
    try:
        modes = [make_mode(m) for m in (MODES if args.mode == "both" else (args.mode,))]
    except ModeUnavailable as err:
        print(f"{err}. Run with --mode shared to measure shared mode only.", file=sys.stderr)
        return 2
    paths = [Path(x.strip()) for x in (args.models or (QUICK_MODELS if args.quick else FULL_MODELS)).split(",")]
    pairs, skipped = find_pairs([p for p in paths if str(p)])
    if not pairs:
        print("no model pair to measure:\n  " + "\n  ".join(skipped) + "\nDevelop the harness against the tiny "
              "pair: `make models-tiny`, then --models models/tiny (its numbers mean nothing)", file=sys.stderr)
        return 2
    from bench import suite

    return suite.run(args, argv, pairs, skipped, modes, [c for c in CONFIGS if c.key in wanted], "hf" in wanted)


def _stop_on_sigterm() -> None:
    """SIGTERM (a job runner, `kill`) ends the run as Ctrl-C does: the running stack's `finally`
    stops its three servers instead of leaving them on their loopback ports."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


if __name__ == "__main__":
    _stop_on_sigterm()
    sys.exit(main())
