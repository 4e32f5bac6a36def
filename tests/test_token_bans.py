"""vLLM's allowed_token_ids and bad_words through the whole stack (target, draft and router on
loopback, speculation on), against transformers as the reference:

- greedy output with bad_words (text, tokenized at the start of a word and after a space) is
  transformers' greedy output with NoBadWordsLogitsProcessor over the same token sequences
- a word of several tokens, sent as ids on gRPC, is banned where the output ends with its head
- greedy output with allowed_token_ids is transformers' with every other id masked; sampled output
  draws only allowed ids
- requests that would leave nothing to generate, or name ids outside the vocabulary, are a 400
"""

from __future__ import annotations

import grpc
import httpx
import pytest
import torch
from transformers import AutoTokenizer, NoBadWordsLogitsProcessor

from router.config import RouterConfig
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.stack import running_stack
from tests.test_structured import _Processor, hf_generate, metric

PROMPT_TEXT = "def tokenize(text):\n    "
MAX_NEW = 40


@pytest.fixture(scope="module")
def stack(model_pair):
    config = RouterConfig(max_num_batched_tokens=128, max_num_seqs=16, draft_timeout_s=5.0, target_grace_s=2.0)
    with running_stack(model_pair, config) as s:
        tok = AutoTokenizer.from_pretrained(model_pair[0])
        s["tok"], s["prompt"] = tok, tok(PROMPT_TEXT, add_special_tokens=False)["input_ids"]
        s["free"] = complete(s, temperature=0)["token_ids"]
        assert len(s["free"]) == MAX_NEW
        yield s


def complete(stack, **body) -> dict:  # noqa: ANN001, ANN003
    r = httpx.post(f"{stack['router'].url}/v1/completions", timeout=120,
                   json={"model": "tiny", "prompt": stack["prompt"], "max_tokens": MAX_NEW, "ignore_eos": True,
                         "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_bad_words_as_text_equal_transformers_no_bad_words(stack):
    tok, free, target_dir = stack["tok"], stack["free"], stack["dirs"][0]
    word = next(w for w in (tok.decode([t]).strip() for t in free[5:]) if w.isalpha() and len(w) > 1)
    sequences = [tok(text, add_special_tokens=False)["input_ids"] for text in (word, " " + word)]
    assert all(stack["prompt"][-len(s) + 1:] != s[:-1] for s in sequences if len(s) > 1), "prompt ends in a word's head"
    accepted = metric(stack["router"].url, "tandem:spec_decode_num_accepted_tokens_total")
    got = complete(stack, temperature=0, bad_words=[word])["token_ids"]
    want = hf_generate(target_dir, stack["prompt"], MAX_NEW, [NoBadWordsLogitsProcessor(sequences)])
    assert got == want[:MAX_NEW]
    assert got != free, "the banned word was in the free answer: the ban must change it"
    assert metric(stack["router"].url, "tandem:spec_decode_num_accepted_tokens_total") > accepted


def test_a_word_of_two_tokens_sent_as_ids_is_banned_after_its_head(stack):
    free, target_dir = stack["free"], stack["dirs"][0]
    word = (free[3], free[4])  # the free answer writes it at positions 3-4: the ban changes position 4
    with grpc.insecure_channel(stack["router"].grpc_address) as channel:
        out = generate_pb2_grpc.GenerateStub(channel).GenerateUnary(generate_pb2.GenerateRequest(
            prompt_token_ids=stack["prompt"], max_tokens=MAX_NEW, ignore_eos=True,
            sampling=common_pb2.SamplingParams(temperature=0.0, bad_words=[common_pb2.TokenIds(ids=word)])))
    want = hf_generate(target_dir, stack["prompt"], MAX_NEW, [NoBadWordsLogitsProcessor([list(word)])])
    assert list(out.token_ids) == want[:MAX_NEW]
    assert list(out.token_ids[:4]) == free[:4] and out.token_ids[4] != free[4]
    assert all(tuple(out.token_ids[i:i + 2]) != word for i in range(MAX_NEW - 1))


def test_allowed_token_ids_greedy_equals_transformers_and_samples_stay_inside(stack):
    free, target_dir = stack["free"], stack["dirs"][0]
    allowed = sorted(set(free[::3]) | set(range(2, 30)))

    def only_allowed(ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        keep = torch.zeros(scores.shape[-1], dtype=torch.bool)
        keep[allowed] = True
        return scores.masked_fill(~keep, float("-inf"))

    got = complete(stack, temperature=0, allowed_token_ids=allowed)["token_ids"]
    assert got == hf_generate(target_dir, stack["prompt"], MAX_NEW, [_Processor(only_allowed)])[:MAX_NEW]
    assert got != free
    for seed in (1, 2):
        sampled = complete(stack, temperature=1.0, seed=seed, allowed_token_ids=allowed)["token_ids"]
        assert len(sampled) == MAX_NEW and set(sampled) <= set(allowed)


@pytest.mark.parametrize("body,param", [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [10 ** 6]}, "allowed_token_ids"),
    ({"allowed_token_ids": [5], "guided_choice": ["a", "b"]}, "allowed_token_ids"),
    ({"allowed_token_ids": [1], "min_tokens": 2, "ignore_eos": False}, "allowed_token_ids"),  # 1 is EOS
    ({"bad_words": [" "]}, "bad_words"),
    ({"bad_words": ["x"] * 200}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
], ids=["empty", "outside-vocab", "with-grammar", "min-tokens-holds-all-back", "blank-word", "too-many",
        "not-a-list"])
def test_requests_that_leave_nothing_or_name_unknown_ids_are_refused(stack, body, param):
    r = httpx.post(f"{stack['router'].url}/v1/completions", timeout=30,
                   json={"model": "tiny", "prompt": "x", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param or param in r.json()["error"]["message"], r.json()
