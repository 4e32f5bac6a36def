"""Chained steps: step t+1 sent while the target still computes step t, so that it runs right after
step t instead of a round trip later (target.proto, StepEntry.chained).

    router   send t ... draft lands ... send t+1 (chained) ....... answer t: apply ...... answer t+1
    target   [ step t .................................][ step t+1 ................]
                                                      ^ no wait for the router: t+1 was queued

The router cannot know what step t emits, so each chained entry carries the speculation cache's
proposals keyed by outcome ("if t emitted `after`, verify these drafts"), and prompt lookup's guesses
at the same outcomes; the target takes the one whose outcome happened, or runs the sequence at k = 0.
The router keeps its books a step behind: it learns which alternative ran from step t's answer
(`resolve`, the target's rule), and its scheduler plans only steps that need no decision from step
t's outcome (`chainable`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace

import grpc

from router.scheduler import StepPlan
from router.sequence import Sequence
from router.spec_policy import choose_k, expected_tokens
from router.speculation import Proposal, best_proposal, point_guesses
from router.speculator import Speculator
from router.step_entries import logprobs_wanted
from tandem.v1 import target_pb2


@dataclass
class ChainedStep:
    """A step sent behind the one running: its sequences (those of that step, in order), the
    alternatives each carries, and the ticket its answer is read with."""

    seqs: list[Sequence]
    alternatives: list[list[target_pb2.Alternative]]
    ks: list[int]  # the policy's k per sequence (what a proposal was cut to)
    ticket: grpc.aio.StreamStreamCall
    looked: list[dict[int, bool]] = field(default_factory=list)  # per sequence: its lookup alternatives (with_lookup)
    chosen: list[int] = field(default_factory=list)  # per sequence: StepResult.alternative, once resolved
    proposals: list[Proposal] | None = None  # ... and the drafts (with q) it verifies
    plan: StepPlan | None = None  # once the step ahead was applied: the step as booked
    sent: list[list[int]] = field(default_factory=list)  # ... the drafts each sequence verifies
    launched: bool = False  # ... and whether the draft got a call for its outcomes

    @property
    def seq_ids(self) -> set[int]:
        return {s.seq_id for s in self.seqs}

    def resolve(self, ahead: target_pb2.StepResponse) -> None:
        """The step ahead of it answered: what each of its entries verifies (the target's rule)."""
        assert len(ahead.results) >= len(self.seqs), "chained sequences are the step ahead's decodes, first"
        picked = [resolve(a, r.tokens) for a, r in zip(self.alternatives, ahead.results, strict=False)]
        self.chosen = [c for c, _ in picked]
        self.proposals = [p for _, p in picked]


def alternatives(seq: Sequence, verifying: Seq[int], k: int, greedy: bool) -> list[target_pb2.Alternative]:
    """What the speculation cache holds for the outcomes of verifying `verifying` after seq's history:
    per outcome it prepared for (a branch "d_1..d_j accepted, then x", or the plain proposal after full
    acceptance, whose first token is the bonus guess), the proposal the unchained step would take
    after it (best_proposal), cut to k drafts."""
    if k <= 0:
        return []
    n, v = len(seq.tokens), len(verifying)
    outcomes: list[tuple[int, ...]] = []
    for p in seq.prepared:
        if p.start == n and p.prefix:
            after = p.prefix
        elif p.start == n + v and not p.prefix and p.drafts:
            after = (*verifying, p.drafts[0])
        else:
            continue
        if len(after) <= v + 1 and tuple(verifying[:len(after) - 1]) == after[:-1] and after not in outcomes:
            outcomes.append(after)
    out = []
    for after in outcomes:
        drafts, probs = best_proposal(seq.prepared, [*seq.tokens, *after])
        if drafts:
            out.append(target_pb2.Alternative(after=after, drafts=drafts[:k], draft_probs=[] if greedy else probs[:k]))
    return out


def with_lookup(seq: Sequence, verifying: Seq[int], k: int, drafted: list[target_pb2.Alternative]
                ) -> tuple[list[target_pb2.Alternative], dict[int, bool]]:
    """The draft's alternatives and prompt lookup's guesses at the same step's outcomes, and which of
    them are lookup's (1 + index -> whether the draft had prepared that outcome too). Per accepted
    length j, lookup's guess after the history and d_1..d_j: its first token the outcome's last (the
    target's own where it is not d_{j+1}; the bonus after all of them), the rest its drafts.

        history h, verifying d1 d2 d3        lookup after h d1     -> x y z   (x != d2: the outcome "d1, x")
                                             lookup after h d1 d2 d3 -> b c   (the outcome "d1 d2 d3, b")

    Unchained, a step takes lookup's proposal or the draft's, whichever expects more tokens at its
    proposer's acceptance (Speculator.prefers_lookup); chained, lookup had nothing to offer (it needs
    the outcome), and on SmolLM2 two-device, where lookup's first guesses are right three times in
    four and the draft's one in four, the defaults made 0.86-0.89x of lookup alone. Where both name
    an outcome, the same rule picks one."""
    if k <= 0:
        return drafted, {}
    out, looked = list(drafted), {}
    named = {tuple(a.after): i for i, a in enumerate(drafted)}
    history = [*seq.tokens, *verifying]
    greedy = seq.request.sampling.greedy
    for j in range(len(verifying) + 1):
        guess = seq.lookup.peek(history[:len(seq.tokens) + j], len(seq.tokens), k + 1)
        if len(guess) < 2 or (j < len(verifying) and guess[0] == verifying[j]):
            continue  # nothing to verify after it, or the outcome that goes on to d_{j+2}
        after, drafts = (*verifying[:j], guess[0]), guess[1:]
        alt = target_pb2.Alternative(after=after, drafts=drafts, draft_probs=[] if greedy else point_guesses(drafts))
        i = named.get(after)
        if i is None:
            out.append(alt)
            looked[len(out)] = False
        elif Speculator.prefers_lookup(seq, len(drafted[i].drafts), len(drafts)):
            out[i] = alt
            looked[i + 1] = True
    return out, looked


def chained_entries(seqs: list[Sequence], verifying: list[list[int]], ks: list[int], max_model_len: int,
                    lookup: bool = False) -> tuple[list[target_pb2.StepEntry], list[list[target_pb2.Alternative]],
                                                   list[dict[int, bool]]] | None:
    """The chained step after one verifying `verifying[i]` for seqs[i], at most ks[i] drafts each, with
    prompt lookup's guesses at the outcomes where `lookup` (with_lookup; per sequence, which alternatives
    are lookup's); None where it should not be sent: a sequence too close to max_model_len, or one that
    wants drafts and has nothing prepared (the unchained step may find it a proposal, from prompt lookup)."""
    entries, alts, looks = [], [], []
    for seq, drafts, k in zip(seqs, verifying, ks, strict=True):
        room = max_model_len - len(seq.tokens) - len(drafts) - 2  # drafts after the longest outcome
        if room < 0:
            return None
        drafted = alternatives(seq, drafts, min(k, room), seq.request.sampling.greedy)
        mixed, looked = with_lookup(seq, drafts, min(k, room), drafted) if lookup else (drafted, {})
        alts.append(mixed)
        looks.append(looked)
        if k > 0 and not alts[-1]:
            return None
        entries.append(target_pb2.StepEntry(
            seq_id=seq.seq_id, emit=True, chained=True, alternatives=alts[-1], sampling=seq.request.sampling_proto,
            logprobs=logprobs_wanted(seq), prompt_len=seq.num_prompt, lora=seq.request.lora,
            cache_salt=seq.request.salt))
    return entries, alts, looks


def resolve(alternatives: list[target_pb2.Alternative], emitted: Seq[int]) -> tuple[int, Proposal]:
    """The target's rule: the alternative whose `after` is what step t emitted (1 + its index, or 0),
    and the proposal it verifies."""
    for i, a in enumerate(alternatives):
        if list(a.after) == list(emitted):
            return i + 1, (list(a.drafts), list(a.draft_probs))
    return 0, ([], [])


def chainable(plan: StepPlan, running: list[Sequence], waiting: bool) -> bool:
    """Whether the step after `plan` needs nothing decided from plan's outcome but the proposals: only
    decodes, the same sequences (all running ones, none waiting to be admitted), none with a grammar
    (its masks follow the emitted tokens) or seeded sampling (its k may not depend on timing), and none
    that plan's step may bring to its max_tokens (a chained entry after its end is waste)."""
    if plan.chunks or plan.siblings or plan.preempted or waiting or len(plan.decodes) != len(running):
        return False
    return all(seq.grammar is None and not seq.request.reproducible and not seq.finished
               and (seq.request.max_tokens is None or seq.num_output + k + 1 < seq.request.max_tokens)
               for seq, k in plan.decodes)


def lookup_beats_chaining(spec: Speculator, decoders: list[Sequence], ks: list[int], round_trip_ms: float) -> bool:
    """Whether the step after this one should wait for its answer instead of being chained: a chained
    step that verifies no drafts gives up prompt lookup's guesses, which need the outcome, for the
    round trip it saves (one that verifies drafts carries lookup's guesses at its outcomes, with_lookup).
    Lookup's offers are judged from the history as it is now (one that has a match now mostly has one
    a token later, as in Speculator.plain_next_step), at its acceptance and the k the policy would
    verify, against the chained step's drafts (ks, from chain_ks) at the draft's acceptance, the round
    trip charged to waiting. Where the chained step verifies drafts it is kept unless a sequence has a
    predicted output (router.lookup) to follow: waiting for plain lookup there cost the demo pair
    7-24% of its tokens/s at c=16 in three side-by-side pairs of runs, for no more tokens a step."""
    if any(ks) and not any(s.lookup.prediction for s in decoders):
        return False
    offers = [len(spec.lookup(s)[0][:spec.cap(s)]) for s in decoders]
    if not any(offers):
        return False
    n, cost = len(decoders), spec.cost
    rates = [s.lookup_tracker.rate for s in decoders]
    waited = choose_k(rates, offers, 0, cost, replace(spec.draft_cost, always_ready=True), [False] * n)
    unchained = sum(expected_tokens(a, k) for a, k in zip(rates, waited, strict=True))
    chained = sum(expected_tokens(s.tracker.rate, k) for s, k in zip(decoders, ks, strict=True))  # n at k = 0
    return unchained / (cost.step_ms(n + sum(waited), n) + round_trip_ms) > chained / cost.step_ms(n + sum(ks), n)
