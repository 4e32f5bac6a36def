"""What each sequence speculates with, step by step: its k (the policy) and its proposal (from the
speculation cache or prompt lookup), and what the draft's work is measured to cost. The step loop
asks; this module decides (the draft's work itself is planned in router.draft_plans)."""

from __future__ import annotations

from dataclasses import replace

from router.config import RouterConfig
from router.draft_work import DraftWork
from router.drafting import DraftLane
from router.pacing import DraftPacing
from router.scheduler import Scheduler, StepPlan
from router.sequence import Sequence
from router.spec_policy import AcceptancePool, Odds, choose_k, expected_tokens
from router.speculation import Proposal, best_proposal, confidence_of, point_guesses, prune
from router.step_costs import BranchCost, DraftCost, StepCostModel


class Speculator:
    def __init__(self, config: RouterConfig, scheduler: Scheduler, draft: DraftLane, max_model_len: int,
                 target_max_k: int, target_compute: str = "") -> None:
        self.config = config
        self.k_max = min(config.k_max, target_max_k)  # the target's limit clamps the router's (lanes.py logs it)
        self.scheduler = scheduler
        self.draft = draft
        self.max_model_len = max_model_len
        self.cost = StepCostModel()  # the target's step time with the draft idle; observe_step feeds it
        self.pacing = DraftPacing(config, draft, self.cost.step_ms, target_compute)
        self.draft_cost = DraftCost(pipelined=config.pipeline)
        self.drafting_upfront = False  # this iteration's proposals are drafted before its step (upfront.py)
        self.drafting = True  # the draft works this step (router.regime): else it rests, prompt lookup alone
        self.branch_cost = BranchCost()
        self.wait_odds = Odds()  # how often a wait for the draft saw its call arrive (grace_ms)
        self.match_odds = Odds()  # how often a decoder's prepared branches held its outcome (hit vs wrong)
        self.draft_acceptance = AcceptancePool()  # new sequences' priors, for the draft's proposals
        self.lookup_acceptance = AcceptancePool.for_lookup()  # ... and for prompt lookup's
        self.matched: dict[int, Proposal] = {}  # this step's proposal per decoding sequence
        # decoders that found nothing prepared for their outcome: seq_id -> why (miss_kind: late or unasked)
        self.missed: dict[int, str] = {}
        self.from_draft: set[int] = set()  # decoders whose proposal the draft prepared (pipeline hits)
        self.from_lookup: set[int] = set()  # ... and those that took a prompt-lookup proposal instead
        self.lookup_over_draft: set[int] = set()  # ... although the draft had a proposal for them (not a miss)
        self.lookup_passed: set[int] = set()  # decoders that had a prompt-lookup proposal and verified another
        self.filled: dict[int, str] = {}  # decoders whose miss (late / wrong) a plain proposal filled (upfront.py)
        self.drafted_upfront: set[int] = set()  # decoders whose proposals were drafted before this step (upfront.py)
        draft.on_cost = self._observe_draft

    @property
    def draft_at_work(self) -> bool:
        """The draft is up and not resting this step (router.regime)."""
        return self.draft.up and self.drafting

    # ---- k and proposals ------------------------------------------------------------------------
    def cap(self, seq: Sequence) -> int:
        """Largest k this sequence may use now (0: plain decoding)."""
        if self.k_max == 0 or not (self.draft.up or self.config.prompt_lookup or seq.request.prediction):
            return 0
        cap = min(self.k_max, self.draft.max_k) if self.draft.up else self.k_max
        if seq.request.max_speculative_tokens is not None:
            cap = min(cap, seq.request.max_speculative_tokens)
        limit = min(self.max_model_len, self.draft.info.max_model_len) if self.draft.up else self.max_model_len
        if len(seq.tokens) + 2 * cap + 2 > limit:
            return 0
        return max(cap, 0)

    def proposal(self, seq: Sequence) -> Proposal:
        """Drafts prepared for this sequence's current history, with their q."""
        seq.prepared = prune(seq.prepared, seq.tokens)
        if seq.request.reproducible:  # only a plain proposal made at exactly this history: k never varies
            n = len(seq.tokens)
            plain = [p for p in seq.prepared if p.start == n and not p.prefix]
            return (list(plain[-1].drafts), list(plain[-1].probs)) if plain else ([], [])
        return best_proposal(seq.prepared, seq.tokens)

    def lookup(self, seq: Sequence) -> Proposal:
        """Where the draft has nothing for a sequence: what followed its suffix earlier in its history.
        A seeded sampled sequence takes only its prediction's guesses, and always where there are any: a
        rule of its history alone, so its tokens never depend on timing."""
        if not (self.config.prompt_lookup or seq.request.prediction):
            return [], []
        if seq.request.reproducible and not seq.request.prediction:
            return [], []
        drafts = seq.lookup.propose(seq.tokens, self.k_max)
        if seq.request.reproducible and not seq.lookup.from_prediction:
            return [], []
        if not drafts or seq.request.sampling.greedy:
            return drafts, []
        return drafts, point_guesses(drafts)

    def choose_ks(self, decoders: list[Sequence], prefill_tokens: int) -> list[int]:
        """The scheduler's callback: k per decoder, its policy's wish capped by the proposal it takes.
        Both offers are known before the choice: the draft's prepared proposal (where the pipeline has
        one for this history) and prompt lookup's (what followed the suffix earlier). Each sequence
        takes the one with more expected tokens at its proposer's acceptance, and lookup's where the
        draft's proposals are not worth their cost now (a lookup costs no draft work)."""
        caps = [self.cap(s) for s in decoders]
        offers = [self._offers(s) if cap > 0 else (([], []), ([], [])) for s, cap in zip(decoders, caps, strict=True)]
        if not self.drafting:  # the draft rests (router.regime): no call will fill a sequence that has no offer
            caps = [cap if drafted[0] or looked[0] else 0 for cap, (drafted, looked) in zip(caps, offers, strict=True)]
        by_lookup = [bool(lk[0]) if s.request.reproducible  # its prediction's guesses where it has any
                     else self.prefers_lookup(s, len(d[0][:cap]), len(lk[0][:cap]))
                     for s, cap, (d, lk) in zip(decoders, caps, offers, strict=True)]
        if self.config.dynamic_k:
            dyn = [i for i, s in enumerate(decoders) if not s.request.reproducible]
            chosen = self._dynamic_k(decoders, caps, dyn, by_lookup, prefill_tokens)
            unaffordable = [i for i, k in zip(dyn, chosen, strict=True) if k == 0 and caps[i] and offers[i][1][0]
                            and not by_lookup[i]]
            if unaffordable:
                for i in unaffordable:
                    by_lookup[i] = True
                chosen = self._dynamic_k(decoders, caps, dyn, by_lookup, prefill_tokens)
            for i, k in zip(dyn, chosen, strict=True):
                caps[i] = k
        return [self._match(seq, k, offer, lookup) for seq, k, offer, lookup in zip(decoders, caps, offers, by_lookup,
                                                                                   strict=True)]

    def chain_ks(self, decoders: list[Sequence]) -> list[int]:
        """k per decoder for a step chained behind the one running (router.chain): the policy's wish,
        from the draft (lookup's guesses need the outcome, which only the target knows yet)."""
        if not self.draft_at_work:
            return [0] * len(decoders)
        caps = [self.cap(s) for s in decoders]
        if not self.config.dynamic_k:
            return caps
        dyn = [i for i, s in enumerate(decoders) if not s.request.reproducible]
        ready = replace(self.draft_cost, always_ready=True)
        ks = self._dynamic_k(decoders, caps, dyn, [False] * len(decoders), 0, ready)
        for i, k in zip(dyn, ks, strict=True):
            caps[i] = k
        return caps

    def plain_next_step(self, decoders: list[Sequence]) -> bool:
        """Whether the step after this one would run every decoder at k = 0 whatever this one emits: the
        policy drafts for none of them (chain_ks) and prompt lookup has nothing for any (its proposals
        are made after the outcome; a history that has no match now rarely has one a token later)."""
        return not any(self.lookup(s)[0] for s in decoders) and not any(self.chain_ks(decoders))

    def _dynamic_k(self, decoders: list[Sequence], caps: list[int], dyn: list[int], by_lookup: list[bool],
                   prefill_tokens: int, draft_cost: DraftCost | None = None) -> list[int]:
        rates = [(decoders[i].lookup_tracker if by_lookup[i] else decoders[i].tracker).rate for i in dyn]
        if draft_cost is None:  # drafted upfront, the call precedes the step as without pipelining
            draft_cost = replace(self.draft_cost, pipelined=False) if self.drafting_upfront else self.draft_cost
        return choose_k(rates, [caps[i] for i in dyn], prefill_tokens, self.cost, draft_cost,
                        [not by_lookup[i] for i in dyn], base_seqs=len(decoders) - len(dyn) + (prefill_tokens > 0))

    def _offers(self, seq: Sequence) -> tuple[Proposal, Proposal]:
        """The draft's prepared proposal for seq's history and prompt lookup's; a sequence the draft had
        prepared nothing for yet is a miss (late or unasked)."""
        if (kind := self.miss_kind(seq)) != "wrong":  # now: the outcome's call may land during the step
            self.missed[seq.seq_id] = kind
        return self.proposal(seq), self.lookup(seq)

    def _match(self, seq: Sequence, k: int, offers: tuple[Proposal, Proposal], by_lookup: bool) -> int:
        """This step's proposal for seq: at most k drafts of the offer it takes."""
        seq.next_k = k
        drafted, looked = offers
        if drafted[0]:
            self.missed.pop(seq.seq_id, None)
        chosen = looked if by_lookup and k > 0 else drafted
        self.matched[seq.seq_id] = chosen
        if chosen is looked:
            self.from_lookup.add(seq.seq_id)
            if drafted[0]:
                self.lookup_over_draft.add(seq.seq_id)
        elif drafted[0]:
            self.from_draft.add(seq.seq_id)
        if looked[0] and chosen is not looked:
            self.lookup_passed.add(seq.seq_id)
        return min(k, len(chosen[0]))

    def decoding(self) -> list[Sequence]:
        """The running sequences past their prompt."""
        return [s for s in self.scheduler.running if not s.prefilling and not s.finished]

    @staticmethod
    def asked_for(plan: StepPlan) -> None:
        """The draft would have been asked for the outcomes of plan's decoders (it was busy)."""
        for seq, _ in plan.decodes:
            seq.asked_at = len(seq.tokens)

    @staticmethod
    def miss_kind(seq: Sequence) -> str:
        """Why seq finds no prepared proposal continuing its history, asked while its step is planned:
        wrong (the draft prepared branches for this outcome and none matched), late (it was asked, or
        busy with an earlier call, and has not answered) or unasked (the router asked it for nothing
        here: resting for a probe, the sequence kept to prompt lookup, branches not worth their
        slowdown of the target)."""
        if Speculator.prepared_for_outcome(seq):
            return "wrong"
        return "late" if 0 <= seq.asked_at == seq.outcome_start else "unasked"

    @staticmethod
    def prepared_for_outcome(seq: Sequence) -> bool:
        """Whether the draft prepared anything for the outcome of seq's last verification."""
        return any(p.start == seq.outcome_start for p in seq.prepared)

    @staticmethod
    def prefers_lookup(seq: Sequence, drafted: int, looked: int) -> bool:
        """Given offers of `drafted` and `looked` tokens: lookup's where it expects more tokens at the
        acceptance its lookups have had, or where the draft offers nothing. On a tie the draft's goes
        (it carries q: a sampled request accepts more of it than of a point guess)."""
        if not looked:
            return False
        if not drafted:
            return True
        return expected_tokens(seq.lookup_tracker.rate, looked) > expected_tokens(seq.tracker.rate, drafted)

    def keeps_to_lookup(self, seq: Sequence, looked: int) -> bool:
        """Whether seq verifies prompt lookup's proposal of `looked` tokens this step, and lookup beats even
        a full proposal of the draft's (at the k it wants): the draft need not propose for it."""
        return seq.seq_id in self.from_lookup and self.prefers_lookup(seq, seq.next_k, looked)

    def observe_step(self, plan: StepPlan, wall_ms: float, draft_busy: bool) -> None:
        """A target step's wall time: feeds the contention estimate, and the cost model at draft-idle speed.
        Contention compares decode-only steps on both sides: a step with prompt chunks always has the
        draft busy (it mirrors them) and is priced from the line, which misprices it (SmolLM2: 566 ms
        observed against 431 modelled for 132-token chunk steps), so it read as a slowdown of 1.17-1.40
        where busy and idle decode steps took the same time."""
        tokens, seqs = plan.num_tokens, len(plan.sequences)
        if not plan.chunks:
            self.pacing.contention.observe(wall_ms, tokens, seqs, draft_busy)
        self.draft_cost.slowdown = slowdown = self.pacing.contention.factor
        self.cost.observe(tokens, wall_ms / slowdown if draft_busy else wall_ms, seqs)

    def decode_ready(self, seq: Sequence) -> bool:
        # Seeded sampling stays reproducible only if its k never depends on timing: it waits
        # for its proposal instead of running at k = 0 while the draft works.
        return not (seq.request.reproducible and self.cap(seq) > 0 and not self.proposal(seq)[0]
                    and not self.lookup(seq)[0])

    def pipeline_outcome(self, seq: Sequence) -> str | None:
        """For a decoder that wanted drafts this step: hit (a prepared proposal continued its history),
        or why it missed (miss_kind: late, unasked or wrong); else None."""
        if seq.next_k <= 0 or not self.draft_at_work or seq.seq_id in self.lookup_over_draft \
                or seq.seq_id in self.drafted_upfront:
            return None
        if seq.seq_id in self.filled:
            return self.filled[seq.seq_id]
        if seq.seq_id in self.from_draft:
            return "hit"
        return self.missed.get(seq.seq_id, "wrong")

    def new_step(self, upfront: set[int] | None = None) -> None:
        self.drafted_upfront = upfront or set()
        self.matched.clear()
        self.missed.clear()
        self.from_draft.clear()
        self.from_lookup.clear()
        self.lookup_over_draft.clear()
        self.lookup_passed.clear()
        self.filled.clear()

    def observe_outcome(self, seq: Sequence, v: int, accepted: int, token: int) -> None:
        """Which prepared branch (if any) this verification's outcome matched: the rank statistics."""
        n = seq.outcome_start = len(seq.tokens)
        ranks = {p.rank: p.prefix[-1] for p in seq.prepared if p.start == n and p.rank and p.accepted == accepted}
        if ranks:
            hit = next((r for r, t in ranks.items() if t == token), None)
            self.draft.stats.observe(accepted == v, list(ranks), hit)

    def acceptance_of(self, seq: Sequence, drafts: list[int]) -> tuple[float, ...]:
        """Each of the drafts seq verifies, its chance of acceptance from the draft's confidence in it
        (empty where the draft did not propose them: prompt lookup's)."""
        return self.draft.stats.acceptance(confidence_of(seq.prepared, seq.tokens, drafts))

    def observe_verified(self, seq: Sequence, drafts: list[int], accepted: int) -> None:
        """What acceptance the draft's confidence in its drafts meant this time."""
        if drafts and (confidence := confidence_of(seq.prepared, seq.tokens, drafts)):
            self.draft.stats.verified(confidence, accepted)

    def verify_rate(self, seq: Sequence) -> float:
        """The acceptance of the proposer whose drafts seq verifies this step."""
        return (seq.lookup_tracker if seq.seq_id in self.from_lookup else seq.tracker).rate

    def draft_dormant(self) -> bool:
        """Whether the draft should not even mirror prompts: at the pooled acceptance of its proposals a
        new sequence would not draft at any depth (choose_k), so where it slows the target its prompt
        work is pure cost (SmolLM2's draft, accepted 0.2-0.3, costs a quarter of the target a token: its
        lm_head is most of it). A sequence the policy drafts for later catches up in its first call
        (DraftWork.add); while nothing is drafted the pool drifts back toward its prior, so a dormant
        draft wakes now and then and is measured again."""
        rate = self.draft_acceptance.pooled.rate
        return self.config.dynamic_k and choose_k([rate], [self.k_max], 0, self.cost, self.draft_cost)[0] == 0

    def _observe_draft(self, work: DraftWork, ms: float) -> None:
        if work.rounds:
            self.draft_cost.observe(ms, work.rounds, len(work.entries))
            self.branch_cost.observe(ms, work.rounds * len(work.entries), work.branches * max(1, work.rounds - 1))
