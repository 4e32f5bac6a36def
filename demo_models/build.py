"""Build orchestration: corpus -> tokenizer -> target -> distilled draft -> save -> measure,
cached by the settings hash (settings.py)."""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from . import evaluate, train
from .corpus import load_corpus
from .precision import native_bf16, use_bf16
from .report import format_report, load_report, save_report
from .settings import VARIANTS, Settings, library_versions, settings_hash
from .tokenizer import BOS_ID, EOS_ID, PAD_ID, copy_tokenizer, encode_documents, save_tokenizer, train_tokenizer

__all__ = ["VARIANTS", "BuildFailed", "build"]


class BuildFailed(RuntimeError):
    """The pair missed a quality gate; nothing was installed where `make run` would pick it up."""


def is_complete(out_dir: str) -> bool:
    need = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
    return all(os.path.isfile(os.path.join(out_dir, sub, f)) for sub in ("target", "draft") for f in need)


def save_model(model, out_dir: str) -> None:
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.dtype = "float32"
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    )
    model.float().save_pretrained(out_dir)
    # safetensors writes 0600; models are read by other users too (containers, services)
    os.chmod(os.path.join(out_dir, "model.safetensors"), 0o644)


def load_saved(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def build(
    variant: str | Settings,
    out_dir: str,
    force: bool = False,
    time_caps: bool = True,
    log=print,
    precision: str = "auto",
    allow_partial: bool = False,
) -> tuple[dict, bool]:
    """Build (or reuse) the pair in ``out_dir``. Returns (report, cached): ``cached`` is True
    when an existing build with the same settings hash was returned without retraining.
    ``time_caps=False`` lifts the safety caps on training time (full schedule, however slow).
    ``precision``: auto (bf16 autocast only on a CPU with native bf16), fp32 or bf16.
    A pair that misses its quality gates raises BuildFailed and is left in OUT/.building, not
    installed, unless ``allow_partial``."""
    settings = VARIANTS[variant] if isinstance(variant, str) else variant
    if not time_caps:
        settings = dataclasses.replace(
            settings,
            target_train=dataclasses.replace(settings.target_train, max_seconds=0.0),
            draft_train=dataclasses.replace(settings.draft_train, max_seconds=0.0),
            distill_max_seconds=0.0,
        )
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        return _build(settings, out_dir, force, log, use_bf16(precision), allow_partial)
    finally:
        torch.set_num_threads(threads)


def _build(settings: Settings, out_dir: str, force: bool, log, bf16: bool, allow_partial: bool) -> tuple[dict, bool]:
    variant = settings.variant
    t_start = time.perf_counter()
    corpus = load_corpus(settings.max_file_bytes, settings.max_total_bytes, settings.heldout_percent)
    digest = settings_hash(settings, corpus.fingerprint, bf16)
    report_path = os.path.join(out_dir, "report.json")
    if not force and os.path.isfile(report_path) and is_complete(out_dir):
        old = load_report(report_path)
        if old.get("settings_hash") == digest:
            log(f"cached: {out_dir} was built with the same settings ({digest}); nothing to do")
            if old.get("partial"):
                log("warning: that build missed its quality gates (installed with --allow-partial); --force rebuilds")
            return old, True
    # Everything is built in OUT/.building and moved into OUT only once it passed its gates.
    work = os.path.join(out_dir, ".building")
    os.makedirs(work, exist_ok=True)
    log(f"building the {variant} pair into {out_dir} (settings {digest}; training in "
        f"{'bf16 autocast' if bf16 else 'fp32'}, native bf16: {native_bf16()})")

    # Tokenizer, then the corpus as token streams.
    t0 = time.perf_counter()
    tok = train_tokenizer([f.text for f in corpus.train], settings.vocab_size)
    train_stream = torch.tensor([i for d in encode_documents(tok, [f.text for f in corpus.train]) for i in d])
    heldout_stream = torch.tensor([i for d in encode_documents(tok, [f.text for f in corpus.heldout]) for i in d])
    tok_seconds = time.perf_counter() - t0
    log(
        f"corpus: {len(corpus.train)} train / {len(corpus.heldout)} held-out files, "
        f"{train_stream.numel()} / {heldout_stream.numel()} tokens"
    )

    # Target: trained on the corpus. The trained target is kept as a stage until the build is
    # complete, so an interrupted build resumes after the longest step instead of redoing it.
    stage_dir = os.path.join(work, "stage-target")
    stage_marker = os.path.join(stage_dir, "stage.json")
    if os.path.isfile(stage_marker) and load_report(stage_marker).get("settings_hash") == digest:
        log(f"resuming: reusing the trained target in {stage_dir}")
        target = load_saved(stage_dir)
        target_info = load_report(stage_marker)["training"]
    else:
        target = train.make_model(settings.target_shape, tok.get_vocab_size(), settings.max_positions, settings.seed)
        target_info = train.train_target(target, train_stream, settings.target_train, settings.seed + 1, bf16)
        save_model(target, stage_dir)
        save_report(stage_marker, {"settings_hash": digest, "training": target_info})

    # Draft: distilled from the target, mostly on its own greedy continuations of corpus prompts.
    data, data_info = train.build_distill_set(
        target,
        train_stream,
        settings.distill_generated,
        settings.distill_corpus,
        settings.distill_seq_len,
        settings.distill_prompt_lens,
        settings.distill_gen_batch,
        settings.distill_top_k,
        settings.seed + 2,
        settings.distill_max_seconds,
    )
    draft = train.make_model(settings.draft_shape, tok.get_vocab_size(), settings.max_positions, settings.seed + 3)
    draft_info = train.distill_draft(
        draft, data, settings.draft_train, settings.seed + 4, settings.hard_weight, settings.soft_weight, bf16
    )
    del data

    # Save both in Hugging Face format with byte-identical tokenizer files.
    save_model(target, os.path.join(work, "target"))
    save_model(draft, os.path.join(work, "draft"))
    save_tokenizer(tok, os.path.join(work, "target"), settings.max_positions)
    copy_tokenizer(os.path.join(work, "target"), os.path.join(work, "draft"))
    train_seconds = time.perf_counter() - t_start
    del target, draft

    # Measure what was saved, loaded back through transformers.
    log("measuring the saved pair")
    t0 = time.perf_counter()
    target = load_saved(os.path.join(work, "target"))
    draft = load_saved(os.path.join(work, "draft"))
    ce_len = min(256, settings.max_positions)
    t_ce = evaluate.heldout_cross_entropy(target, heldout_stream, ce_len, settings.eval_ce_tokens)
    d_ce = evaluate.heldout_cross_entropy(draft, heldout_stream, ce_len, settings.eval_ce_tokens)
    agreement = evaluate.top1_agreement_on_text(target, draft, heldout_stream, ce_len, settings.eval_ce_tokens)
    acceptance = evaluate.acceptance_table(
        target,
        draft,
        heldout_stream,
        settings.eval_prompts,
        settings.eval_prompt_len,
        settings.eval_new_tokens,
        settings.eval_k_max,
        settings.seed + 5,
    )
    cost = evaluate.decode_cost_ms(target, draft, heldout_stream[: settings.cost_context], settings.cost_repeats)
    eval_seconds = time.perf_counter() - t0

    report = {
        "settings_hash": digest,
        "variant": variant,
        "settings": dataclasses.asdict(settings),
        "versions": library_versions(),
        "machine": {
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "processor": platform.processor() or platform.machine(),
            "native_bf16": native_bf16(),
        },
        "training_precision": "bf16 autocast" if bf16 else "fp32",
        "corpus": {**corpus.stats(), "fingerprint": corpus.fingerprint},
        "tokenizer": {
            "vocab_size": tok.get_vocab_size(),
            "train_tokens": train_stream.numel(),
            "heldout_tokens": heldout_stream.numel(),
        },
        "target": {"params": train.num_params(target), "training": target_info, "heldout_ce_nats": round(t_ce, 4)},
        "draft": {
            "params": train.num_params(draft),
            "distill_data": data_info,
            "training": draft_info,
            "heldout_ce_nats": round(d_ce, 4),
        },
        "acceptance": acceptance,
        "heldout_text_top1_agreement": round(agreement, 4),
        "cost": cost,
        "seconds": {
            "tokenizer_and_corpus": round(tok_seconds, 1),
            "build_until_saved": round(train_seconds, 1),
            "evaluation": round(eval_seconds, 1),
            "total": round(time.perf_counter() - t_start, 1),
        },
    }
    report["gates"] = check_gates(settings, report)
    report["partial"] = not all(g["ok"] for g in report["gates"])
    save_report(os.path.join(work, "report.json"), report)
    log(format_report(report))
    if report["partial"] and not allow_partial:
        missed = "; ".join(g["text"] for g in report["gates"] if not g["ok"])
        raise BuildFailed(f"the {variant} pair missed its quality gates ({missed}); it is left in {work} and "
                          f"NOT installed in {out_dir}. --allow-partial installs it anyway.")
    install(work, out_dir)
    return load_report(report_path), False  # the JSON form, as a cached build returns it


def check_gates(settings: Settings, report: dict) -> list[dict]:
    """The pair's quality gates: acceptance at k = 4 and the per-token cost ratio. A build whose
    phases were stopped by a time cap says so in the gate's text."""
    capped = [m for m in ("target", "draft") if report[m]["training"]["stopped_by_time_cap"]]
    if report["draft"]["distill_data"]["stopped_by_time_cap"]:
        capped.append("labelling")
    note = f" (time cap stopped: {', '.join(capped)})" if capped else ""
    gates = []
    if settings.gate_acceptance_k4 is not None:
        a = next(r["acceptance_rate"] for r in report["acceptance"]["per_k"] if r["k"] == 4)
        gates.append({"name": "acceptance_k4", "value": a, "min": settings.gate_acceptance_k4,
                      "ok": a >= settings.gate_acceptance_k4,
                      "text": f"acceptance at k=4 {a:.3f}, need >= {settings.gate_acceptance_k4}{note}"})
    if settings.gate_cost_ratio is not None:
        r = report["cost"]["ratio_target_over_draft"]
        gates.append({"name": "cost_ratio", "value": r, "min": settings.gate_cost_ratio,
                      "ok": r >= settings.gate_cost_ratio,
                      "text": f"target/draft cost {r:.1f}x, need >= {settings.gate_cost_ratio}x{note}"})
    return gates


def install(work: str, out_dir: str) -> None:
    """Move a finished build from ``work`` into ``out_dir``: the report last, since it marks a
    complete build."""
    if os.path.isfile(os.path.join(out_dir, "report.json")):
        os.remove(os.path.join(out_dir, "report.json"))
    for name in ("target", "draft"):
        dest = os.path.join(out_dir, name)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(os.path.join(work, name), dest)
    os.replace(os.path.join(work, "report.json"), os.path.join(out_dir, "report.json"))
    shutil.rmtree(work, ignore_errors=True)
