"""Command line: ``python -m demo_models --variant full --out models/demo``."""

from __future__ import annotations

import argparse
import sys

from .build import VARIANTS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m demo_models",
        description=(
            "Build Tandem's demo draft/target pair locally, without a model hub. A byte-level BPE "
            "tokenizer and a Llama target are trained on the Python standard library's own sources; "
            "a 1-layer Llama draft is distilled from the target on the target's greedy continuations. "
            "Both are saved in Hugging Face format under OUT/target and OUT/draft (same tokenizer), "
            "then measured: held-out cross-entropy, greedy acceptance at k = 1..8, and the per-token "
            "decode cost ratio on this machine. The report goes to OUT/report.json. A second run with "
            "the same settings returns at once."
        ),
        epilog=(
            "variants: full = the demo pair (about 12-13 minutes on 2 quiet CPU cores, capped near 15); "
            "tiny = seconds, tiny models for tests (acceptance not meaningful)."
        ),
    )
    p.add_argument("--variant", choices=sorted(VARIANTS), default="full", help="which pair to build (default: full)")
    p.add_argument("--out", required=True, help="output directory, e.g. models/demo")
    p.add_argument("--force", action="store_true", help="rebuild even if OUT/report.json matches the settings")
    p.add_argument(
        "--no-time-cap",
        action="store_true",
        help="train the full step schedule however long it takes (by default each training phase stops "
        "at a safety time cap so the build fits its budget on a slow or busy machine; the report says so)",
    )
    p.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16"),
        default="auto",
        help="training precision (default auto: bf16 autocast only where the CPU has native bf16, "
        "e.g. AVX-512 BF16 or AMX; fp32 elsewhere, where emulated bf16 is ~20x slower)",
    )
    p.add_argument(
        "--allow-partial",
        action="store_true",
        help="install the pair even if it misses its quality gates (acceptance at k=4 >= 0.5, cost "
        "ratio >= 8x for 'full'); by default such a build exits 1 and leaves OUT untouched",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from .build import BuildFailed, build  # heavy imports after --help

    try:
        build(args.variant, args.out, force=args.force, time_caps=not args.no_time_cap,
              precision=args.precision, allow_partial=args.allow_partial)
    except BuildFailed as exc:
        print(f"BUILD FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
