"""The figures issues #13, #14, #17 and #18 ask of one `make bench` run, per pair and mode, each against
its threshold. These, and only these, are the summary printed at the end and written into results.md.

#13  pipeline hit rate >= 0.8 at c=1 and c=16 (each pipelined config, (5) and (6))
#13  two-device: pipelined (5) / sequential (4) output tokens/s at c=1 >= 1.3 (SmolLM2) / 1.15 (demo)
#13  defaults (6) within 5% of the best config's tokens/s at c=1, c=4, c=16 (>= 0.95x)
#13  defaults (6) never below target-only (1) at any load (>= 1.0x)
#13  SmolLM2, two-device, c=1: (6) >= 1.6x (1), and ahead of transformers' assisted generation (> 1.0x)
#14  router+RPC ms per step <= 10% of target ms per step at c=1 and c=16, defaults (6)
#17  multi-turn (shared): TTFT p50 with prefix caching <= 0.3x without, tokens/s >= 1.0x, acceptance
     unchanged (within 0.05), prefix-cache hit rate per service > 0 with caching
#18  structured (shared): every json_schema answer parses and validates (greedy and sampled), and
     acceptance on constrained requests > 0
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from bench.plans import Profile

HIT_RATE_MIN = 0.8
NEAR_BEST_MIN = 0.95
SINGLE_STREAM_MIN = 1.6
ROUTER_SHARE_MAX = 0.10
TTFT_CACHED_MAX = 0.3
ACCEPTANCE_DRIFT_MAX = 0.05


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
        by = f"{gap:.1%} points" if self.unit == "%" else f"{gap:.2f}{'x' if self.unit == 'x' else ''}"
        if self.op == "<=":
            return f"MISSED by {by}" + (f" ({self.value / self.threshold:.1f}x the limit)" if self.threshold else "")
        return f"MISSED by {by}" + (f" ({gap / self.threshold:.0%} short)" if self.threshold else "")

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
            unasked = eng(cfg, load, "pipeline_miss_unasked")  # nan in runs before the reason existed
            detail = ("not run" if not ran(cfg, load) else "no lookups: it never speculated here" if math.isnan(late)
                      else f"misses: late {late:.0%}, wrong {wrong:.0%}"
                      + ("" if math.isnan(unasked) else f", unasked {unasked:.0%}") + " of lookups")
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


def _num(x: object) -> float:
    """A number from a results dict (NaN was saved as null)."""
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else math.nan


def _f(x: float, spec: str = "{:.2f}") -> str:
    return "n/a" if math.isnan(x) else spec.format(x)


def _feature(entry: dict, issue: str, specs: list[tuple[str, float, str, float, str, str]]) -> list[Figure]:
    """specs: (what, value, op, threshold, unit, detail); a workload that did not run gives each as n/a
    with its reason."""
    why = "" if entry["status"] == "ran" else f"{entry['status']}: {entry['reason']}"
    return [Figure(entry["pair"], entry["mode"], issue, what, math.nan if why else value, op, thr, unit,
                   why or detail) for what, value, op, thr, unit, detail in specs]


def multiturn_figures(entry: dict) -> list[Figure]:
    """#17 from a multiturn entry (bench/features.py), saved or fresh."""
    modes = entry["results"].get("modes", {})
    on, off = modes.get("prefix caching", {}), modes.get("no prefix caching", {})
    ttft_on, ttft_off = _num(on.get("ttft_p50")), _num(off.get("ttft_p50"))
    later_on, later_off = _num(on.get("ttft_p50_later")), _num(off.get("ttft_p50_later"))
    tps_on, tps_off = _num(on.get("tokens_per_s")), _num(off.get("tokens_per_s"))
    acc_on, acc_off = _num(on.get("acceptance")), _num(off.get("acceptance"))
    acc = (f"{_f(acc_on)} with, {_f(acc_off)} without" if not math.isnan(abs(acc_on - acc_off))
           else f"{_f(acc_on)} with, {_f(acc_off)} without: a mode verified no drafts (dynamic k chose k = 0)")
    specs = [
        ("multi-turn: TTFT p50, prefix caching / none", _div(ttft_on, ttft_off), "<=", TTFT_CACHED_MAX, "x",
         f"{_f(ttft_on * 1e3, '{:.0f}')} vs {_f(ttft_off * 1e3, '{:.0f}')} ms; turns 2+: "
         f"{_f(later_on * 1e3, '{:.0f}')} vs {_f(later_off * 1e3, '{:.0f}')} ms"),
        ("multi-turn: output tokens/s, prefix caching / none", _div(tps_on, tps_off), ">=", 1.0, "x",
         f"{_f(tps_on, '{:.1f}')} vs {_f(tps_off, '{:.1f}')} tok/s"),
        ("multi-turn: acceptance, |with - without prefix caching|", abs(acc_on - acc_off), "<=",
         ACCEPTANCE_DRIFT_MAX, "rate", acc),
    ]
    for service in ("target", "draft"):
        hit_on = _num(on.get("hit_rate", {}).get(service))
        hit_off = _num(off.get("hit_rate", {}).get(service))
        if math.isnan(hit_on):
            detail = f"no prefix-cache queries with caching: the {service} did no prompt work (a draft resting " \
                     "through the workload, router/regime.py)"
        else:
            off_text = "no queries" if math.isnan(hit_off) else _f(hit_off)
            detail = (f"without caching {off_text}; attach misses (both services) "
                      f"{_f(_num(on.get('attach_misses')), '{:.0f}')}")
        specs.append((f"multi-turn: prefix-cache hit rate with caching, {service}", hit_on, ">", 0.0, "rate", detail))
    return _feature(entry, "#17", specs)


