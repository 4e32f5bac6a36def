"""The router's /metrics before and after a load, and what their difference says."""

from __future__ import annotations

import math

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    text = httpx.get(f"{url}/metrics", timeout=30.0).text
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def delta(before: Samples, after: Samples) -> Samples:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def _get(d: Samples, name: str, **labels: str) -> float:
    """Sum over every series of `name` that carries these labels (and maybe others, e.g. a replica)."""
    want = set(labels.items())
    return sum(v for (n, lbl), v in d.items() if n == name and want <= set(lbl))


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


def derive(d: Samples, wall: float) -> dict[str, float]:
    """Engine-side figures of one load, from the counter and histogram deltas over `wall` seconds.
    step_time{part}: target = the target's own forward time; draft = draft calls on the critical
    path (before the Step: sequential proposals, pipelined waits for a call about to land and fills of
    its misses); router =
    the rest of the step (RPCs, the router's Python, the services' request handling)."""
    st = "tandem:step_time_seconds"
    steps = _get(d, f"{st}_count", part="target")
    drafted = _get(d, "tandem:spec_decode_num_draft_tokens_total")
    lookups = _get(d, "tandem:pipeline_lookups_total")
    target_ms = 1000 * _ratio(_get(d, f"{st}_sum", part="target"), steps)
    router_ms = 1000 * _ratio(_get(d, f"{st}_sum", part="router"), steps)
    return {
        "steps": steps,
        "steps_per_s": _ratio(steps, wall),
        "tokens_per_step": _ratio(_get(d, "tandem:step_tokens_sum"), _get(d, "tandem:step_tokens_count")),
        "target_ms_per_step": target_ms,
        "draft_ms_per_step": 1000 * _ratio(_get(d, f"{st}_sum", part="draft"), steps),
        "router_ms_per_step": router_ms,
        "router_over_target": _ratio(router_ms, target_ms),
        "target_busy": _ratio(_get(d, f"{st}_sum", part="target"), wall),
        "acceptance": _ratio(_get(d, "tandem:spec_decode_num_accepted_tokens_total"), drafted),
        "draft_tokens_per_verify": _ratio(drafted, _get(d, "tandem:spec_decode_num_drafts_total")),
        "emitted_per_step": _ratio(_get(d, "tandem:spec_decode_emitted_tokens_per_step_sum"),
                                   _get(d, "tandem:spec_decode_emitted_tokens_per_step_count")),
        "pipeline_hit_rate": _ratio(_get(d, "tandem:pipeline_hits_total"), lookups),
        # misses as shares of lookups: late = nothing prepared for the outcome yet, wrong = no branch matched,
        # unasked = the router asked the draft for nothing there (a probe's rest, a sequence kept to lookup)
        "pipeline_miss_late": _ratio(_get(d, "tandem:pipeline_misses_total", reason="late"), lookups),
        "pipeline_miss_wrong": _ratio(_get(d, "tandem:pipeline_misses_total", reason="wrong"), lookups),
        "pipeline_miss_unasked": _ratio(_get(d, "tandem:pipeline_misses_total", reason="unasked"), lookups),
        # ... and the misses the draft filled before the step, on its critical path (router.upfront)
        "pipeline_fills": _ratio(_get(d, "tandem:pipeline_fills_total"), lookups),
        # pipelined steps whose proposals were drafted before them instead (Speculator.drafts_upfront)
        "upfront_share": _ratio(_get(d, "tandem:upfront_steps_total"), steps),
        # steps sent behind the one running (router.chain): their round trip overlapped the target's forward
        "chained_share": _ratio(_get(d, "tandem:chained_steps_total"), steps),
        # ... and why the others were not: the plan needed the step's outcome (chunks, admissions, a
        # grammar), the draft had no call for its outcomes, its call landed after the answer, it
        # prepared nothing for a sequence that wants drafts, or prompt lookup's guesses were worth waiting for
        **{f"unchained_{r}": _ratio(_get(d, "tandem:unchained_steps_total", reason=r), steps)
           for r in ("plan", "no_draft_call", "draft_late", "no_proposal", "lookup")},
        # draft calls that stopped early (fewer than k drafts) to land before their step's answer
        "draft_stops_per_step": _ratio(_get(d, "tandem:draft_calls_stopped_total"), steps),
        # ... and steps the draft sat out: resting to measure the target alone, busy, drafting upfront instead, down,
        # or resting because drafting was measured not to pay (router.regime)
        **{f"draft_rests_{r}": _ratio(_get(d, "tandem:draft_rests_total", reason=r), steps)
           for r in ("probe", "busy", "upfront", "down", "regime")},
        "pipeline_waits_per_step": _ratio(_get(d, "tandem:pipeline_waits_total"), steps),
        "pipeline_waits_arrived": _ratio(_get(d, "tandem:pipeline_waits_total", outcome="arrived"),
                                         _get(d, "tandem:pipeline_waits_total")),
        "draft_fallbacks": _get(d, "tandem:draft_fallbacks_total"),
        "preemptions": _get(d, "tandem:num_preemptions_total"),
        "generation_tokens": _get(d, "tandem:generation_tokens_total"),
    }


def gauges(after: Samples) -> dict[str, float]:
    """What the speculation policy decided from at the end of a load (gauges: their values, not deltas)."""
    return {"draft_slowdown": _get(after, "tandem:draft_slowdown"),
            "pooled_acceptance_draft": _get(after, "tandem:spec_decode_pooled_acceptance", proposer="draft"),
            "pooled_acceptance_lookup": _get(after, "tandem:spec_decode_pooled_acceptance", proposer="lookup")}
