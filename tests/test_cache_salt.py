"""vLLM's cache_salt: prefix caching shares cached prompt blocks only between requests with the same
salt, so a client cannot time another's prompt from its own time to first token. The salt moves the
root of a sequence's block-hash chain (common/block_hash.salted_root) in the router's mirrors and in
both services alike; answers never change, only which blocks a request may attach."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from common.block_hash import ROOT, adapter_root, chain_hashes, salt_digest, salted_root
from engine import SeqInput
from router.__main__ import build_parser
from router.auth import ApiKeys
from router.config import RouterConfig
from router.core import GREEDY, Request
from router.security import RouterSecurity, security_from_args
from tandem.v1 import generate_pb2, generate_pb2_grpc
from tests.conftest import hf_greedy
from tests.stack import complete, running_stack, start_draft, start_router, start_target
from tests.test_prefix_engine import runner_for, tokens
from tests.test_router_integration import metric


# ---- the hashes ------------------------------------------------------------------------------------
def test_a_salt_moves_the_root_and_no_salt_leaves_it():
    assert salt_digest("") == 0 and salted_root(ROOT, 0) == ROOT
    a, b = salt_digest("alice-secret"), salt_digest("bob-secret")
    assert a and b and a != b and salt_digest("alice-secret") == a, "stable, and apart per salt"
    roots = {ROOT, salted_root(ROOT, a), salted_root(ROOT, b), adapter_root("sql"), salted_root(adapter_root("sql"), a)}
    assert len(roots) == 5, "every (adapter, salt) pair hashes from its own root"


def test_a_salt_and_a_tenant_never_show_in_a_requests_repr():
    req = Request("r", [5], GREEDY, cache_salt="alice-secret", tenant=b"key-digest")
    assert "alice-secret" not in repr(req) and "key-digest" not in repr(req)
    assert req.salt == salt_digest("alice-secret", b"key-digest") != salt_digest("alice-secret")


# ---- one service's cache -----------------------------------------------------------------------------
def test_a_salted_sequence_publishes_blocks_only_its_salt_can_attach(model_pair):
    runner = runner_for(model_pair[0])
    prompt, salt = tokens(1, 12), salt_digest("alice")
    runner.forward([SeqInput(1, 0, prompt, num_logits=0, salt=salt), SeqInput(2, 0, prompt[:8], num_logits=0)])
    # the draft's own rounds send no salt: the sequence keeps the one it started with
    runner.forward([SeqInput(1, 12, [5], num_logits=1)])
    runner.commit(1, 13), runner.commit(2, 8)
    salted, plain = chain_hashes(prompt, 4, salted_root(ROOT, salt)), chain_hashes(prompt, 4, ROOT)
    assert runner.prefix.holds(salted), "all three blocks under alice's root"
    assert runner.prefix.holds(plain[:2]) and not runner.prefix.holds(plain), "the unsalted one published its own two"
    assert set(salted).isdisjoint(plain)
    assert not runner.prefix.holds(chain_hashes(prompt, 4, salted_root(ROOT, salt_digest("bob")))[:1])
    runner.release([1, 2])


# ---- through the stack -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(model_pair):
    config = RouterConfig(max_num_batched_tokens=64, max_num_seqs=8, draft_timeout_s=2.0, target_grace_s=20.0,
                          dynamic_k=False)
    with running_stack(model_pair, config) as running:
        yield running["router"]


PROMPT = [(13 * i) % 300 + 4 for i in range(70)]  # four full blocks of 16


def cached(url: str, prompt: list[int], **salt: str) -> tuple[int, list[int]]:
    out = complete(url, prompt, 6, **salt)
    return out["usage"]["prompt_tokens_details"]["cached_tokens"], out["choices"][0]["token_ids"]


def test_only_requests_with_the_same_salt_attach_each_others_prompt(stack, model_pair):
    want = hf_greedy(model_pair[0], PROMPT, 6)
    assert cached(stack.url, PROMPT) == (0, want)
    assert cached(stack.url, PROMPT) == (64, want), "unsalted requests share (the default)"
    draft_hits = metric(stack.url, 'tandem:prefix_cache_hits_total{service="draft"}')
    assert cached(stack.url, PROMPT, cache_salt="alice") == (0, want), "a salt does not see the unsalted blocks"
    assert cached(stack.url, PROMPT, cache_salt="bob") == (0, want), "nor another salt's"
    assert metric(stack.url, 'tandem:prefix_cache_hits_total{service="draft"}') == draft_hits, "the draft neither"
    assert cached(stack.url, PROMPT, cache_salt="alice") == (64, want), "the same salt shares"
    assert metric(stack.url, 'tandem:prefix_cache_hits_total{service="draft"}') > draft_hits, "in the draft too"
    for service in ("target", "draft"):  # the router hashes as the services do: no attach was refused
        assert metric(stack.url, f'tandem:prefix_cache_attach_misses_total{{service="{service}"}}') == 0, service


def test_the_chat_responses_and_grpc_doors_take_the_salt(stack, model_pair):
    messages = [{"role": "user", "content": "tell me about salt " * 12}]
    chat = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    for _ in range(2):
        r = httpx.post(f"{stack.url}/v1/chat/completions", json=chat | {"cache_salt": "carol"}, timeout=60)
        assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=chat | {"cache_salt": "dave"}, timeout=60)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    r = httpx.post(f"{stack.url}/v1/responses", timeout=60, json={
        "model": "tiny", "input": messages[0]["content"], "max_output_tokens": 4, "cache_salt": "erin"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens_details"]["cached_tokens"] == 0
    prompt = PROMPT[::-1]
    with grpc.insecure_channel(stack.grpc_address) as channel:
        generate = generate_pb2_grpc.GenerateStub(channel).GenerateUnary
        for salt, hit in (("frank", 0), ("frank", 64), ("", 0), ("grace", 0)):
            msg = generate_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=3, cache_salt=salt)
            assert generate(msg, timeout=60).cached_prompt_tokens == hit, salt


@pytest.mark.parametrize("salt, message", [("", "non-empty"), ("x" * 257, "at most 256")])
def test_an_empty_or_overlong_salt_is_a_400_naming_it(stack, salt, message):
    r = httpx.post(f"{stack.url}/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": 2,
                                                          "cache_salt": salt})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    assert message in r.json()["error"]["message"]
    assert complete(stack.url, [5, 6], 2)["choices"], "and the router serves on"


# ---- a prefix cache per API key (--cache-salt-per-key) ----------------------------------------------
ALICE, BOB = "alice-key-52c1", "bob-key-9e07"


@pytest.fixture(scope="module")
def keyed(model_pair):
    target, _ = start_target(model_pair[0])
    draft, _ = start_draft(model_pair[1])
    security = RouterSecurity(keys=ApiKeys([ALICE, BOB]), salt_per_key=True)
    router = start_router(RouterConfig(max_num_batched_tokens=64, max_num_seqs=8, dynamic_k=False), target.address,
                          draft.address, model_pair[0], security=security)
    yield router
    router.stop(), target.stop(), draft.stop()


def keyed_cached(url: str, key: str, prompt: list[int], stream: bool = False, **salt: str) -> int:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, "stream": stream, **salt}
    headers = {"Authorization": f"Bearer {key}"}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_each_key_has_its_own_prefix_cache_on_both_doors(keyed):
    prompt = PROMPT[5:]
    assert keyed_cached(keyed.url, ALICE, prompt) == 0
    assert keyed_cached(keyed.url, ALICE, prompt, stream=True) == 64, "one key shares with itself, streamed too"
    assert keyed_cached(keyed.url, BOB, prompt) == 0, "another key does not see it"
    assert keyed_cached(keyed.url, BOB, prompt, stream=True) == 64
    assert keyed_cached(keyed.url, ALICE, prompt, cache_salt="x") == 0, "a salt divides a key's cache further"
    assert keyed_cached(keyed.url, BOB, prompt, cache_salt="x") == 0, "and the same salt under two keys stays apart"
    with grpc.insecure_channel(keyed.grpc_address) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        msg = generate_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=3)
        alice = [("authorization", f"Bearer {ALICE}")]
        assert stub.GenerateUnary(msg, metadata=alice, timeout=60).cached_prompt_tokens == 64
        assert list(stub.Generate(msg, metadata=alice, timeout=60))[-1].cached_prompt_tokens == 64, "streamed too"
    assert metric(keyed.url, 'tandem:prefix_cache_attach_misses_total{service="draft"}') == 0


def test_a_prefix_cache_per_key_needs_keys():
    with pytest.raises(ValueError, match="needs keys"):
        RouterSecurity(salt_per_key=True)
    args = build_parser().parse_args(["--target", "t:1", "--tokenizer", "tok", "--cache-salt-per-key",
                                      "--api-key", ALICE])
    security = security_from_args(args)
    assert security.salt_per_key and "a prefix cache per key" in security.describe()
