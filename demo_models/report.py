"""The build report: saved as OUT/report.json and printed as a short readable summary."""

from __future__ import annotations

import json
import os


def save_report(path: str, report: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(report, fh, indent=2, sort_keys=False, default=str)
        fh.write("\n")
    os.replace(tmp, path)  # atomic: a report on disk always belongs to a complete build


def load_report(path: str) -> dict:
    with open(path) as fh:
        return json.load(fh)


def format_report(r: dict) -> str:
    s = r["settings"]
    t, d, acc, cost = r["target"], r["draft"], r["acceptance"], r["cost"]
    dd = d["distill_data"]
    ts, ds = s["target_shape"], s["draft_shape"]

    def shape(x: dict) -> str:
        layers = f"{x['layers']} layer{'s' if x['layers'] != 1 else ''}"
        return f"{layers}, hidden {x['hidden']}, mlp {x['intermediate']}, heads {x['heads']}/{x['kv_heads']} kv"

    def training(x: dict) -> str:
        capped = " (STOPPED BY TIME CAP)" if x["stopped_by_time_cap"] else ""
        return (
            f"{x['steps']}/{x['steps_planned']} steps, {x['tokens_seen']:,} tokens, {x['seconds']:.0f} s, "
            f"final train loss {x['final_train_loss']:.3f}{capped}"
        )

    lines = [
        f"demo pair '{r['variant']}'  settings {r['settings_hash']}  "
        f"torch {r['versions']['torch']}, transformers {r['versions']['transformers']}",
        f"corpus   : {r['corpus']['train_files']} train / {r['corpus']['heldout_files']} held-out stdlib files; "
        f"tokens {r['tokenizer']['train_tokens']:,} / {r['tokenizer']['heldout_tokens']:,}; "
        f"byte-level BPE vocab {r['tokenizer']['vocab_size']}",
        f"target   : {t['params'] / 1e6:.2f}M params ({shape(ts)})",
        f"           {training(t['training'])}",
        f"           held-out cross-entropy {t['heldout_ce_nats']:.3f} nats/token",
        f"draft    : {d['params'] / 1e6:.2f}M params ({shape(ds)})",
        f"           distilled from the target on {dd['sequences'] - dd['corpus_sequences']} of its greedy "
        f"continuations ({dd['generated_tokens']:,} generated tokens) and {dd['corpus_sequences']} corpus windows"
        f"{' (LABELLING STOPPED BY TIME CAP)' if dd['stopped_by_time_cap'] else ''}, labelled in {dd['seconds']:.0f} s",
        f"           {training(d['training'])}",
        f"           held-out cross-entropy {d['heldout_ce_nats']:.3f} nats/token",
        f"acceptance (greedy, {acc['prompts']} held-out prompts of {acc['prompt_len']} tokens, "
        f"{acc['generated_per_prompt']} target tokens each; top-1 agreement {acc['draft_top1_agreement']:.3f}):",
        "    k  acceptance  emitted/step",
    ]
    for row in acc["per_k"]:
        lines.append(f"   {row['k']:2d}  {row['acceptance_rate']:10.3f}  {row['mean_emitted_per_step']:12.3f}")
    lines += [
        f"           (target continuations: distinct 4-gram ratio {acc['target_distinct_4gram_ratio']:.2f}; "
        f"on held-out real text the draft's top-1 matches the target's at "
        f"{r['heldout_text_top1_agreement']:.3f} of positions)",
        f"cost     : decode 1 token after {cost['context_tokens']} cached, batch 1, median of {cost['repeats']}: "
        f"target {cost['target_ms']:.2f} ms, draft {cost['draft_ms']:.2f} ms "
        f"-> ratio {cost['ratio_target_over_draft']:.1f}x",
        f"time     : {r['seconds']['total']:.0f} s total ({r['seconds']['build_until_saved']:.0f} s building, "
        f"{r['seconds']['evaluation']:.0f} s measuring); training in {r['training_precision']} "
        f"(native bf16: {'yes' if r['machine']['native_bf16'] else 'no'})",
    ]
    lines += [f"gate     : {'ok  ' if g['ok'] else 'MISSED'} {g['text']}" for g in r.get("gates", [])]
    return "\n".join(lines)
