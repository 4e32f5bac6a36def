"""bench.ceiling: the replay of one stream's proposals against measured step costs (no model here)."""

from __future__ import annotations

import random

import pytest

from bench.ceiling import (
    Costs,
    acceptance_needed,
    best_combined,
    hit_bound,
    lookup_chains,
    policies,
    pooled_rates,
    replay,
    speedups,
    with_synthetic_draft,
)

FLAT = Costs(step_ms=(10.0,) * 5, prefill_ms=0.0, draft_round_ms=1.0)  # verifying is free: only steps count


def never(_chain: tuple[int, int, int]) -> tuple[str, int]:
    return "draft", 0


def test_lookup_chains_follow_the_router_lookup() -> None:
    prompt, output = [1, 2, 3, 4, 1, 2], [3, 4, 1, 2, 3, 4]
    chains = lookup_chains(prompt, output, 4)
    assert chains[0] == (4, 4)  # "1 2" was followed by "3 4 1 2": all four right
    assert len(chains) == len(output)
    assert lookup_chains([5, 6, 7], [8, 9], 4) == [(0, 0), (0, 0)]  # nothing repeats: no offer


def test_target_only_takes_one_step_a_token() -> None:
    chains = [[(0, 0, 0)] * 7, [(3, 0, 0)] * 5]
    assert replay(chains, FLAT, never) == (12, 120.0)


def test_a_step_emits_the_matched_drafts_and_one_more_but_not_past_the_end() -> None:
    chains = [[(2, 0, 0)] * 7]  # the draft is right about the next two tokens everywhere
    tokens, ms = replay(chains, FLAT, lambda c: ("draft", 2))
    assert (tokens, ms) == (7, 30.0)  # steps emit 3, 3, then the last token alone
    tokens, ms = replay(chains, FLAT, lambda c: ("draft", 1))
    assert (tokens, ms) == (7, 40.0)  # k caps what a step may accept


def test_the_draft_sequential_adds_its_rounds_and_lookup_adds_nothing() -> None:
    chains = [[(1, 1, 1)] * 4]
    assert replay(chains, FLAT, lambda c: ("draft", 1), sequential=True) == (4, 2 * (10.0 + 1.0))
    assert replay(chains, FLAT, lambda c: ("lookup", 1), sequential=True) == (4, 20.0)


def test_prefill_caps_the_tokens_per_second_speed_up() -> None:
    chains = [[(1, 0, 0)] * 10]
    costs = Costs(step_ms=(10.0, 10.0), prefill_ms=100.0, draft_round_ms=0.0)  # prefill = the decode time
    decode, total = speedups(chains, costs, lambda c: ("draft", 1), sequential=False)
    assert decode == pytest.approx(2.0)
    assert total == pytest.approx(200.0 / 150.0)  # Amdahl: half the time did not get faster


def test_the_oracle_beats_every_policy() -> None:
    rng = random.Random(3)
    chains = [[(rng.choice([0, 0, 1, 4]), rng.choice([0, 2, 4]), rng.choice([0, 4])) for _ in range(200)]
              for _ in range(4)]
    chains = [[(d, min(looked, offered), offered) for d, looked, offered in s] for s in chains]
    costs = Costs(step_ms=(10.0, 11.0, 12.0, 13.0, 14.0), prefill_ms=0.0, draft_round_ms=0.0)
    by_policy = {name: speedups(chains, costs, p, False)[0] for name, p in policies(chains, 4).items()}
    oracle = by_policy.pop("oracle: the better source, k = its match")
    assert oracle >= max(by_policy.values())
    assert by_policy["target only"] == 1.0


def test_rates_count_tried_positions_as_the_routers_trackers_do() -> None:
    chains = [[(0, 2, 4), (4, 0, 0), (1, 1, 1)]]  # lookup offers twice; the draft is verified at k = 4 each time
    draft, lookup = pooled_rates(chains, 4)
    assert draft == pytest.approx((0 + 4 + 1) / (1 + 4 + 2))  # a rejection is one more tried position
    assert lookup == pytest.approx((2 + 1) / (3 + 1))  # an offer of one, accepted: nothing was rejected


def test_mixing_by_expected_tokens_takes_the_longer_sure_proposal() -> None:
    chains = [[(4, 1, 1)] * 50]  # lookup offers one right token; the draft four
    pols = policies(chains, 4)
    lookup_first = replay(chains, FLAT, pols["lookup where it offers, else draft k = 4"])[1]
    by_expectation = replay(chains, FLAT, pols["the source with more expected tokens, draft k = 4"])[1]
    assert by_expectation == 10 * 10.0 and lookup_first == 25 * 10.0


