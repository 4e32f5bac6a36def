"""The SmolLM2 build report, printed as a short readable summary (the JSON is OUT/report.json)."""

from __future__ import annotations


def format_report(r: dict) -> str:
    t, d = r["target"], r["draft"]
    data, tr = d["data"], d["training"]
    v = t["verification"]

    def capped(x: dict) -> str:
        return " (STOPPED BY TIME CAP)" if x["stopped_by_time_cap"] else ""

    lines = [
        f"SmolLM2 pair '{r['variant']}'  settings {r['settings_hash']}  torch {r['versions']['torch']}, "
        f"transformers {r['versions']['transformers']}, gguf {r['versions']['gguf']}",
        f"target   : {t['source']} (GGUF sha256 {t['gguf_sha256'][:12]}...), {t['params'] / 1e6:.1f}M params, "
        f"{t.get('storage', 'fp32')}",
        "           vs transformers' own GGUF load: not checked (this variant skips it)" if v.get("skipped") else
        f"           vs transformers' own GGUF load: max |logit gap| {v['max_abs_logit_gap_transformers']:.2e} "
        f"(transformers), {v['max_abs_logit_gap_engine']:.2e} (engine); tokenizer and chat template identical",
        f"draft    : {d['params'] / 1e6:.1f}M params: target layers {d['layers_from_target']}, target's final norm, "
        f"head over the {d['head_vocab']} most frequent tokens (embedding shared, frozen)",
        f"           data: {data['sequences']}/{data['sequences_planned']} target continuations "
        f"({data['chat_questions']} self-written chat questions, {data['code_windows']} stdlib code windows; "
        f"{data['labelled_tokens']:,} labelled tokens, top-{data['label_top_k']}) in {data['seconds']:.0f} s"
        f"{capped(data)}",
        f"           and the target reading {data['read']['windows']}/{data['read']['windows_planned']} windows of "
        f"stdlib code ({data['read']['labelled_tokens']:,} labelled tokens) in {data['read']['seconds']:.0f} s"
        f"{capped(data['read'])}",
        f"           {tr['steps']}/{tr['steps_planned']} steps in {tr['seconds']:.0f} s, {tr['precision']}, "
        f"final train loss {tr['final_train_loss']:.3f}{capped(tr)}",
    ]
    for part, acc in r["acceptance"].items():
        lines.append(
            f"acceptance, held-out {part} ({acc['prompts']} prompts, {acc['target_tokens']} target tokens; "
            f"top-1 agreement {acc['draft_top1_agreement']:.3f}; head covers {acc['head_coverage']:.3f} of them):"
        )
        lines.append("    k " + "".join(f"{row['k']:>7d}" for row in acc["per_k"]))
        lines.append("  acc " + "".join(f"{row['acceptance_rate']:7.3f}" for row in acc["per_k"]))
        lines.append("  e/s " + "".join(f"{row['mean_emitted_per_step']:7.2f}" for row in acc["per_k"]))
    for how, c in r["cost"].items():
        lines.append(
            f"cost     : {how}, decode 1 token after {c['context_tokens']} cached, batch 1, median of {c['repeats']}: "
            f"target {c['target_ms']:.2f} ms, draft {c['draft_ms']:.2f} ms -> ratio {c['ratio_target_over_draft']:.1f}x"
        )
    sec = r["seconds"]
    lines.append(
        f"time     : {sec['total']:.0f} s total (target {sec['target_conversion']:.0f}, prompts and labels "
        f"{sec['prompts_and_labels']:.0f}, draft {sec['draft_distillation']:.0f}, measuring {sec['measurement']:.0f}); "
        f"{r['machine']['cpu_count']} CPUs, {r['machine']['torch_threads']} threads, native bf16: "
        f"{'yes' if r['machine']['native_bf16'] else 'no'}"
    )
    lines += [f"gate     : {'ok    ' if g['ok'] else 'MISSED'} {g['text']}" for g in r["gates"]]
    return "\n".join(lines)


def markdown_table(r: dict) -> str:
    """Acceptance at k = 1..k_max as a Markdown table (for docs/)."""
    parts = list(r["acceptance"])
    head = "| k | " + " | ".join(f"{p} acceptance | {p} emitted/step" for p in parts) + " |"
    sep = "|---|" + "---|---|" * len(parts)
    rows = []
    for i, row in enumerate(r["acceptance"][parts[0]]["per_k"]):
        cells = []
        for p in parts:
            x = r["acceptance"][p]["per_k"][i]
            cells += [f"{x['acceptance_rate']:.3f}", f"{x['mean_emitted_per_step']:.2f}"]
        rows.append(f"| {row['k']} | " + " | ".join(cells) + " |")
    return "\n".join([head, sep, *rows])
