"""Prefix caching through the whole stack on loopback: multi-turn conversations sharing a system
prompt, each turn resending its history. Greedy outputs equal transformers with caching and with
--no-prefix-caching, the hit counters of both services move, and services that lost their caches
(restarted between turns) cost a refused attach and a recompute, never a wrong token."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from router.config import RouterConfig
from tests.conftest import hf_greedy
from tests.stack import complete, running_stack, start_draft, start_target, wait_until
from tests.test_router_integration import metric

SYSTEM = [(11 * j) % 300 + 5 for j in range(70)]
TURNS = 3
OUT = 12


def user(conv: int, turn: int) -> list[int]:
    return [(7 * conv + 13 * turn + 3 * j) % 300 + 5 for j in range(9 + 4 * turn)]


def converse(url: str, conv: int) -> list[tuple[list[int], list[int], int]]:
    """TURNS turns, each resending the whole history: [(prompt, output, the usage's cached prompt tokens)]."""
    history, out = list(SYSTEM), []
    for turn in range(TURNS):
        prompt = history + user(conv, turn)
        answer = complete(url, prompt, OUT)
        tokens = answer["choices"][0]["token_ids"]
        out.append((prompt, tokens, answer["usage"]["prompt_tokens_details"]["cached_tokens"]))
        history = prompt + tokens
    return out


def config(caching: bool) -> RouterConfig:
    return RouterConfig(max_num_batched_tokens=64, max_num_seqs=8, draft_timeout_s=2.0, target_grace_s=20.0,
                        dynamic_k=False, prefix_caching=caching)


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-prefix-caching"])
def test_multi_turn_conversations_equal_transformers_and_hit_the_cache(model_pair, caching):
    target_dir, _ = model_pair
    with running_stack(model_pair, config(caching)) as stack:
        url = stack["router"].url
        with cf.ThreadPoolExecutor(3) as pool:
            conversations = list(pool.map(lambda c: converse(url, c), range(3)))
        for conv in conversations:
            for prompt, tokens, _ in conv:
                assert tokens == hf_greedy(target_dir, prompt, OUT)
        # every later turn attaches the full blocks (16 tokens) of the history the target cached at the end of
        # the turn before (all but its last token); first turns share the system prompt when they start late
        history = sum((len(prompt) + OUT - 1) // 16 * 16 for conv in conversations for prompt, _, _ in conv[:-1])
        for service, least in (("target", history), ("draft", history // 2)):
            queries = metric(url, f'tandem:prefix_cache_queries_total{{service="{service}"}}')
            hits = metric(url, f'tandem:prefix_cache_hits_total{{service="{service}"}}')
            if caching:
                assert least <= hits < queries, service
            else:
                assert queries == hits == 0
        # each answer's usage says how much of its prompt came from the target's cache (OpenAI's cached_tokens)
        cached = [c for conv in conversations for _, _, c in conv]
        if caching:
            for conv in conversations:
                for (prompt, _, _), (_, _, later) in zip(conv, conv[1:], strict=False):
                    assert later % 16 == 0 and (len(prompt) + OUT - 1) // 16 * 16 <= later < len(prompt) + OUT
            assert sum(cached) <= metric(url, 'tandem:prefix_cache_hits_total{service="target"}')
        else:
            assert cached == [0] * len(cached)
        assert metric(url, "tandem:spec_decode_num_draft_tokens_total") > 0, "speculation ran"


def test_services_that_lost_their_caches_refuse_the_attach_and_the_router_recomputes(model_pair):
    target_dir, draft_dir = model_pair
    with running_stack(model_pair, config(True)) as stack:
        router, parts = stack["router"], stack["parts"]
        first = converse(router.url, 0)
        for name, start in (("target", start_target), ("draft", start_draft)):
            port = parts[name].port
            parts[name].stop(timeout=15)
            parts[name], _ = start(target_dir if name == "target" else draft_dir, port=port)
        assert wait_until(lambda: metric(router.url, "tandem:draft_available") == 1, 30)
        assert wait_until(lambda: metric(router.url, "tandem:target_available") == 1, 30)
        history = first[-1][0] + first[-1][1]
        prompt = history + user(0, TURNS)
        out = complete(router.url, prompt, OUT)["choices"][0]["token_ids"]
        assert out == hf_greedy(target_dir, prompt, OUT)
        assert metric(router.url, 'tandem:prefix_cache_attach_misses_total{service="target"}') >= 1
        # the recompute published the history again: the next turn attaches it
        hits = metric(router.url, 'tandem:prefix_cache_hits_total{service="target"}')
        prompt2 = prompt + out + user(0, TURNS + 1)
        assert complete(router.url, prompt2, OUT)["choices"][0]["token_ids"] == hf_greedy(target_dir, prompt2, OUT)
        assert metric(router.url, 'tandem:prefix_cache_hits_total{service="target"}') >= hits + len(prompt) - 16
