"""Whether the draft works at all (router.regime): resting until drafting is measured to get further
through the text per ms, each regime tried again now and then (less often while the evidence is
clear), per size of load. Progress counts in steps of prompt lookup alone (LookupShadow replays it
over the text), so the text's yield cancels."""

from __future__ import annotations

import random
from collections.abc import Callable

from router.config import RouterConfig
from router.lookup import LookupShadow, PromptLookup
from router.regime import FIRST_PROBE, MARGIN, PAIRED, PROBE_AFTER, SETTLE, SPACED, WINDOW, DraftRegime
from tests.conftest import hf_greedy
from tests.stack import REALISTIC_STEP_S, complete, start_draft, start_router, start_target
from tests.test_router_integration import metric, prompts

Rate = Callable[[bool, int], float]  # (drafting, step) -> progress (steps of lookup alone) per ms


def run(regime: DraftRegime, steps: int, running: int, rate: Rate, start: int = 0) -> list[bool]:
    """`steps` steps of `running` sequences, each getting rate(drafting, step) per ms: the regimes taken."""
    taken = []
    for step in range(start, start + steps):
        drafting = regime.drafting(running)
        regime.observe(round(100 * rate(drafting, step)), 100.0)
        taken.append(drafting)
    return taken


def runs(taken: list[bool]) -> list[tuple[bool, int]]:
    """Consecutive steps of one regime: (drafting, steps)."""
    out: list[tuple[bool, int]] = []
    for d in taken:
        if out and out[-1][0] == d:
            out[-1] = (d, out[-1][1] + 1)
        else:
            out.append((d, 1))
    return out


def drafts_within(taken: list[bool], probes: int) -> bool:
    """Whether the draft was at work within `probes` probes (each a WINDOW and a PROBE_AFTER gap) and
    in every run longer than a probe after that."""
    regimes = runs(taken)
    turned = next((i for i, (drafting, n) in enumerate(regimes) if drafting and n > WINDOW), len(regimes))
    return turned < len(regimes) and all(drafting for drafting, n in regimes[turned:] if n > WINDOW) and \
        sum(n for _, n in regimes[:turned]) <= FIRST_PROBE + probes * (WINDOW + PROBE_AFTER)


def drafting_pays(drafting: bool, step: int) -> float:
    return 3.0 if drafting else 2.0


def resting_pays(drafting: bool, step: int) -> float:
    return 2.0 if drafting else 3.0


# ---- progress in steps of prompt lookup alone ------------------------------------------------------
def replay(text: list[int], start: int, k: int = 4, grown_by: int = 1) -> list[int]:
    """LookupShadow over `text` from `start`, the text growing `grown_by` tokens at a time: the steps
    each growth resolved (the last growth finishes the text)."""
    shadow, out = LookupShadow(k, start), []
    for end in range(start + grown_by, len(text) + grown_by, grown_by):
        out.append(shadow.advance(text[:end], finished=end >= len(text)))
    return out


def test_lookup_alone_replayed_emits_its_matched_guesses_and_the_target_s_token_a_step():
    text = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 7]  # the output starts at 6
    # no earlier match for "... 6" or "... 6 1": one token a step; after "1 2" lookup guesses 3 4 5 6
    # (what followed "1 2" at the start), all four match, and the target's 7 comes with them
    assert sum(replay(text, 6)) == 3, "1 | 2 | 3 4 5 6 7"
    assert replay(text, 6, grown_by=len(text)) == [3], "the same steps, counted at once"
    # k = 2: 3 4 and the target's 5; then "2 3 4 5" was followed by 6 1: 6 matches, the target's 7
    assert sum(replay(text, 6, k=2)) == 4, "1 | 2 | 3 4 5 | 6 7"


def test_a_replayed_step_resolves_only_once_the_text_shows_where_its_guesses_stop():
    text = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 7]
    steps = replay(text, 8)  # from 8 lookup guesses 3 4 5 6, all of which the text will hold
    assert steps[:4] == [0, 0, 0, 0], "3, 4, 5, 6 emitted: the step still depends on the token after them"
    assert steps[4] == 1 and sum(steps) == 1, "7 shows it: one step of five tokens"


