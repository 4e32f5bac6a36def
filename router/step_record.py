"""What a finished step tells the router: its parts' times for /metrics, what it cost for the
speculator's models, and how far its decoders got in how long for the draft regime (router.regime),
which the step loop feeds. Also what an unchained step's router+RPC part costs (chain.lookup_beats_chaining).

    t_start ........ t_target ............. answered ....... now
    | router, draft  | target (wall, RPC in)  | apply, book   |     total = now - t_start
    router part = total - the target's forward - the draft's wait
"""

from __future__ import annotations

import time

from router.lookup import LookupShadow
from router.metrics import Metrics
from router.scheduler import StepPlan
from router.speculator import Speculator
from tandem.v1 import target_pb2

ROUND_TRIP_PRIOR_MS = 2.0  # an unchained step's router+RPC part before any was measured (1-3 ms on CPU hosts)


class StepRecorder:
    def __init__(self, spec: Speculator, metrics: Metrics, replica: str) -> None:
        self.spec = spec
        self.round_trip_ms = ROUND_TRIP_PRIOR_MS  # decayed mean over unchained steps
        self._parts = {part: metrics.step_time.labels(part=part) for part in ("target", "draft", "router")}
        self._busy = metrics.target_busy.labels(replica=replica)
        self._tokens = metrics.step_tokens
        # read when /metrics is scraped, not written on every step
        metrics.draft_slowdown.labels(replica=replica).set_function(lambda: spec.pacing.contention.factor)
        for kind, pool in (("draft", spec.draft_acceptance), ("lookup", spec.lookup_acceptance)):
            metrics.pooled_acceptance.labels(replica=replica, proposer=kind).set_function(
                lambda pool=pool: pool.pooled.rate)

    def record(self, plan: StepPlan, response: target_pb2.StepResponse, draft_ms: float, target_wall_ms: float,
               t_start: float, draft_busy: bool, chained: bool) -> float:
        """Book one step; returns the loop's ms for its decoders (prompt chunks' own share taken out), the
        draft regime's sample with lookup_steps."""
        tokens = plan.num_tokens
        self.spec.observe_step(plan, target_wall_ms, draft_busy)  # wall time, RPC included: like the draft's
        self._tokens.observe(tokens)
        total_ms = (time.perf_counter() - t_start) * 1000
        self._parts["target"].observe(response.forward_ms / 1000)
        self._busy.inc(response.forward_ms / 1000)
        self._parts["draft"].observe(draft_ms / 1000)
        router_ms = max(0.0, total_ms - response.forward_ms - draft_ms)
        self._parts["router"].observe(router_ms / 1000)
        if not chained:  # what waiting for an answer costs (lookup_beats_chaining)
            self.round_trip_ms += 0.05 * (router_ms - self.round_trip_ms)
        prompt_tokens = sum(c.end - c.start for c in plan.chunks)
        return total_ms - self.spec.cost.beta * prompt_tokens

    def lookup_steps(self, plan: StepPlan, response: target_pb2.StepResponse, measured: bool) -> float | None:
        """How far the step's decoders got, in steps of prompt lookup alone (router.lookup.LookupShadow,
        replayed over each one's text at k_max), averaged over them (they step together): the draft
        regime's sample, with record's ms. None without decoders, or where the regime does not measure
        the step (the replays start again after it). The replay resolves a step once the text shows
        where lookup's guesses stop matching, so a step may resolve none and the next more."""
        if not measured:
            for seq, _ in plan.decodes:
                if seq.lookup_shadow is not None:
                    seq.lookup_shadow.restart(len(seq.tokens))
            return None
        if not plan.decodes:
            return None
        k, steps = max(1, self.spec.k_max), 0
        for (seq, _), res in zip(plan.decodes, response.results, strict=False):
            if seq.lookup_shadow is None:  # its first decode: the replay starts where this step's tokens do
                seq.lookup_shadow = LookupShadow(k, max(0, len(seq.tokens) - len(res.tokens)), seq.lookup.anew())
            steps += seq.lookup_shadow.advance(seq.tokens, seq.finished)
        return steps / len(plan.decodes)
