"""The feature workloads of a run (`--workloads`): besides `main` (configs x loads x modes), each
runs once per pair, after the main workload, in shared mode only: they measure features, not the
two-device premise.

    structured  bench/structured.py: the same prompts free and constrained to JSON schemas (issue #18)
    multiturn   bench/multiturn.py: multi-turn chat with and without --no-prefix-caching (issue #17)
    predicted   bench/predicted.py: the same prompts free, then with OpenAI's `prediction` (exact, edited)

Each gives one entry of results.json's "features": {workload, pair, mode, status, reason, seconds,
settings, results}; status is "ran", "n/a" (this pair cannot run it: reason says why) or "failed"
(it crashed: reason; the run exits 1). Their figures are in bench/figures.py, their sections of
results.md in bench/report.py; bulky per-request rows go to samples.json.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from bench.pairs import Pair
from bench.report import answers_text

WORKLOADS = ("main", "structured", "multiturn", "predicted")
FEATURES = WORKLOADS[1:]
DEFAULT_WORKLOADS = ",".join(WORKLOADS)


def parse_workloads(text: str) -> list[str]:
    """A comma list of WORKLOADS, in WORKLOADS order; ValueError names what is unknown or says it is empty."""
    wanted = {w.strip() for w in text.split(",") if w.strip()}
    unknown = wanted - set(WORKLOADS)
    if unknown:
        raise ValueError(f"unknown {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    if not wanted:
        raise ValueError(f"no workload named; choose from {', '.join(WORKLOADS)}")
    return [w for w in WORKLOADS if w in wanted]


def _entry(workload: str, pair: Pair, status: str, reason: str = "", **rest: object) -> dict:
    return {"workload": workload, "pair": pair.name, "mode": "shared", "status": status, "reason": reason,
            "seconds": 0.0, "settings": {}, "results": {}, **rest}


def run_structured(pair: Pair, quick: bool, log_dir: Path, samples: dict) -> dict:
    from bench import structured

    n = structured.QUICK_REQUESTS if quick else structured.REQUESTS
    settings = {"requests": n, "greedy": (n + 1) // 2, "sampled": n // 2, "concurrency": 4, "max_tokens": 160,
                "schemas": len(structured.SCHEMAS), "router_args": "defaults"}
    t0 = time.monotonic()
    try:
        res = structured.measure(pair.path, n, log_dir)
    except Exception as err:  # noqa: BLE001 - recorded as its failure: the run's other results must not be lost
        return _entry("structured", pair, "failed", f"{type(err).__name__}: {err} (logs in {log_dir})",
                      settings=settings, seconds=time.monotonic() - t0)
    samples.setdefault("structured", {})[pair.name] = {name: r.pop("answers") for name, r in res.items()}
    return _entry("structured", pair, "ran", settings=settings, results=res, seconds=time.monotonic() - t0)


def run_predicted(pair: Pair, quick: bool, log_dir: Path, samples: dict) -> dict:
    from bench import predicted

    n = predicted.QUICK_REQUESTS if quick else predicted.REQUESTS
    settings = {"requests": n, "greedy": n, "concurrency": 4, "max_tokens": predicted.MAX_TOKENS,
                "router_args": "defaults"}
    t0 = time.monotonic()
    try:
        res = predicted.measure(pair.path, n, log_dir)
    except Exception as err:  # noqa: BLE001 - as structured's
        return _entry("predicted", pair, "failed", f"{type(err).__name__}: {err} (logs in {log_dir})",
                      settings=settings, seconds=time.monotonic() - t0)
    samples.setdefault("predicted", {})[pair.name] = {name: res[name].pop("answers") for name in predicted.PASSES}
    return _entry("predicted", pair, "ran", settings=settings, results=res, seconds=time.monotonic() - t0)


def run_multiturn(pair: Pair, quick: bool, seed: int, log_dir: Path, samples: dict) -> dict:
    from bench import multiturn
    from bench.conversations import shape_for

    try:
        shape_for(pair.max_model_len, quick)
    except ValueError as err:
        return _entry("multiturn", pair, "n/a", str(err))
    t0 = time.monotonic()
    try:
        shape, modes = multiturn.measure(pair.path, quick, seed, log_dir)
    except Exception as err:  # noqa: BLE001 - as above
        return _entry("multiturn", pair, "failed", f"{type(err).__name__}: {err} (logs in {log_dir})",
                      seconds=time.monotonic() - t0)
    on, off = modes
    settings = {**asdict(shape), "chat_template": pair.has_chat_template}
    diffs = multiturn.judged_differences(pair.path, shape, seed, on.turns, off.turns)
    results = {"answers_identical": [t.answer for t in on.turns] == [t.answer for t in off.turns],
               "answers": multiturn.same_or_ties(on.turns, off.turns, diffs), "first_differences": diffs,
               "modes": {m.mode: {k: v for k, v in asdict(m).items() if k != "turns"} for m in modes}}
    samples.setdefault("multiturn", {})[pair.name] = {
        m.mode: [[t.conversation, t.turn, round(t.ttft, 4), round(t.e2e, 4)] for t in m.turns] for m in modes}
    return _entry("multiturn", pair, "ran", settings=settings, results=results, seconds=time.monotonic() - t0)


def run_features(pair: Pair, workloads: list[str], quick: bool, seed: int, out: Path, samples: dict,
                 say: Callable[[str], None] = print) -> list[dict]:
    """Every feature workload of `workloads` on one pair, in shared mode; logs under OUT/logs/PAIR/shared/."""
    entries = []
    for name in (w for w in FEATURES if w in workloads):
        say(f"{pair.name} shared: {name} workload ...")
        log_dir = out / "logs" / pair.name / "shared" / name
        entry = (run_structured(pair, quick, log_dir, samples) if name == "structured"
                 else run_predicted(pair, quick, log_dir, samples) if name == "predicted"
                 else run_multiturn(pair, quick, seed, log_dir, samples))
        say(f"{pair.name} shared: {name} {entry['status']}" + (f": {entry['reason']}" if entry["reason"] else "")
            + f" ({entry['seconds'] / 60:.1f} min)")
        entries.append(entry)
    return entries


def problems(entries: list[dict]) -> list[str]:
    """What makes the run fail: a workload that crashed, an invalid constrained answer, greedy answers
    that differ with and without prefix caching."""
    out = []
    for e in entries:
        tag = f"{e['pair']} {e['workload']}"
        if e["status"] == "failed":
            out.append(f"{tag}: did not run: {e['reason']}")
        elif e["status"] == "ran" and e["workload"] == "structured":
            r = e["results"]["json_schema"]
            if r["valid_json"] != r["requests"]:
                out.append(f"{tag}: {r['requests'] - r['valid_json']} of {r['requests']} constrained answers do "
                           "not parse or validate")
        elif e["status"] == "ran" and e["workload"] == "multiturn" and e["results"]["answers"] == "DIFFERENT":
            out.append(f"{tag}: greedy answers differ with and without prefix caching (not at a near-tie)")
        elif e["status"] == "ran" and e["workload"] == "predicted":
            out += [f"{tag}: request {d['request']} answered otherwise with the {name} prediction: "
                    f"{d['verdict']['text']}" for name, diffs in e["results"]["differences"].items() for d in diffs
                    if not d["verdict"]["tie"]]
    return out


def correctness_line(e: dict) -> str:
    """One printed line per entry for the end of a run."""
    tag = f"correctness, {e['pair']} {e['workload']}"
    if e["status"] != "ran":
        return f"{tag}: {e['status']} ({e['reason']})"
    if e["workload"] == "structured":
        r = e["results"]["json_schema"]
        return f"{tag}: {r['valid_json']}/{r['requests']} constrained answers parse and validate"
    if e["workload"] == "predicted":
        diffs = [d for ds in e["results"]["differences"].values() for d in ds]
        ties = sum(d["verdict"]["tie"] for d in diffs)
        return (f"{tag}: {2 * e['settings']['requests'] - len(diffs)}/{2 * e['settings']['requests']} greedy "
                f"answers with a prediction as without" + (f" ({ties} more differ at a near-tie)" if ties else ""))
    same = answers_text(e["results"]["answers"])
    turns = e["settings"]["conversations"] * e["settings"]["turns"]
    return f"{tag}: {turns} greedy answers {same} with and without prefix caching"