def test_a_finished_text_ends_the_replay_with_one_step_for_what_is_left():
    text = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    shadow = LookupShadow(4, 8)
    assert shadow.advance(text, finished=False) == 0, "3 matches lookup's first guess: the step goes on"
    assert shadow.advance(text, finished=True) == 1 and shadow.pos == len(text)


def test_a_predicted_output_is_replayed_as_lookup_alone_would_propose_it():
    prompt, output = list(range(100, 108)), list(range(200, 220))  # nothing repeats: one token a step alone
    text = prompt + output
    plain = LookupShadow(4, len(prompt)).advance(text, finished=True)
    predicted = LookupShadow(4, len(prompt), PromptLookup(prediction=output, start=len(prompt)))
    assert plain == len(output)
    assert predicted.advance(text, finished=True) == 4, "the prediction proposed: 4 guesses and the target's token"


def text_with_repeats(seed: int, n: int = 30_000) -> list[int]:
    """Fresh runs (one token a step for lookup alone) and repeats of earlier runs (up to k + 1 tokens a
    step), in random segments: lookup's yield swings from window to window."""
    rng = random.Random(seed)
    text = [rng.randrange(10_000, 10_050) for _ in range(64)]
    while len(text) < n:
        size = rng.randint(8, min(120, len(text) - 1))
        if rng.random() < 0.5:
            at = rng.randrange(0, len(text) - size)
            text += text[at:at + size]
        else:
            text += [rng.randrange(1_000_000) for _ in range(size)]
    return text


def test_the_replay_counts_the_same_steps_however_the_text_was_emitted():
    """What lookup alone would have needed for a text does not depend on the steps that made it: any
    regime's steps, short or long, resolve the same steps in all (each once the text shows it)."""
    for seed in range(3):
        text = text_with_repeats(seed, n=3000)
        whole = LookupShadow(4, 64).advance(text, finished=True)
        rng = random.Random(seed)
        shadow, end, total = LookupShadow(4, 64), 64, 0
        while end < len(text):
            end = min(len(text), end + rng.randint(1, 6))
            total += shadow.advance(text[:end], finished=end == len(text))
        assert total == whole and 1200 < whole < 2200, seed


def regimes_over(text: list[int], ahead: float, steps: int = 2000) -> list[bool]:
    """The regime over `text`: resting, a step is lookup alone's (its matched guesses and the target's
    token, 10 ms); drafting, the same tokens and one more (the draft finds what lookup would have, and
    a token further) at `ahead` times the tokens per ms. Progress: what LookupShadow makes of the text."""
    regime, lookup, shadow, pos, taken = DraftRegime(), PromptLookup(), LookupShadow(4, 64), 64, []
    for _ in range(steps):
        drafting = regime.drafting(1)
        guesses = lookup.propose(text, 4, end=pos)
        matched = 0
        while matched < len(guesses) and guesses[matched] == text[pos + matched]:
            matched += 1
        emitted = matched + 2 if drafting else matched + 1
        ms = 10.0 * emitted / (matched + 1) / ahead if drafting else 10.0
        pos += emitted
        progress = shadow.advance(text[:pos], finished=False) if regime.measuring else None
        if not regime.measuring:
            shadow.restart(pos)
        regime.observe(progress, ms)
        taken.append(drafting)
    return taken


def test_whichever_regime_gets_through_the_text_faster_is_kept_whatever_the_text_s_yield():
    """Lookup alone makes 1 to 5 tokens a step as the text repeats itself or not, window by window.
    Counted in steps of lookup alone over the text each regime made, a draft 20% ahead takes its place
    within two probes and keeps it, and one 20% behind never holds it for longer than a probe."""
    for seed in range(3):
        text = text_with_repeats(seed)
        assert drafts_within(regimes_over(text, ahead=1.2), probes=2), seed
        behind = regimes_over(text, ahead=1 / 1.2)
        assert not any(drafting for drafting, n in runs(behind) if n > WINDOW), seed


def test_a_step_that_resolved_no_replayed_step_still_counts_its_time():
    """A replay waits for the token that resolves its step: a measured step may bring 0 steps of lookup
    alone and the next two. Both count, with their ms; a step without decoders (None) does not."""
    regime = DraftRegime()
    for _ in range(SETTLE + 1):
        regime.drafting(1)
    size = regime.sizes[0]
    regime.observe(0.0, 10.0)
    regime.drafting(1)
    regime.observe(None, 10.0)
    assert list(size.before) == [(0.0, 10.0)]


