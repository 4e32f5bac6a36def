"""The bench harness's own logic: pinning command lines, plans per pair, workloads, the issues'
figures and the report. No timing is asserted here: speed is measured only by `make bench`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench import anchor, prom, report
from bench.figures import Figure, figures, summary_lines
from bench.modes import Mode, ModeUnavailable, PinnedStack, cpu_seconds, make_mode
from bench.pairs import Pair, find_pairs
from bench.plans import PROFILES, profile_for
from bench.workloads import WORKLOADS, build_pool
from tests.conftest import write_tokenizer

# ---- modes --------------------------------------------------------------------------------------


def test_two_device_pins_target_alone_and_the_rest_on_the_other_core() -> None:
    m = make_mode("two-device", cpus={2, 5, 7}, taskset="/usr/bin/taskset")
    assert m.prefix("target") == ["taskset", "-c", "2"] == m.prefix("anchor")
    assert m.prefix("draft") == m.prefix("router") == ["taskset", "-c", "5"]
    assert m.cpu_of("client") == 5
    assert m.service_args() == ["--threads", "1"]


def test_shared_mode_pins_nothing() -> None:
    m = make_mode("shared")
    assert m.prefix("target") == m.prefix("draft") == m.prefix("router") == []
    assert m.service_args() == [] and m.threads == 0


def test_two_device_refused_clearly() -> None:
    with pytest.raises(ModeUnavailable, match="taskset"):
        make_mode("two-device", cpus={0, 1}, taskset=None)
    with pytest.raises(ModeUnavailable, match="impossible.*1 core"):
        make_mode("two-device", cpus={0}, taskset="/usr/bin/taskset")
    with pytest.raises(ValueError):
        make_mode("three-device")


def test_pinned_stack_prefixes_each_process(monkeypatch, tmp_path: Path) -> None:
    seen = {}

    class FakePopen:
        def __init__(self, cmd: list[str], **kwargs: object) -> None:
            seen[cmd[cmd.index("-m") + 1]] = cmd

    monkeypatch.setattr("router.stack.subprocess.Popen", FakePopen)
    mode = Mode("two-device", threads=1, target_cpu=0, host_cpu=1)
    stack = PinnedStack(tmp_path / "t", tmp_path / "d", service_args=mode.service_args(), mode=mode)
    stack.start_service("target")
    stack.start_service("draft")
    stack.start_router()
    assert seen["target_service"][:3] == ["taskset", "-c", "0"]
    assert seen["draft_service"][:3] == ["taskset", "-c", "1"]
    assert seen["router"][:3] == ["taskset", "-c", "1"]
    assert seen["target_service"][-2:] == ["--threads", "1"]


def test_cpu_seconds_counts_what_a_process_has_burnt_and_nothing_once_it_is_gone() -> None:
    spin = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint(flush=True)\n" \
           "sys.stdin.read()"
    p = subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        p.stdout.readline()
        assert cpu_seconds(p.pid) >= 0.3
    finally:
        p.communicate("")
    assert cpu_seconds(p.pid) == 0.0


# ---- pairs and plans ----------------------------------------------------------------------------


def _work(plan) -> int:  # noqa: ANN001
    mean_out = sum(plan.out_tokens) / 2
    return int(sum(ld.n_requests for ld in plan.loads) * mean_out)


def test_profiles_by_name_then_by_size() -> None:
    assert profile_for("demo", 10).name == "demo"
    assert profile_for("smollm2", 10).name == "smollm2"
    assert profile_for("tiny", 139_584).name == "demo"
    assert profile_for("smollm2-tiny", 134_515_008).name == "smollm2"


def test_plans_scale_with_the_pair_speed() -> None:
    demo, smol = PROFILES["demo"], PROFILES["smollm2"]
    assert _work(smol.full) < _work(demo.full) / 2  # the slower target gets much less to do
    for p in (demo, smol):
        assert _work(p.quick) < _work(p.full)
        assert {"c1", "c4", "c16"} <= {ld.name for ld in p.full.loads}  # the loads the figures quote
        assert p.full.mixed in {ld.name for ld in p.full.loads}
    assert {w for w, _ in smol.full.mix} == {"chat", "code"}
    assert (demo.pipelining_min, smol.pipelining_min) == (1.15, 1.3)


def _fake_pair(root: Path, chat: bool) -> Path:
    for part in ("target", "draft"):
        d = root / part
        write_tokenizer(d)
        (d / "config.json").write_text(json.dumps({"max_position_embeddings": 1024, "vocab_size": 320}))
        if chat:
            cfg = json.loads((d / "tokenizer_config.json").read_text())
            cfg["chat_template"] = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                                    "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
            (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (root / "report.json").write_text(json.dumps({"variant": "test", "settings": {
        "max_file_bytes": 50_000, "max_total_bytes": 400_000, "heldout_percent": 10}}))
    return root


def test_missing_pair_is_skipped_with_how_to_build(tmp_path: Path) -> None:
    pairs, skipped = find_pairs([_fake_pair(tmp_path / "demo", False), tmp_path / "smollm2"])
    assert [p.name for p in pairs] == ["demo"]
    assert len(skipped) == 1 and "model_zoo" in skipped[0] and "skipping" in skipped[0]


def test_pool_mixes_chat_and_code_with_the_pairs_tokenizer(tmp_path: Path) -> None:
    pair = Pair(_fake_pair(tmp_path / "chatty", True))
    plan = PROFILES["smollm2"].quick
    pool, notes = build_pool(pair, plan, 256, seed=0)
    assert notes == [] and len(pool) == plan.pool_size
    assert [p.pid for p in pool] == list(range(plan.pool_size))
    chat = [p for p in pool if p.workload == "chat"]
    assert len(chat) == plan.pool_size // 2 and len({tuple(p.ids) for p in chat}) == len(chat)
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(pair.target / "tokenizer.json")).decode(chat[0].ids, skip_special_tokens=False)
    assert text.startswith("<s>user\n") and text.endswith("<s>assistant\n")
    assert all(len(p.ids) + p.max_tokens + 16 <= pair.max_model_len for p in pool)
    again, _ = build_pool(pair, plan, 256, seed=0)
    assert [p.ids for p in again] == [p.ids for p in pool]  # same prompts in every mode and run


def test_chat_falls_back_to_code_without_a_template(tmp_path: Path) -> None:
    pair = Pair(_fake_pair(tmp_path / "plain", False))
    pool, notes = build_pool(pair, PROFILES["smollm2"].quick, 256, seed=0)
    assert {p.workload for p in pool} == {"code"} and "chat" in notes[0]
    assert set(WORKLOADS) >= {"chat", "code"}


# ---- figures, metrics, report -------------------------------------------------------------------


def _summary(tps: float, **engine: float) -> dict:
    return {"tokens_per_s": tps, "errors": 0, "requests": 1, "requests_per_s": 1.0, "ttft_ms": {"p50": 1, "p99": 2},
            "itl_ms": {"p50": 1, "p90": 1, "p99": 2}, "e2e_s": {"p50": 1, "p99": 1}, "engine": engine}


def _results() -> dict:
    eng = {"pipeline_hit_rate": 0.85, "pipeline_miss_late": 0.1, "pipeline_miss_wrong": 0.05,
           "router_over_target": 0.08, "router_ms_per_step": 0.8, "target_ms_per_step": 10.0}
    per = {"1": 100.0, "2": 90.0, "3": 120.0, "4": 100.0, "5": 125.0, "6": 124.0, "hf": 110.0}
    return {c: {load: _summary(v * (2 if load == "c16" else 1), **eng) for load in ("c1", "c4", "c16")}
            for c, v in per.items()}


def _by_what(figs: list[Figure]) -> dict[str, Figure]:
    return {f.what: f for f in figs}


def test_figures_two_device_smollm2() -> None:
    figs = _by_what(figures("smollm2", "two-device", _results(), PROFILES["smollm2"]))
    f = figs["pipelined (5) / sequential (4) tokens/s at c=1"]
    assert f.value == pytest.approx(1.25) and f.threshold == 1.3 and f.status == "MISSED"
    assert "MISSED by 0.05x" in f.verdict()
    best = figs["defaults (6) / best config (5) tokens/s at c=1"]
    assert best.value == pytest.approx(124 / 125) and best.status == "pass"
    assert figs["single stream: defaults (6) / target-only (1) tokens/s"].status == "MISSED"  # 1.24 < 1.6
    assert figs["single stream: defaults (6) / transformers assisted generation tokens/s"].status == "pass"
    assert figs["pipeline hit rate, (5) at c=16"].status == "pass"
    assert figs["router+RPC / target ms per step, (6) at c=1"].status == "pass"
    assert len([f for f in figs if "target-only (1) tokens/s at" in f]) == 3  # every load


def test_figures_shared_demo_and_missing_configs() -> None:
    res = _results()
    del res["4"]
    res["6"]["c16"]["engine"]["router_over_target"] = 0.2
    figs = figures("demo", "shared", res, PROFILES["demo"])
    whats = {f.what for f in figs}
    assert not any("sequential" in w or "single stream" in w for w in whats)  # two-device / SmolLM2 only
    over = _by_what(figs)["router+RPC / target ms per step, (6) at c=16"]
    assert over.status == "MISSED" and "2.0x the limit" in over.verdict()
    res2 = {"1": res["1"]}
    nan = figures("demo", "two-device", res2, PROFILES["demo"])
    assert all(f.status == "n/a" for f in nan if "(6)" in f.what or "(5)" in f.what)
    assert summary_lines([f.row() for f in nan])[-1].startswith("0 passed")


def test_prom_derive_splits_misses_and_router_share() -> None:
    st = "tandem:step_time_seconds"
    d = {(f"{st}_count", (("part", "target"),)): 10.0, (f"{st}_sum", (("part", "target"),)): 0.2,
         (f"{st}_sum", (("part", "router"),)): 0.01, (f"{st}_sum", (("part", "draft"),)): 0.0,
         ("tandem:pipeline_lookups_total", ()): 20.0, ("tandem:pipeline_hits_total", ()): 15.0,
         ("tandem:pipeline_misses_total", (("reason", "late"),)): 4.0,
         ("tandem:pipeline_misses_total", (("reason", "wrong"),)): 1.0, ("tandem:chained_steps_total", ()): 4.0,
         ("tandem:pipeline_misses_total", (("reason", "unasked"),)): 2.0,
         ("tandem:pipeline_fills_total", ()): 3.0, ("tandem:upfront_steps_total", ()): 5.0,
         ("tandem:unchained_steps_total", (("reason", "draft_late"), ("replica", "t"))): 3.0,
         ("tandem:unchained_steps_total", (("reason", "plan"), ("replica", "t"))): 2.0,
         ("tandem:draft_rests_total", (("reason", "probe"),)): 1.0}
    e = prom.derive(d, wall=1.0)
    assert e["draft_rests_probe"] == 0.1 and e["draft_rests_busy"] == 0.0
    assert e["chained_share"] == 0.4 and e["unchained_draft_late"] == 0.3 and e["unchained_plan"] == 0.2
    assert e["unchained_no_draft_call"] == 0.0
    g = prom.gauges({("tandem:draft_slowdown", (("replica", "t"),)): 1.3,
                     ("tandem:spec_decode_pooled_acceptance", (("proposer", "draft"), ("replica", "t"))): 0.25,
                     ("tandem:spec_decode_pooled_acceptance", (("proposer", "lookup"), ("replica", "t"))): 0.5})
    assert g == {"draft_slowdown": 1.3, "pooled_acceptance_draft": 0.25, "pooled_acceptance_lookup": 0.5}
    assert e["pipeline_hit_rate"] == 0.75 and e["pipeline_miss_late"] == 0.2 and e["pipeline_miss_wrong"] == 0.05
    assert e["pipeline_miss_unasked"] == 0.1
    assert e["pipeline_fills"] == 0.15 and e["upfront_share"] == 0.5
    assert e["target_ms_per_step"] == pytest.approx(20.0) and e["router_over_target"] == pytest.approx(0.05)


def test_report_renders_and_writes_strict_json(tmp_path: Path) -> None:
    res = _results()
    res["6"]["c1"]["engine"]["pipeline_hit_rate"] = math.nan
    res["6"]["c1"]["cpu_busy"] = {"target": 0.95, "draft": 0.4, "router": 0.1, "client": 0.05}
    loads = [{"name": n, "label": n, "kind": "closed", "n_requests": 1, "concurrency": 1, "rate_frac": 0.0}
             for n in ("c1", "c4", "c16")]
    data = {"meta": {"command": "python -m bench", "date": "today", "quick": True, "budget": 256, "k_max": 4,
                     "seed": 0, "modes": ["two-device"], "skipped": ["models/smollm2: no target/config.json"],
                     "seconds": 60.0, "machine": {"cpus": 2, "cpu_model": "x", "torch": "2", "python": "3",
                                                  "loadavg_start": [0], "loadavg_end": [0]}},
            "configs": [{"key": k, "name": f"config {k}", "flags": [], "draft": True} for k in res],
            "pairs": {"demo": {"facts": {"dir": "models/demo", "variant": "full", "target_params": 8e6,
                                         "draft_params": 1e6, "draft_vocab_size": None, "vocab_size": 4096,
                                         "max_model_len": 1024},
                               "profile": "demo", "notes": [], "plan": {"loads": loads, "out_tokens": [8, 16],
                                                                        "mixed": "c4"},
                               "workload": {"prompts": 1, "by_kind": {"short": {"n": 1, "min": 3, "max": 3}}},
                               "correctness": {"answers_compared": 7, "prompts": 1, "mismatches": 0}}},
            "runs": [{"pair": "demo", "mode": "two-device", "pinning": "two-device: ...", "capacity_req_s": 1.0,
                      "mixed": "c4", "anchor_agreement": "1/1", "seconds": 60.0, "failures": ["(3): hung"],
                      "results": res}],
            "figures": [f.row() for f in figures("demo", "two-device", res, PROFILES["demo"])]}
    js, md = report.write(tmp_path, data, {"itl_samples": {}, "requests": {}})
    json.loads(js.read_text())  # strict: NaN written as null
    text = md.read_text()
    assert "## Figures the issues ask for" in text and "## demo, two-device" in text
    assert "**Skipped**" in text and "**Did not run** (3): hung" in text
    assert "| pipelined (5) / sequential (4) tokens/s at c=1 | 1.25x | >= 1.15x | pass |" in text
    assert "demo-two-device-itl_cdf.png" in text
    assert "| 0.95 / 0.40 / 0.10 / 0.05 |" in text  # cores each process kept busy during the load
    saved = json.loads(js.read_text())["figures"]
    assert [Figure.from_row(r).status for r in saved] == [r["status"] for r in data["figures"]]


# ---- the anchor ---------------------------------------------------------------------------------


def test_anchor_process_entry_matches_transformers_greedy(model_pair, tmp_path: Path) -> None:
    from bench.workloads import Prompt
    from tests.conftest import hf_greedy

    target, _ = model_pair
    prompts = [Prompt(0, [5, 9, 17, 33, 2], 6, "short", "test"), Prompt(1, list(range(3, 40)), 5, "medium", "test")]
    src, dst = tmp_path / "in.json", tmp_path / "out.json"
    src.write_text(json.dumps([p.__dict__ for p in prompts]))
    assert anchor.main(["--models", str(target.parent), "--prompts", str(src), "--out", str(dst)]) == 0
    rows = {r["pid"]: r for r in json.loads(dst.read_text())}
    for p in prompts:
        assert rows[p.pid]["tokens"] == hf_greedy(target, p.ids, p.max_tokens)
        assert rows[p.pid]["error"] is None and rows[p.pid]["ttft"] <= rows[p.pid]["e2e"]


def test_greedy_answers_are_compared_across_configs_and_with_the_anchor_at_their_first_differing_token():
    from bench.client import RequestResult
    from bench.stats import Correctness

    check = Correctness()
    check.check("(1) c1", [RequestResult(0, 0.0, tokens=[1, 2, 3, 4]), RequestResult(1, 0.0, tokens=[5, 6])])
    check.check("(6) c1", [RequestResult(0, 0.0, tokens=[1, 2, 9, 4]), RequestResult(1, 0.0, tokens=[5, 6])])
    assert check.report()["mismatches"] == 1 and check.mismatches[0]["first_diff_at"] == 2
    served = {0: RequestResult(0, 0.0, tokens=[1, 2, 3, 4]), 1: RequestResult(1, 0.0, tokens=[5, 6, 7])}
    same, diffs = check.against_anchor(served)
    assert same == 1
    assert diffs == [{"pid": 1, "first_diff_at": 2, "tandem": [5, 6], "anchor": [5, 6, 7]}]


# ---- a run that is stopped --------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    """Every live process descended from pid (from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, parent in parents.items() if parent == p]
        out += kids
        frontier += kids
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_run_stopped_with_sigterm_stops_the_stack_it_started(model_pair, tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    target, _ = model_pair
    run = subprocess.Popen([sys.executable, "-m", "bench", "--quick", "--models", str(target.parent), "--mode",
                            "shared", "--configs", "1", "--loads", "c1", "--workloads", "main", "--out",
                            str(tmp_path / "out")], cwd=Path(__file__).resolve().parent.parent,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    servers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(servers := _children(run.pid)) < 2 and time.monotonic() < deadline:  # target + router
            time.sleep(0.2)
        assert len(servers) >= 2, "the run never started its stack"
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{p}").exists() for p in servers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in servers if Path(f"/proc/{p}").exists()], "a server outlived the run"
    finally:
        for p in servers:  # orphans of a failed run belong to init by now, not to it
            subprocess.run(["kill", "-9", str(p)], check=False, stderr=subprocess.DEVNULL)
        run.kill()


# ---- rounds ------------------------------------------------------------------------------------


def test_each_figure_comes_from_the_median_round_of_its_config_and_load() -> None:
    from bench.runner import LoadRun
    from bench.suite import median_round

    def run(tps: float) -> LoadRun:
        return LoadRun(load=None, results=[], summary={"tokens_per_s": tps, "ttft_p50": tps / 10}, itl=[])  # type: ignore[arg-type]

    runs = [run(120.0), run(80.0), run(100.0)]
    assert median_round(runs) is runs[2]
    assert median_round(runs[:2]) is runs[1], "an even count: the lower middle, a real run, not an average"
    assert median_round(runs[:1]) is runs[0]


@pytest.mark.slow
def test_rounds_run_every_config_in_turn_and_keep_every_round_s_tokens_per_s(model_pair, tmp_path: Path) -> None:
    from bench.__main__ import main

    target, _ = model_pair
    out = tmp_path / "out"
    assert main(["--quick", "--models", str(target.parent), "--mode", "shared", "--configs", "1,7", "--loads", "c1",
                 "--workloads", "main", "--rounds", "2", "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["rounds"] == 2
    [run] = data["runs"]
    for key in ("1", "7"):
        c1 = run["results"][key]["c1"]
        rounds = c1["rounds_tokens_per_s"]
        assert len(rounds) == 2 and c1["tokens_per_s"] == min(rounds), "the lower middle of two rounds"
    assert "ran 2 times in turn" in (out / "results.md").read_text()
    assert main(["--rounds", "0"]) == 2


def test_the_printed_time_estimate_scales_with_the_loads_configs_and_rounds_asked_for() -> None:
    from bench import plans
    from bench.stats import CONFIGS
    from bench.suite import PairWork, estimate_minutes

    profile = plans.PROFILES["demo"]
    plan = profile.plan(False)

    def work(names: set[str] | None) -> PairWork:
        chosen = [ld for ld in plan.loads if names is None or ld.name in names]
        return PairWork(None, profile, plan, [], [(ld, [], []) for ld in chosen], [])  # type: ignore[arg-type]

    whole = estimate_minutes(work(None), "shared", False, len(CONFIGS), True, 1)
    assert whole == pytest.approx(profile.minutes["shared"])
    c1 = next(ld for ld in plan.loads if ld.name == "c1")
    share = c1.n_requests / sum(ld.n_requests for ld in plan.loads)
    assert estimate_minutes(work({"c1"}), "shared", False, 3, False, 3) == pytest.approx(
        profile.minutes["shared"] * share * 9 / (len(CONFIGS) + 0.5))