def test_a_synthetic_draft_is_accepted_at_its_rate_and_seeded() -> None:
    chains = [[(0, 0, 0)] * 20_000]
    mean = sum(c[0] for c in with_synthetic_draft(chains, 0.5, 4)[0]) / 20_000
    assert mean == pytest.approx(0.5 + 0.25 + 0.125 + 0.0625, rel=0.03)  # sum of a^j, j = 1..k
    assert with_synthetic_draft(chains, 0.5, 4, seed=7) == with_synthetic_draft(chains, 0.5, 4, seed=7)
    assert all(c[0] == 0 for c in with_synthetic_draft(chains, 0.0, 4)[0])
    tail = with_synthetic_draft([[(0, 0, 0)] * 3], 0.999999, 4)[0]
    assert [c[0] for c in tail] == [3, 2, 1]  # never past the stream's end


def test_acceptance_needed_is_the_least_that_reaches_the_goal() -> None:
    chains = [[(0, 0, 0)] * 2000]  # no lookup anywhere: the draft alone
    need = acceptance_needed(chains, FLAT, 4, goal=2.0)
    assert need is not None
    assert best_combined(with_synthetic_draft(chains, need, 4), FLAT, 4)[1] >= 2.0
    assert best_combined(with_synthetic_draft(chains, need - 0.05, 4), FLAT, 4)[1] < 2.0
    prefill_bound = Costs(step_ms=FLAT.step_ms, prefill_ms=2000 * 10.0, draft_round_ms=0.0)
    assert acceptance_needed(chains, prefill_bound, 4, goal=2.0) is None  # half the time is prefill


def test_the_hit_bound_counts_positions_whose_token_the_guesses_hold() -> None:
    ranks = [[0, 1, 3], [8, 0]]
    assert hit_bound(ranks, 1) == pytest.approx(2 / 5)
    assert hit_bound(ranks, 4) == pytest.approx(4 / 5)
    assert hit_bound(ranks, 8) == pytest.approx(4 / 5)  # the capped rank is past every cache


def test_measured_streams_are_the_models_own_greedy_ones(model_pair) -> None:
    """The target's continuations and the draft's chains, checked against transformers' greedy decoding
    of each model; the costs are times of real steps."""
    import torch

    from bench.ceiling import markdown, measure, report
    from model_zoo.hf_draft import load_causal_lm

    target_dir, draft_dir = model_pair
    m = measure(target_dir.parent, k_max=2, steps=1)
    assert len(m.prompts) == len(m.outputs) == len(m.chains) and all(map(len, m.outputs))
    assert [len(c) for c in m.chains] == [len(o) for o in m.outputs]
    target, draft = load_causal_lm(target_dir), load_causal_lm(draft_dir)
    with torch.inference_mode():
        for prompt, output, chains in list(zip(m.prompts, m.outputs, m.chains, strict=True))[:3]:
            ids = torch.tensor([prompt])
            greedy = target.generate(ids, max_new_tokens=len(output), min_new_tokens=len(output), do_sample=False)
            assert greedy[0, len(prompt):].tolist() == output
            for t in (0, len(output) // 2):
                history = torch.tensor([prompt + output[:t]])
                proposed = draft.generate(history, max_new_tokens=2, min_new_tokens=2, do_sample=False)[0, -2:].tolist()
                want = output[t:t + 2]
                matched = 0
                while matched < len(want) and proposed[matched] == want[matched]:
                    matched += 1
                assert chains[t][0] == matched
    first_right = [c[0] > 0 for s in m.chains for c in s]
    ranked_first = [r == 0 for s in m.ranks for r in s]  # one teacher-forced pass, apart from the chains' rounds
    assert sum(a != b for a, b in zip(first_right, ranked_first, strict=True)) <= len(first_right) // 100
    assert 0 < sum(first_right) < len(first_right)  # the pair agrees sometimes: the check above says something
    assert len(m.costs.step_ms) == 3 and min(m.costs.step_ms) > 0
    assert m.costs.prefill_ms > 0 and m.costs.draft_round_ms > 0
    text = markdown("pair", report(m.chains, m.costs, 2, goal=1.5, ranks=m.ranks))
    assert "| target only | 1.00x | 1.00x | 1.00x |" in text and "hits at most: g = 1: " in text