def test_it_rests_first_then_tries_drafting_for_a_window_and_keeps_the_better():
    """A draft sharing the target's compute earns its place: it rests until a probe measures it paying."""
    # two samples turn it, resting on for the steps paired with the second (PAIRED, once settled); the
    # third agrees with the first two: the next gap is twice as long
    expected = [(False, FIRST_PROBE), (True, WINDOW), (False, PROBE_AFTER), (True, WINDOW), (False, SETTLE + PAIRED),
                (True, PROBE_AFTER), (False, WINDOW), (True, 2 * PROBE_AFTER), (False, WINDOW)]
    assert runs(run(DraftRegime(), sum(n for _, n in expected), 1, drafting_pays)) == expected


def test_probes_space_out_while_the_evidence_is_clear():
    """Each probe of the worse regime costs its window: once CLEAR_AFTER samples agree clearly, the gap
    doubles with each sample that agrees again, up to SPACED times PROBE_AFTER."""
    gaps = [1, 1] + [2 ** n for n in range(1, SPACED.bit_length())] + [SPACED] * 2
    taken = run(DraftRegime(), FIRST_PROBE + sum(g * PROBE_AFTER + WINDOW for g in gaps), 1, resting_pays)
    assert runs(taken) == [(False, FIRST_PROBE)] + [r for g in gaps for r in ((True, WINDOW), (False, g * PROBE_AFTER))]


def test_a_probe_that_disagrees_brings_the_gap_back():
    regime = DraftRegime()
    run(regime, 4000, 1, resting_pays)
    assert regime.sizes[0].spacing == SPACED
    taken: list[bool] = []
    while not any(taken) or taken[-1]:  # up to the first step after a probe of drafting, now paying
        taken += run(regime, 1, 1, drafting_pays)
    taken += run(regime, PROBE_AFTER, 1, drafting_pays)
    assert runs(taken)[-3:] == [(True, WINDOW), (False, PROBE_AFTER), (True, 1)]
    assert regime.sizes[0].spacing == 1 and not regime.sizes[0].prefer  # one sample the other way: no turn yet


def test_a_difference_within_the_margin_keeps_the_draft_resting():
    taken = run(DraftRegime(), 6 * (PROBE_AFTER + WINDOW), 4, lambda drafting, step: 10.0 * (1 + MARGIN / 2)
                if drafting else 10.0)
    assert not any(drafting for drafting, n in runs(taken) if n > WINDOW) and not taken[-1]


def test_it_follows_a_change_in_what_pays_within_a_few_probes():
    regime = DraftRegime()
    run(regime, 8 * (PROBE_AFTER + WINDOW), 1, resting_pays)
    assert not regime.drafting(1)
    taken = run(regime, 12 * (PROBE_AFTER + WINDOW), 1, drafting_pays)
    assert [drafting for drafting, n in runs(taken) if n > WINDOW][-1]  # the median of the last probes turned
    assert regime.sizes[0].prefer


