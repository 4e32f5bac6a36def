"""The feature workloads of `make bench` (bench/features.py): which run, what they count as a failed
run, their figures for #17 and #18, their sections of results.md, and one real run on the tiny pair."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import features, report
from bench.figures import Figure, feature_figures, summary_lines


def test_workloads_parse_in_a_fixed_order_and_refuse_unknown_names() -> None:
    assert features.parse_workloads("multiturn, main") == ["main", "multiturn"]
    assert features.parse_workloads(features.DEFAULT_WORKLOADS) == ["main", "structured", "multiturn", "predicted"]
    with pytest.raises(ValueError, match=r"unknown \['chat'\]"):
        features.parse_workloads("main,chat")
    with pytest.raises(ValueError, match="no workload"):
        features.parse_workloads(" , ")


def _structured(valid: int = 8, acceptance: float = 0.6) -> dict:
    pass_ = {"requests": 8, "valid_json": valid, "by_sampling": {"greedy": [4, 4], "sampled": [valid - 4, 4]},
             "finish_stop": 8, "acceptance": acceptance, "emitted_per_step": 1.8,
             "mask_bytes_per_verification": 96.0, "router_ms_per_step": 3.0, "target_ms_per_step": 9.0,
             "tokens_per_s": 100.0}
    free = {**pass_, "valid_json": 0, "by_sampling": {"greedy": [0, 4], "sampled": [0, 4]}}
    return {"workload": "structured", "pair": "demo", "mode": "shared", "status": "ran", "reason": "",
            "seconds": 30.0, "settings": {"requests": 8}, "results": {"free": free, "json_schema": pass_}}


def _multiturn(ttft_on: float = 0.05, answers: str = "identical", acc_on: float | None = 0.7) -> dict:
    def mode(ttft: float, hit: float, acc: float | None) -> dict:
        return {"mode": "", "ttft_p50": ttft, "ttft_p50_later": ttft, "tokens_per_s": 50.0, "acceptance": acc,
                "hit_rate": {"target": hit, "draft": hit}, "attach_misses": 0.0}

    return {"workload": "multiturn", "pair": "demo", "mode": "shared", "status": "ran", "reason": "",
            "seconds": 60.0, "settings": {"conversations": 4, "turns": 4},
            "results": {"answers_identical": answers == "identical", "answers": answers,
                        "modes": {"prefix caching": mode(ttft_on, 0.6, acc_on),
                                  "no prefix caching": mode(0.2, 0.0, 0.7)}}}


def _by_what(figs: list[Figure]) -> dict[str, Figure]:
    return {f.what.split(" (")[0]: f for f in figs}


def test_structured_figures_pass_only_when_every_constrained_answer_validates() -> None:
    ok = _by_what(feature_figures(_structured()))
    assert ok["structured: json_schema answers that parse and validate"].status == "pass"
    assert ok["structured: acceptance on constrained requests"].status == "pass"
    bad = _by_what(feature_figures(_structured(valid=7, acceptance=math.nan)))
    assert bad["structured: json_schema answers that parse and validate"].status == "MISSED"
    assert bad["structured: acceptance on constrained requests"].status == "n/a"
    assert features.problems([_structured(valid=7)]) == [
        "demo structured: 1 of 8 constrained answers do not parse or validate"]
    assert features.problems([_structured()]) == []


def test_multiturn_figures_compare_caching_against_none() -> None:
    figs = _by_what(feature_figures(_multiturn(ttft_on=0.05)))
    ttft = figs["multi-turn: TTFT p50, prefix caching / none"]
    assert ttft.value == pytest.approx(0.25) and ttft.status == "pass"
    assert figs["multi-turn: prefix-cache hit rate with caching, draft"].status == "pass"
    slow = _by_what(feature_figures(_multiturn(ttft_on=0.1)))["multi-turn: TTFT p50, prefix caching / none"]
    assert slow.status == "MISSED" and "MISSED by 0.20x" in slow.verdict()
    resting = _multiturn()
    resting["results"]["modes"]["prefix caching"]["hit_rate"]["draft"] = None  # no queries: saved NaN reads as null
    rested = _by_what(feature_figures(resting))["multi-turn: prefix-cache hit rate with caching, draft"]
    assert rested.status == "n/a" and "no prefix-cache queries" in rested.detail
    no_drafts = _by_what(feature_figures(_multiturn(acc_on=None)))  # saved NaN reads back as null
    assert no_drafts["multi-turn: acceptance, |with - without prefix caching|"].status == "n/a"
    assert features.problems([_multiturn(answers="DIFFERENT")]) == [
        "demo multiturn: greedy answers differ with and without prefix caching (not at a near-tie)"]
    assert features.problems([_multiturn(answers="near-ties")]) == [], "fp32 rounding at a near-tie is no error"


def test_a_workload_that_did_not_run_gives_na_figures_and_fails_only_when_it_crashed() -> None:
    na = {**_multiturn(), "status": "n/a", "reason": "a 128-token context is too short", "results": {}}
    figs = feature_figures(na)
    assert figs and all(f.status == "n/a" and "too short" in f.detail for f in figs)
    assert features.problems([na]) == []
    crashed = {**_structured(), "status": "failed", "reason": "RuntimeError: router died", "results": {}}
    assert all(f.status == "n/a" for f in feature_figures(crashed))
    assert features.problems([crashed]) == ["demo structured: did not run: RuntimeError: router died"]
    assert "did not run" not in features.correctness_line(na) and "n/a" in features.correctness_line(na)


def _predicted(mismatch: bool = False) -> dict:
    pass_ = {"requests": 4, "output_tokens": 640, "wall_s": 2.0, "tokens_per_s": 320.0, "output_tokens_per_step": 2.5,
             "mean_latency_s": 1.0, "lookup_share": 0.9, "acceptance": 0.95}
    verdict = {"tie": not mismatch, "below_best": [0.0, 0.5], "text": "MISMATCH (...)" if mismatch else "near-tie"}
    return {"workload": "predicted", "pair": "demo", "mode": "shared", "status": "ran", "reason": "",
            "seconds": 20.0, "settings": {"requests": 4},
            "results": {"free": pass_, "exact": pass_, "edited": pass_,
                        "differences": {"exact": [], "edited": [{"request": 2, "verdict": verdict}]}}}


def test_predicted_outputs_fail_the_run_only_where_an_answer_changed_beyond_a_near_tie() -> None:
    assert features.problems([_predicted()]) == [] and feature_figures(_predicted()) == []
    assert features.problems([_predicted(mismatch=True)]) == [
        "demo predicted: request 2 answered otherwise with the edited prediction: MISMATCH (...)"]
    assert features.correctness_line(_predicted()) == ("correctness, demo predicted: 7/8 greedy answers with a "
                                                        "prediction as without (1 more differ at a near-tie)")
    text = "\n".join(report.feature_lines(_predicted()))
    assert "## demo, predicted workload (shared)" in text and "| edited | 3/4 (1 near-ties) | 2.50 | 0.90 |" in text


def test_feature_sections_render_from_saved_json(tmp_path: Path) -> None:
    entries = [_structured(), _multiturn(acc_on=math.nan),
               {**_multiturn(), "pair": "tiny", "status": "n/a", "reason": "too short", "results": {}}]
    saved = json.loads(json.dumps(report._finite(entries)))  # as results.json holds them: NaN -> null
    text = "\n".join(line for e in saved for line in report.feature_lines(e))
    assert "## demo, structured workload (shared)" in text
    assert "| json_schema | 8/8 (greedy 4/4, sampled 4/4) | 8 | 0.60 |" in text
    assert "| prefix caching | 50 | 50 | 50.0 | — | 60% / 60% | 0 |" in text
    assert "Greedy answers with and without prefix caching: identical." in text
    assert "## tiny, multiturn workload (shared)" in text and "**n/a**: too short" in text
    rows = [f.row() for e in saved for f in feature_figures(e)]
    assert summary_lines(rows)[-1].startswith("6 passed, 0 missed")


def test_a_workload_that_raises_anything_is_recorded_as_failed_and_the_run_goes_on(monkeypatch, tmp_path) -> None:
    from http.client import BadStatusLine

    from bench import multiturn, structured
    from bench.pairs import Pair

    def crash(*args: object, **kwargs: object) -> None:
        raise BadStatusLine("\x00\x00\x12\x04")  # what a router port taken by a gRPC server gave

    monkeypatch.setattr(structured, "measure", crash)
    monkeypatch.setattr(multiturn, "measure", crash)
    pair = Pair(tmp_path / "demo")
    monkeypatch.setattr(Pair, "max_model_len", property(lambda self: 2048))
    entries = features.run_features(pair, ["structured", "multiturn"], True, 0, tmp_path, {}, say=lambda _: None)
    assert [(e["workload"], e["status"]) for e in entries] == [("structured", "failed"), ("multiturn", "failed")]
    assert all("BadStatusLine" in e["reason"] for e in entries)
    saved = report.save_partial(tmp_path, entries[0])
    assert saved.name == "demo-shared-structured.json" and json.loads(saved.read_text())["status"] == "failed"


@pytest.mark.slow
def test_bench_runs_the_feature_workloads_on_a_real_stack(model_pair, tmp_path: Path) -> None:
    """python -m bench --workloads structured,multiturn,predicted on the tiny pair: each runs on a real stack, their
    figures and sections are written and the run succeeds (their numbers mean nothing here)."""
    from bench.__main__ import main

    target, _ = model_pair
    out = tmp_path / "out"
    assert main(["--quick", "--models", str(target.parent), "--mode", "shared", "--workloads",
                 "structured,multiturn,predicted", "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["runs"] == [] and [e["workload"] for e in data["features"]] == ["structured", "multiturn",
                                                                                  "predicted"]
    assert all(e["status"] == "ran" for e in data["features"])
    assert {r["issue"] for r in data["figures"]} == {"#17", "#18"}
    structured = data["features"][0]["results"]["json_schema"]
    assert structured["valid_json"] == structured["requests"]
    assert data["features"][1]["results"]["answers_identical"]
    assert "structured workload" in (out / "results.md").read_text()
    assert data["features"][2]["results"]["differences"] == {"exact": [], "edited": []}, "a prediction changes no token"
