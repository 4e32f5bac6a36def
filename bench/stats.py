"""Summaries of one (config, load), the cross-config correctness check, and the headline ratios."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bench.client import RequestResult


@dataclass(frozen=True)
class Config:
    key: str  # "1".."6", "hf"
    name: str
    draft: bool
    flags: tuple[str, ...]


CONFIGS: tuple[Config, ...] = (
    Config("1", "target only, prefill-first", False, ("--no-chunked-prefill",)),
    Config("2", "target only + chunked prefill", False, ()),
    Config("3", "spec, no chunking, draft then target", True,
           ("--no-chunked-prefill", "--no-pipeline", "--no-dynamic-k")),
    Config("4", "spec + chunked, draft then target", True, ("--no-pipeline", "--no-dynamic-k")),
    Config("5", "(4) + pipelining", True, ("--no-dynamic-k",)),
    Config("6", "(5) + dynamic k (defaults)", True, ()),
)
ANCHOR = Config("hf", "transformers generate(assistant_model=draft), one at a time", True, ())


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else math.nan


def summarize(results: list[RequestResult], wall: float) -> dict:
    ok = [r for r in results if r.error is None]
    itl = [x for r in ok for x in r.itl()]
    ttft = [r.ttft for r in ok]
    e2e = [r.e2e for r in ok]
    tokens = sum(len(r.tokens) for r in ok)
    ms = 1000.0
    return {
        "requests": len(results), "errors": len(results) - len(ok), "wall_s": wall, "output_tokens": tokens,
        "tokens_per_s": tokens / wall if wall else math.nan, "requests_per_s": len(ok) / wall if wall else math.nan,
        "ttft_ms": {"p50": ms * _pct(ttft, 50), "p90": ms * _pct(ttft, 90), "p99": ms * _pct(ttft, 99)},
        "itl_ms": {"p50": ms * _pct(itl, 50), "p90": ms * _pct(itl, 90), "p99": ms * _pct(itl, 99),
                   "mean": ms * float(np.mean(itl)) if itl else math.nan},
        "e2e_s": {"p50": _pct(e2e, 50), "p90": _pct(e2e, 90), "p99": _pct(e2e, 99)},
        "first_error": next((r.error for r in results if r.error), None),
    }


def itl_samples(results: list[RequestResult]) -> list[float]:
    return [round(x * 1000, 2) for r in results if r.error is None for x in r.itl()]


class Correctness:
    """Greedy decoding must give the same tokens for a prompt in every config and load. The first
    answer seen for a prompt is the reference; every later one is compared with it."""

    def __init__(self) -> None:
        self.reference: dict[int, tuple[str, list[int]]] = {}
        self.checked = 0
        self.mismatches: list[dict] = []

    def check(self, where: str, results: list[RequestResult]) -> None:
        for r in results:
            if r.error is not None:
                continue
            ref = self.reference.setdefault(r.pid, (where, r.tokens))
            self.checked += 1
            if ref[1] != r.tokens:
                at = next((i for i, (a, b) in enumerate(zip(ref[1], r.tokens, strict=False)) if a != b),
                          min(len(ref[1]), len(r.tokens)))
                self.mismatches.append({"pid": r.pid, "where": where, "reference": ref[0], "first_diff_at": at})

    def report(self) -> dict:
        return {"prompts": len(self.reference), "answers_compared": self.checked,
                "mismatches": len(self.mismatches), "details": self.mismatches[:50]}


def _get(res: dict, cfg: str, load: str, *path: str) -> float:
    node = res.get(cfg, {}).get(load)
    for p in path:
        if not isinstance(node, dict):
            return math.nan
        node = node.get(p)
    return float(node) if isinstance(node, int | float) else math.nan


def _div(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def ratios(res: dict, mixed: str) -> dict:
    """The headline comparisons. res[config][load] = summary (with "engine" for Tandem configs)."""
    itl1 = {c: _get(res, c, "c1", "itl_ms", "p50") for c in res}
    out: dict = {
        "single_stream_itl_p50_ms": itl1,
        "single_stream_itl_speedup_6_vs_1": _div(itl1.get("1", math.nan), itl1.get("6", math.nan)),
        "mixed_load": mixed,
        "mixed_itl_p99_ms": {c: _get(res, c, mixed, "itl_ms", "p99") for c in res},
    }
    out["mixed_itl_p99_3_over_5"] = _div(out["mixed_itl_p99_ms"].get("3", math.nan),
                                         out["mixed_itl_p99_ms"].get("5", math.nan))
    for load in ("c1", "c16"):
        anchor = _get(res, "hf", load, "tokens_per_s")
        out[f"throughput_vs_anchor_{load}"] = {c: _div(_get(res, c, load, "tokens_per_s"), anchor)
                                                for c in res if c != "hf"}
        out[f"anchor_tokens_per_s_{load}"] = anchor
    out["pipelining_5_vs_4"] = {
        "c16_throughput": _div(_get(res, "5", "c16", "tokens_per_s"), _get(res, "4", "c16", "tokens_per_s")),
        "c1_itl_p50_speedup": _div(itl1.get("4", math.nan), itl1.get("5", math.nan)),
        "mixed_itl_p99_speedup": _div(_get(res, "4", mixed, "itl_ms", "p99"), _get(res, "5", mixed, "itl_ms", "p99")),
    }
    out["target_busy_c16"] = {c: _get(res, c, "c16", "engine", "target_busy") for c in res if c != "hf"}
    out["target_busy_c1"] = {c: _get(res, c, "c1", "engine", "target_busy") for c in res if c != "hf"}
    return out


def ratio_lines(r: dict) -> list[str]:
    def f(x: float) -> str:
        return "n/a" if math.isnan(x) else f"{x:.2f}x"

    def per(d: dict, fmt: str = "{:.2f}x") -> str:
        return ", ".join(f"({k}) {fmt.format(v)}" for k, v in d.items() if not math.isnan(v)) or "n/a"

    return [
        f"single-stream ITL p50, (1) / (6): {f(r['single_stream_itl_speedup_6_vs_1'])}  "
        f"[ms: {per(r['single_stream_itl_p50_ms'], '{:.1f}')}]",
        f"p99 ITL under mixed load ({r['mixed_load']}), (3) / (5): {f(r['mixed_itl_p99_3_over_5'])}  "
        f"[ms: {per(r['mixed_itl_p99_ms'], '{:.1f}')}]",
        f"throughput vs the transformers anchor at 1 stream ({r['anchor_tokens_per_s_c1']:.1f} tok/s): "
        f"{per(r['throughput_vs_anchor_c1'])}",
        f"throughput vs the anchor at 16 streams (served one after another, {r['anchor_tokens_per_s_c16']:.1f} tok/s): "
        f"{per(r['throughput_vs_anchor_c16'])}",
        "pipelining, (5) vs (4): c=16 throughput {}, c=1 ITL p50 speedup {}, mixed p99 ITL speedup {}".format(
            *(f(v) for v in r["pipelining_5_vs_4"].values())),
        f"target busy fraction at c=1: {per(r['target_busy_c1'], '{:.0%}')}",
        f"target busy fraction at c=16: {per(r['target_busy_c16'], '{:.0%}')}",
    ]