def structured_figures(entry: dict) -> list[Figure]:
    """#18 from a structured entry (bench/features.py), saved or fresh."""
    free, js = entry["results"].get("free", {}), entry["results"].get("json_schema", {})
    n = js.get("requests", entry["settings"].get("requests", 0))
    by = js.get("by_sampling", {})
    greedy, sampled = by.get("greedy", [0, 0]), by.get("sampled", [0, 0])
    acc_js, acc_free = _num(js.get("acceptance")), _num(free.get("acceptance"))
    specs = [
        (f"structured: json_schema answers that parse and validate ({n} requests, greedy + sampled)",
         _div(_num(js.get("valid_json")), _num(n)), ">=", 1.0, "rate",
         f"{js.get('valid_json')}/{n}: greedy {greedy[0]}/{greedy[1]}, sampled {sampled[0]}/{sampled[1]}; free "
         f"text {free.get('valid_json')}/{free.get('requests')} valid JSON"),
        ("structured: acceptance on constrained requests", acc_js, ">", 0.0, "rate",
         (f"free text {_f(acc_free)}; emitted/step {_f(_num(js.get('emitted_per_step')))}; "
          f"{_f(_num(js.get('mask_bytes_per_verification')), '{:.0f}')} B of masks per verification")
         if not math.isnan(acc_js) else "no drafts verified: nothing to accept"),
    ]
    return _feature(entry, "#18", specs)


def feature_figures(entry: dict) -> list[Figure]:
    """The issues' figures of a feature workload (predicted outputs answer to none: their section says
    what they measured)."""
    if entry["workload"] == "predicted":
        return []
    return multiturn_figures(entry) if entry["workload"] == "multiturn" else structured_figures(entry)


def summary_lines(rows: list[dict]) -> list[str]:
    """The saved figures (Figure.row()) as printed lines, with a count of what passed."""
    figs = [Figure.from_row(r) for r in rows]
    passed = sum(f.status == "pass" for f in figs)
    missed = sum(f.status == "MISSED" for f in figs)
    return [f.line() for f in figs] + [f"{passed} passed, {missed} missed, {len(figs) - passed - missed} n/a "
                                       "(a config, load or workload not run, or nothing to measure)"]