def test_text_that_helps_lookup_more_or_less_does_not_hide_which_pays():
    """Tokens per ms swing with each request's text (prompt lookup finds repeated blocks or none), for
    both regimes alike: here a request of 40 steps makes 0.3-1.7x the mean. A probe is paired with the
    preferred regime's steps before and after it, and the median of the last few pairs decides, so
    drafting, 20% ahead throughout, takes its place within a few probes and keeps it although a lean
    request's drafting makes less than a rich one's resting."""
    for seed in range(5):
        rng = random.Random(seed)
        levels = [rng.uniform(0.3, 1.7) for _ in range(100)]
        taken = run(DraftRegime(), 3000, 1,
                    lambda drafting, step, levels=levels: levels[step // 40] * (1.2 if drafting else 1.0))
        assert drafts_within(taken, probes=4)


def test_a_new_size_of_load_starts_from_the_last_sizes_preference_and_then_keeps_its_own():
    regime = DraftRegime()
    run(regime, 2 * (PROBE_AFTER + WINDOW), 1, resting_pays)
    taken = run(regime, 8 * (PROBE_AFTER + WINDOW), 16, drafting_pays)
    assert not taken[0]  # c = 16 starts resting, as c = 1 was
    assert [drafting for drafting, n in runs(taken) if n > WINDOW][-1]
    assert not run(regime, 1, 1, resting_pays)[0]  # c = 1 still rests
    assert regime.size_of(3) == regime.size_of(4) == regime.size_of(5) != regime.size_of(6)
    assert regime.size_of(12) == regime.size_of(16) == regime.size_of(23) != regime.size_of(11)


def test_a_size_that_measured_nothing_itself_follows_the_evidence_measured_since():
    """A warm-up's four requests make sizes 2-5 seen before any evidence; c = 1 then measures the draft
    paying, and the c = 4 load after it starts drafting too, not from the prior."""
    regime = DraftRegime()
    run(regime, 4, 4, drafting_pays)  # the warm-up
    run(regime, 6 * (PROBE_AFTER + WINDOW), 1, drafting_pays)
    assert regime.sizes[0].prefer and not regime.sizes[regime.size_of(4)].own
    assert run(regime, PROBE_AFTER, 4, drafting_pays) == [True] * PROBE_AFTER


def test_the_first_steps_of_a_run_are_not_measured():
    """A switch's first steps carry the other regime's effects (proposals prepared before it, a draft
    catching up): were they measured, this draft, worth nothing only while it settles, would rest."""
    regime = DraftRegime()
    taken: list[bool] = []
    for _ in range(6 * (PROBE_AFTER + WINDOW)):
        drafting = regime.drafting(1)
        settling = (runs(taken)[-1][1] if taken and taken[-1] == drafting else 0) < SETTLE
        regime.observe(0 if drafting and settling else (300 if drafting else 200), 100.0)
        taken.append(drafting)
    assert drafts_within(taken, probes=2)


def test_steps_decided_elsewhere_are_not_samples():
    regime = DraftRegime()
    for _ in range(FIRST_PROBE + WINDOW + PROBE_AFTER):
        regime.unmeasured()  # the loop's choice for a seeded request (or no draft): it drafts
        regime.observe(0, 10.0)
    assert all(not size.before and not size.samples for size in regime.sizes.values())


# ---- the step loop with real services on loopback -------------------------------------------------
class Scripted(DraftRegime):
    """The regime's choice given by the test: resting for the first `rest_steps` steps, then drafting."""

    def __init__(self, rest_steps: int) -> None:
        super().__init__()
        self.rest_steps, self.steps = rest_steps, 0

    def drafting(self, running: int) -> bool:
        self.steps += running > 0  # (the loop asks on idle turns too)
        return self.steps > self.rest_steps


def test_a_resting_draft_proposes_nothing_and_catches_up_when_back_at_work(model_pair):
    """Resting, the loop verifies no drafts (prompt lookup off here) and the draft only mirrors prompts;
    back at work mid-request, the draft catches up on the tokens it missed and every draft it proposes
    is accepted (it is the target's own weights). Greedy outputs are transformers' throughout."""
    target_dir, _ = model_pair
    target, _ = start_target(target_dir, step_delay_s=REALISTIC_STEP_S)
    draft, _ = start_draft(target_dir)
    router = start_router(RouterConfig(k_max=4, prompt_lookup=False), target.address, draft.address, target_dir)
    try:
        lane = next(iter(router.server.engine.lanes.values()))
        lane.loop.regime = Scripted(rest_steps=10**9)
        p = prompts(2)[1]
        assert complete(router.url, p, 24)["choices"][0]["token_ids"] == hf_greedy(target_dir, p, 24)
        assert metric(router.url, "tandem:spec_decode_num_draft_tokens_total") == 0
        assert metric(router.url, 'tandem:draft_rests_total{reason="regime"}') > 0
        assert metric(router.url, "tandem:pipeline_lookups_total") == 0
        rested = metric(router.url, 'tandem:draft_rests_total{reason="regime"}')

        lane.loop.regime = Scripted(rest_steps=12)  # back at work 12 steps into the next request
        q = prompts(3)[2]
        assert complete(router.url, q, 40)["choices"][0]["token_ids"] == hf_greedy(target_dir, q, 40)
        assert metric(router.url, 'tandem:draft_rests_total{reason="regime"}') > rested
        drafted = metric(router.url, "tandem:spec_decode_num_draft_tokens_total")
        assert drafted > 0 and metric(router.url, "tandem:spec_decode_num_accepted_tokens_total") == drafted
    finally:
        router.stop(), target.stop(), draft.stop()
