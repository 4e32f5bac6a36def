"""Build the SmolLM2 pair: target converted from the pinned GGUF, draft distilled locally,
both measured, gated and only then installed in OUT (cached by the settings hash).

    OUT/.source/     the GGUF (kept: a rebuild does not fetch it again)
    OUT/.building/   work in progress: the converted target, the labelled data, the draft
    OUT/target, OUT/draft, OUT/report.json   a finished pair that met its gates
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from demo_models.build import BuildFailed, install
from demo_models.corpus import load_corpus
from demo_models.precision import native_bf16, use_bf16
from demo_models.report import load_report, save_report

from . import distill, evaluate, smollm2
from .data import label_data, make_prompts, read_code
from .report import format_report
from .settings import VARIANTS, DraftSettings, library_versions, settings_hash

NEEDED = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def is_complete(out: Path) -> bool:
    return all((out / m / f).is_file() for m in ("target", "draft") for f in NEEDED) and (out / "report.json").is_file()


def build(
    variant: str | DraftSettings = "full",
    out_dir: str = "models/smollm2",
    force: bool = False,
    time_caps: bool = True,
    precision: str = "auto",
    allow_partial: bool = False,
    progress: bool = True,
    log=print,
    source_dir: str | None = None,
) -> tuple[dict, bool]:
    """Build (or reuse) the pair in ``out_dir``; returns (report, cached). Raises BuildFailed,
    with nothing installed, when the pair misses a gate, unless ``allow_partial``. The GGUF is
    kept in ``source_dir`` (default OUT/.source)."""
    s = VARIANTS[variant] if isinstance(variant, str) else variant
    if not time_caps:
        s = dataclasses.replace(s, labelling_max_seconds=0.0, reading_max_seconds=0.0,
                                train=dataclasses.replace(s.train, max_seconds=0.0))
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    try:
        source = Path(source_dir) if source_dir else Path(out_dir) / ".source"
        return _build(s, Path(out_dir), source, force, use_bf16(precision), allow_partial, progress, log)
    finally:
        torch.set_num_threads(threads)


def _build(s: DraftSettings, out: Path, source: Path, force: bool, bf16: bool, allow_partial: bool, progress: bool,
           log):
    t_start = time.perf_counter()
    corpus = load_corpus(s.max_file_bytes, s.max_total_bytes, s.heldout_percent)
    digest = settings_hash(s, smollm2.GGUF_SHA256, corpus.fingerprint, bf16)
    if not force and is_complete(out):
        old = load_report(str(out / "report.json"))
        if old.get("settings_hash") == digest:
            log(f"cached: {out} was built with the same settings ({digest}); nothing to do")
            if old.get("partial"):
                log("warning: that build missed its quality gates (installed with --allow-partial); --force rebuilds")
            return old, True
    gguf = smollm2.obtain_gguf(source, log)
    work = out / ".building"
    work.mkdir(parents=True, exist_ok=True)
    log(f"building the SmolLM2 pair '{s.variant}' into {out} (settings {digest}; training in "
        f"{'bf16 autocast' if bf16 else 'fp32'}, native bf16: {native_bf16()})")
    seconds: dict[str, float] = {}

    # 1. The target: converted once, checked against transformers' own load of the GGUF.
    t0 = time.perf_counter()
    target_dir = work / "target"
    marker = work / "target.json"
    if marker.is_file() and json.loads(marker.read_text()).get("gguf_sha256") == smollm2.GGUF_SHA256:
        conversion = json.loads(marker.read_text())
        log(f"reusing the converted target in {target_dir}")
    else:
        smollm2.convert_target(gguf, target_dir, progress)
        log("checking the conversion against transformers' own GGUF load" if s.verify_target else "converted")
        checked = smollm2.verify_target(target_dir, gguf) if s.verify_target else {"skipped": True}
        conversion = {"gguf_sha256": smollm2.GGUF_SHA256, "source": f"{smollm2.PACKAGE}=={smollm2.VERSION}",
                      "verification": checked}
        marker.write_text(json.dumps(conversion, indent=2))
    seconds["target_conversion"] = round(time.perf_counter() - t0, 1)

    # 2. Prompts and the target's labelled continuations (kept as a stage: the longest step).
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(target_dir)
    stage = work / "data.pt"
    data = torch.load(stage, weights_only=False) if stage.is_file() else None
    if data is None or data.get("settings_hash") != digest:
        prompts = make_prompts(s, str(target_dir), tok, corpus, progress)
        data = {"settings_hash": digest, **label_data(s, str(target_dir), prompts, progress)}
        data["read"], data["info"]["read"] = read_code(s, str(target_dir), tok, corpus, progress)
        torch.save(data, stage)
    else:
        log(f"reusing the labelled data in {stage}")
    seconds["prompts_and_labels"] = round(time.perf_counter() - t0, 1)

    # 3. The draft: cut from the target, distilled on the target's continuations.
    t0 = time.perf_counter()
    train = data["train"]
    always = sorted({tok.eos_token_id, tok.bos_token_id, tok.pad_token_id})
    code = tok([f.text for f in corpus.train], add_special_tokens=False).input_ids  # a second frequency source
    head_ids = distill.most_frequent_tokens([[g.output for g in train], code], s.head_vocab, always)
    config, weights = distill.cut_draft(target_dir, s.layers, head_ids)
    weights["model.norm.weight"] = weights["model.norm.weight"] * s.norm_scale
    model = distill.build_model(config, weights)
    training = distill.distill(model, train + data["read"], s.train, s.loss, s.seed + 10, bf16)
    distill.save_draft(config, distill.trained_weights(model), target_dir, work / "draft")
    del model, weights
    seconds["draft_distillation"] = round(time.perf_counter() - t0, 1)

    # 4. Measured from disk, on held-out prompts, with the engine that serves the pair.
    t0 = time.perf_counter()
    report_eval = measure(s, work, data, head_ids)
    seconds["measurement"] = round(time.perf_counter() - t0, 1)
    seconds["total"] = round(time.perf_counter() - t_start, 1)

    report = {
        "settings_hash": digest,
        "variant": s.variant,
        "settings": dataclasses.asdict(s),
        "versions": library_versions(),
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "processor": platform.processor() or platform.machine(), "native_bf16": native_bf16()},
        "training_precision": "bf16 autocast" if bf16 else "fp32",
        "target": {"source": conversion["source"], "gguf_sha256": smollm2.GGUF_SHA256,
                   "params": distill.num_params(target_dir), "verification": conversion["verification"],
                   "storage": "fp16 matrices, fp32 norms"},
        "draft": {"params": distill.num_params(work / "draft"), "layers_from_target": list(s.layers),
                  "head_vocab": len(head_ids), "data": data["info"], "training": training},
        **report_eval,
        "seconds": seconds,
    }
    report["gates"] = check_gates(s, report)
    report["partial"] = not all(g["ok"] for g in report["gates"])
    save_report(str(work / "report.json"), report)
    log(format_report(report))
    if report["partial"] and not allow_partial:
        missed = "; ".join(g["text"] for g in report["gates"] if not g["ok"])
        raise BuildFailed(f"the SmolLM2 pair missed its quality gates ({missed}); it is left in {work} and "
                          f"NOT installed in {out}. --allow-partial installs it anyway.")
    for f in ("data.pt", "target.json"):
        (work / f).unlink(missing_ok=True)
    install(str(work), str(out))
    return load_report(str(out / "report.json")), False


def measure(s: DraftSettings, work: Path, data: dict, head_ids: list[int]) -> dict:
    """Acceptance at k = 1..k_max on held-out chat and code, head coverage, and the per-token
    decode cost ratio by transformers and by the engine."""
    target_dir, draft_dir = str(work / "target"), str(work / "draft")
    longest = max(len(g.prompt) + len(g.output) for part in ("eval_chat", "eval_code") for g in data[part])
    runner = evaluate.make_runner(draft_dir, 64 * (longest + s.eval_k_max + 16), 8192)
    head = set(head_ids)
    acceptance = {}
    for part in ("chat", "code"):
        gens = data[f"eval_{part}"]
        rows = evaluate.match_lengths(runner, [g.prompt for g in gens], [g.output for g in gens], s.eval_k_max, 64)
        n_tokens = sum(len(g.output) for g in gens)
        acceptance[part] = {
            "prompts": len(gens),
            "target_tokens": n_tokens,
            "head_coverage": round(sum(t in head for g in gens for t in g.output) / n_tokens, 4),
            "draft_top1_agreement": round(evaluate.top1_agreement(rows), 4),
            "per_k": evaluate.acceptance_table(rows, s.eval_k_max),
        }
    both = [*data["eval_chat"], *data["eval_code"]]
    context = (both[0].prompt + both[0].output) * (1 + s.cost_context // max(1, len(both[0].prompt)))
    context = context[: s.cost_context]
    cost = {"transformers": evaluate.transformers_decode_cost_ms(target_dir, draft_dir, context, s.cost_repeats),
            "engine": evaluate.engine_decode_cost_ms(target_dir, draft_dir, context, s.cost_repeats)}
    return {"acceptance": acceptance, "cost": cost}


def check_gates(s: DraftSettings, report: dict) -> list[dict]:
    phases = {"labelling": report["draft"]["data"], "reading": report["draft"]["data"]["read"],
              "draft training": report["draft"]["training"]}
    capped = [name for name, x in phases.items() if x["stopped_by_time_cap"]]
    note = f" (time cap stopped: {', '.join(capped)})" if capped else ""
    gates = []
    for part, acc in report["acceptance"].items():
        a = next(r["acceptance_rate"] for r in acc["per_k"] if r["k"] == 4)
        gates.append({"name": f"acceptance_k4_{part}", "value": a, "min": s.gate_acceptance_k4,
                      "ok": a >= s.gate_acceptance_k4,
                      "text": f"{part} acceptance at k=4 {a:.3f}, need >= {s.gate_acceptance_k4}{note}"})
    for how, c in report["cost"].items():
        r = c["ratio_target_over_draft"]
        gates.append({"name": f"cost_ratio_{how}", "value": r, "min": s.gate_cost_ratio, "ok": r >= s.gate_cost_ratio,
                      "text": f"target/draft decode cost by {how} {r:.1f}x, need >= {s.gate_cost_ratio}x{note}"})
    return gates

