"""Prometheus metrics. Speculation metrics are named like vLLM's (spec_decode_num_drafts, ...)
so existing dashboards carry over with the prefix changed from vllm: to tandem:."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self, k_max: int) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("tandem:inter_token_latency_seconds", "Time between consecutive output tokens "
                             "(a step emitting n tokens counts n intervals of step_time / n)", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("tandem:e2e_request_latency_seconds", "Request latency", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.queue_time = Histogram("tandem:request_queue_time_seconds", "Time a request waited for its first "
                                    "step (and again after preemptions)", registry=r, buckets=_LATENCY_BUCKETS)
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("tandem:generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("tandem:requests", "Finished requests", ["finish_reason"], registry=r)
        self.http_requests = Counter("tandem:http_requests", "HTTP requests answered, by route (its path, or "
                                     "'other') and status code", ["route", "status"], registry=r)
        self.waiting = Gauge("tandem:num_requests_waiting", "Requests waiting", registry=r)
        self.running = Gauge("tandem:num_requests_running", "Sequences running", registry=r)
        self.target_errors = Counter("tandem:target_step_errors", "Steps the target answered with an internal "
                                     "error (their sequences are then retried one at a time)", registry=r)
        self.preemptions = Counter("tandem:num_preemptions", "Sequences preempted for recompute", registry=r)
        self.kv_usage = Gauge("tandem:kv_cache_usage_perc", "Fraction of KV blocks reserved by the router",
                              ["service"], registry=r)
        self.step_time = Histogram("tandem:step_time_seconds", "Step time by part: target = its forward "
                                   "pass, draft = draft time on the critical path (sequential proposals, and "
                                   "waiting for the draft after the target answered), router = the rest (router "
                                   "Python, gRPC and the services' own request handling)", ["part"], registry=r,
                                   buckets=_LATENCY_BUCKETS)
        self.target_busy = Counter("tandem:target_busy_seconds", "Seconds of target forward passes, per replica "
                                   "(its rate is the fraction of time the replica computes)", ["replica"], registry=r)
        self.step_tokens = Histogram("tandem:step_tokens", "Tokens scored per target step", registry=r,
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048))
        self.num_drafts = Counter("tandem:spec_decode_num_drafts", "Verifications with k > 0", registry=r)
        self.num_draft_tokens = Counter("tandem:spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.num_accepted = Counter("tandem:spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter("tandem:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position", ["position"], registry=r)
        self.emitted_per_step = Histogram("tandem:spec_decode_emitted_tokens_per_step",
                                          "Tokens a decoding sequence emits per step", registry=r,
                                          buckets=tuple(range(1, k_max + 3)))
        self.pipeline_misses = Counter("tandem:pipeline_misses", "Decodes that wanted a proposal and had none: "
                                       "late = the draft had prepared nothing for this outcome yet (asked, or "
                                       "busy with an earlier call), wrong = it had, and no prepared branch "
                                       "matched, unasked = the router asked it for nothing there (a probe's "
                                       "rest, a sequence kept to prompt lookup)", ["reason"], registry=r)
        self.pipeline_fills = Counter("tandem:pipeline_fills", "Pipeline misses filled: the draft proposed for them "
                                      "before the step (on its critical path), where that was worth its time",
                                      registry=r)
        self.draft_stops = Counter("tandem:draft_calls_stopped", "Draft calls that stopped drafting early (fewer "
                                   "than k drafts) to land before the target step they were prepared beside",
                                   registry=r)
        self.upfront_steps = Counter("tandem:upfront_steps", "Pipelined steps whose proposals the draft made before "
                                     "them (on their critical path, as without pipelining): on compute it shares "
                                     "with the target, branches beside the step ahead would have slowed it more "
                                     "than the call cost", registry=r)
        self.draft_rests = Counter("tandem:draft_rests", "Pipelined steps the draft sat out (no work beside them, "
                                   "so their decoders find nothing prepared next step), by why: probe = resting to "
                                   "measure the target's speed with the draft idle (router.pacing), busy = still in "
                                   "a call, upfront = its decoders are drafted before the next step instead, down "
                                   "= no draft to ask, regime = drafting was measured to get less far through "
                                   "the text per ms than prompt lookup alone at this load (router.regime)",
                                   ["reason"], registry=r)
        self.pipeline_waits = Counter("tandem:pipeline_waits", "Steps that waited (at most what the proposals "
                                      "were worth) for a draft call about to land with them: arrived or timed_out "
                                      "(the step then ran without them)", ["outcome"], registry=r)
        self.chained_steps = Counter("tandem:chained_steps", "Steps sent while the step ahead of them still ran "
                                     "(router.chain): the target went on without a round trip to the router",
                                     registry=r)
        self.unchained_steps = Counter("tandem:unchained_steps", "Steps that were not chained behind the one before "
                                       "(the target waited a round trip for them), by why: draft_late = the step "
                                       "ahead answered before the draft's branches for it landed, no_draft_call = "
                                       "the draft had no call for its outcomes (resting, busy, down), no_proposal = "
                                       "a sequence wanted drafts the draft had not prepared, lookup = prompt lookup's "
                                       "guesses (made after the outcome) were worth the round trip, plan = the step "
                                       "ahead was not decodes of every running sequence (prompts, a newcomer waiting, "
                                       "a grammar, seeded sampling, a finish)", ["reason"], registry=r)
        self.lookup_proposals = Counter("tandem:lookup_proposals", "Verifications whose drafts came from prompt "
                                        "lookup (the draft had none for them, or there is no draft)", registry=r)
        self.pipeline_lookups = Counter("tandem:pipeline_lookups", "Verifications whose next proposal was "
                                        "drafted during the step", registry=r)
        self.pipeline_hits = Counter("tandem:pipeline_hits", "...of which a prepared proposal continued the "
                                     "history", registry=r)
        self.draft_fallbacks = Counter("tandem:draft_fallbacks", "Steps run at k = 0 because the draft was "
                                       "down, failing or late", ["reason"], registry=r)
        self.draft_slowdown = Gauge("tandem:draft_slowdown", "How much slower the target's steps run while a "
                                    "pipelined draft works beside them (busy over idle steps, each against the "
                                    "step-cost model; 1 until both were seen): what the speculation policy charges "
                                    "drafts for, per replica", ["replica"], registry=r)
        self.pooled_acceptance = Gauge("tandem:spec_decode_pooled_acceptance", "Per-token acceptance pooled over "
                                       "sequences, by proposer (draft, lookup): a new sequence's prior, per replica",
                                       ["replica", "proposer"], registry=r)
        self.draft_up = Gauge("tandem:draft_available", "1 when every configured draft replica is in use",
                              registry=r)
        self.target_up = Gauge("tandem:target_available", "1 when at least one target replica answers", registry=r)
        self.draining = Gauge("tandem:router_draining", "1 once the router is shutting down (SIGTERM): new requests "
                              "refused, those in flight finishing", registry=r)
        self.background = Gauge("tandem:background_responses_running", "Background responses (the Responses "
                                 "API's background: true) still running", registry=r)
        self.replica_up = Gauge("tandem:replica_up", "1 when this replica answers", ["replica", "service"],
                                registry=r)
        self.replica_running = Gauge("tandem:replica_num_requests_running", "Sequences pinned to a target replica",
                                     ["replica"], registry=r)
        self.replica_waiting = Gauge("tandem:replica_num_requests_waiting", "Sequences queued for a target replica",
                                     ["replica"], registry=r)
        self.replica_kv_usage = Gauge("tandem:replica_kv_cache_usage_perc", "KV blocks reserved, per replica",
                                      ["replica", "service"], registry=r)
        self.replica_assigned = Counter("tandem:replica_sequences", "Sequences assigned to a target replica",
                                        ["replica"], registry=r)
        self.prompt_tokens_computed = Counter("tandem:target_prompt_tokens_computed", "Prompt (and recompute) "
                                              "tokens the target computed in prefill chunks: a request's n choices "
                                              "share one prompt computation", registry=r)
        self.forked_sequences = Counter("tandem:forked_sequences", "Choices 1..n-1 started as forks of their "
                                        "first choice's prompt cache instead of prefilling", registry=r)
        self.structured_requests = Counter("tandem:structured_output_requests", "Requests with an output "
                                           "constraint", ["kind"], registry=r)
        self.lora_requests = Counter("tandem:lora_requests", "Requests answered with a LoRA adapter, by its name",
                                     ["adapter"], registry=r)
        self.prediction_tokens = Counter("tandem:prediction_tokens", "Tokens of requests' predicted outputs "
                                         "verified (OpenAI's prediction), accepted or rejected", ["outcome"],
                                         registry=r)
        self.grammar_mask_bytes = Counter("tandem:grammar_mask_bytes", "Bytes of grammar token masks sent to "
                                          "the target", registry=r)
        self.migrations = Counter("tandem:replica_migrations", "Sequences moved off a lost replica (recomputed "
                                  "elsewhere)", registry=r)
        # named like vLLM's: hits / queries is the fraction of looked-up tokens not computed
        self.prefix_queries = Counter("tandem:prefix_cache_queries", "Tokens of sequences (re)starting at a "
                                      "service that were looked up in its prefix cache", ["service"], registry=r)
        self.prefix_hits = Counter("tandem:prefix_cache_hits", "...of which the service attached cached KV "
                                   "instead of computing it", ["service"], registry=r)
        self.prefix_misses = Counter("tandem:prefix_cache_attach_misses", "Attaches the service refused (its "
                                     "blocks were evicted or lost): the sequence was recomputed", ["service"],
                                     registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
