"""The figures issues #13 and #14 ask of one `make bench` run, per pair and mode, each against its
threshold. These, and only these, are the summary printed at the end and written into results.md.

#13  pipeline hit rate >= 0.8 at c=1 and c=16 (each pipelined config, (5) and (6))
#13  two-device: pipelined (5) / sequential (4) output tokens/s at c=1 >= 1.3 (SmolLM2) / 1.15 (demo)
#13  defaults (6) within 5% of the best config's tokens/s at c=1, c=4, c=16 (>= 0.95x)
#13  defaults (6) never below target-only (1) at any load (>= 1.0x)
#13  SmolLM2, two-device, c=1: (6) >= 1.6x (1), and ahead of transformers' assisted generation (> 1.0x)
#14  router+RPC ms per step <= 10% of target ms per step at c=1 and c=16, defaults (6)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from bench.plans import Profile

HIT_RATE_MIN = 0.8
NEAR_BEST_MIN = 0.95
SINGLE_STREAM_MIN = 1.6
ROUTER_SHARE_MAX = 0.10


@dataclass(frozen=True)
class Figure:
    pair: str
    mode: str
    issue: str
    what: str
    value: float
    op: str  # ">=", ">" or "<=": how value must compare with threshold
    threshold: float
    unit: str = "x"  # "x" ratio, "rate" fraction, "%" share
    detail: str = ""

    @property
    def status(self) -> str:
        if math.isnan(self.value):
            return "n/a"
        ok = {">=": self.value >= self.threshold, ">": self.value > self.threshold,
              "<=": self.value <= self.threshold}[self.op]
        return "pass" if ok else "MISSED"

    def fmt(self, x: float) -> str:
        if math.isnan(x):
            return "n/a"
        return {"x": f"{x:.2f}x", "rate": f"{x:.2f}", "%": f"{x:.1%}"}[self.unit]

    def verdict(self) -> str:
        if self.status != "MISSED":
            return self.status
        gap = abs(self.value - self.threshold)
        if self.op == "<=":
            return f"MISSED by {gap:.1%} points ({self.value / self.threshold:.1f}x the limit)"
        by = f"{gap:.2f}{'x' if self.unit == 'x' else ''}"
        return f"MISSED by {by} ({gap / self.threshold:.0%} short)"

    def line(self) -> str:
        detail = f"  [{self.detail}]" if self.detail else ""
        return (f"{self.issue} {self.pair} {self.mode}: {self.what}: {self.fmt(self.value)} "
                f"(needs {self.op} {self.fmt(self.threshold)}) {self.verdict()}{detail}")

    def row(self) -> dict:
        return {**asdict(self), "status": self.status, "verdict": self.verdict()}

    @classmethod
    def from_row(cls, row: dict) -> Figure:
        """From row() as saved in results.json (where NaN was written as null)."""
        known = {k: v for k, v in row.items() if k in cls.__dataclass_fields__}
        return cls(**{**known, "value": math.nan if known["value"] is None else known["value"]})


def _get(res: dict, cfg: str, load: str, *path: str) -> float:
    node = res.get(cfg, {}).get(load)
    for p in path:
        if not isinstance(node, dict):
            return math.nan
        node = node.get(p)
    return float(node) if isinstance(node, int | float) else math.nan


def _div(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def _loads(res: dict) -> list[str]:
    seen: dict[str, None] = {}
    for per in res.values():
        seen.update(dict.fromkeys(per))
    return list(seen)


def _label(load: str) -> str:
    return f"c={load[1:]}" if load.startswith("c") and load[1:].isdigit() else load


def figures(pair: str, mode: str, res: dict, profile: Profile) -> list[Figure]:
    """res[config][load] = summary (Tandem configs carry "engine", from /metrics)."""
    def tps(cfg: str, load: str) -> float:
        return _get(res, cfg, load, "tokens_per_s")

    def eng(cfg: str, load: str, key: str) -> float:
        return _get(res, cfg, load, "engine", key)

    def fig(issue: str, what: str, value: float, op: str, thr: float, unit: str = "x", detail: str = "") -> Figure:
        if math.isnan(value) and "nan" in detail:
            detail = "not run"
        return Figure(pair, mode, issue, what, value, op, thr, unit, detail)

    def ran(cfg: str, load: str) -> bool:
        return load in res.get(cfg, {})

    out = []
    for cfg in ("5", "6"):
        for load in ("c1", "c16"):
            late, wrong = eng(cfg, load, "pipeline_miss_late"), eng(cfg, load, "pipeline_miss_wrong")
            detail = ("not run" if not ran(cfg, load) else "no lookups: it never speculated here" if math.isnan(late)
                      else f"misses: late {late:.0%}, wrong {wrong:.0%} of lookups")
            out.append(fig("#13", f"pipeline hit rate, ({cfg}) at {_label(load)}", eng(cfg, load, "pipeline_hit_rate"),
                           ">=", HIT_RATE_MIN, "rate", detail))
    if mode == "two-device":
        out.append(fig("#13", "pipelined (5) / sequential (4) tokens/s at c=1", _div(tps("5", "c1"), tps("4", "c1")),
                       ">=", profile.pipelining_min, detail=f"{tps('5', 'c1'):.1f} vs {tps('4', 'c1'):.1f} tok/s"))
    tandem = [c for c in res if c != "hf"]
    for load in ("c1", "c4", "c16"):
        ranked = sorted((c for c in tandem if not math.isnan(tps(c, load))), key=lambda c: -tps(c, load))
        best = ranked[0] if ranked else "?"
        out.append(fig("#13", f"defaults (6) / best config ({best}) tokens/s at {_label(load)}",
                       _div(tps("6", load), tps(best, load)), ">=", NEAR_BEST_MIN,
                       detail=f"(6) {tps('6', load):.1f}, ({best}) {tps(best, load):.1f} tok/s" if ran("6", load)
                       else "not run"))
    for load in _loads(res):
        out.append(fig("#13", f"defaults (6) / target-only (1) tokens/s at {_label(load)}",
                       _div(tps("6", load), tps("1", load)), ">=", 1.0,
                       detail=f"{tps('6', load):.1f} vs {tps('1', load):.1f} tok/s"))
    if mode == "two-device" and profile.single_stream_gates:
        out.append(fig("#13", "single stream: defaults (6) / target-only (1) tokens/s",
                       _div(tps("6", "c1"), tps("1", "c1")), ">=", SINGLE_STREAM_MIN,
                       detail=f"{tps('6', 'c1'):.1f} vs {tps('1', 'c1'):.1f} tok/s"))
        out.append(fig("#13", "single stream: defaults (6) / transformers assisted generation tokens/s",
                       _div(tps("6", "c1"), tps("hf", "c1")), ">", 1.0,
                       detail=f"{tps('6', 'c1'):.1f} vs {tps('hf', 'c1'):.1f} tok/s"))
    for load in ("c1", "c16"):
        out.append(fig("#14", f"router+RPC / target ms per step, (6) at {_label(load)}",
                       eng("6", load, "router_over_target"), "<=", ROUTER_SHARE_MAX, "%",
                       f"{eng('6', load, 'router_ms_per_step'):.1f} vs {eng('6', load, 'target_ms_per_step'):.1f} ms"))
    return out


def summary_lines(rows: list[dict]) -> list[str]:
    """The saved figures (Figure.row()) as printed lines, with a count of what passed."""
    figs = [Figure.from_row(r) for r in rows]
    passed = sum(f.status == "pass" for f in figs)
    missed = sum(f.status == "MISSED" for f in figs)
    return [f.line() for f in figs] + [f"{passed} passed, {missed} missed, {len(figs) - passed - missed} n/a "
                                       "(a config or load not run, or nothing to measure)"]
