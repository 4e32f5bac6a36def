"""Structured output, logits processors and n choices through the whole stack (target, draft and router
on loopback, speculation on), against transformers as the reference:

- greedy output under a grammar is transformers' greedy output with the same grammar mask applied
- 20 json_schema requests (greedy and sampled, chat and completions) all parse and validate, and the
  draft's masked proposals are accepted (acceptance > 0)
- greedy output with penalties, logit_bias and min_tokens is transformers' with its logits processors
- n = 4 returns four choices and the target computes the prompt once
- unknown or unsupported fields are a 400 naming them
"""

from __future__ import annotations

import concurrent.futures as cf
import json

import grpc
import httpx
import jsonschema
import pytest
import torch
from transformers import AutoTokenizer, LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from common.grammar import Matcher, compile_grammar, load_tokenizer
from router.config import RouterConfig
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.conftest import _hf_model
from tests.stack import counts, running_stack

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "ok": {"type": "boolean"},
    "kind": {"enum": ["cat", "dog", "fish"]},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "ok", "kind", "tags"], "additionalProperties": False}
EOS = 1  # model_pair's


@pytest.fixture(scope="module")
def stack(model_pair):
    config = RouterConfig(max_num_batched_tokens=128, max_num_seqs=16, draft_timeout_s=5.0, target_grace_s=2.0)
    with running_stack(model_pair, config) as s:
        s["tok"] = AutoTokenizer.from_pretrained(model_pair[0])
        yield s


def post(url: str, path: str, **body) -> httpx.Response:  # noqa: ANN003
    return httpx.post(f"{url}{path}", json={"model": "tiny", "return_token_ids": True, **body}, timeout=120)


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class _Processor(LogitsProcessor):
    """A transformers logits processor from a function of (input_ids, scores)."""

    def __init__(self, fn) -> None:  # noqa: ANN001
        self.fn = fn

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return self.fn(input_ids, scores)


def hf_generate(model_dir, prompt: list[int], max_new: int, processors: list) -> list[int]:  # noqa: ANN001
    model = _hf_model(str(model_dir))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0,
                             eos_token_id=EOS, logits_processor=LogitsProcessorList(processors))
    return out[0, len(prompt):].tolist()


def grammar_processor(model_dir, grammar: str, prompt_len: int) -> _Processor:  # noqa: ANN001
    """transformers' side of the reference: the same llguidance grammar, masking the same logits."""
    vocab = _hf_model(str(model_dir)).config.vocab_size
    matcher = Matcher(load_tokenizer(str(model_dir / "tokenizer.json"), vocab, (EOS,)), grammar)

    def fn(ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        assert matcher.sync(ids[0, prompt_len:].tolist())
        bits = [Matcher.allowed(matcher.mask(), t) for t in range(scores.shape[-1])]
        return scores.masked_fill(~torch.tensor(bits)[None], float("-inf"))

    return _Processor(fn)


def test_greedy_json_schema_equals_transformers_with_the_same_mask(stack):
    router, tok, target_dir = stack["router"], stack["tok"], stack["dirs"][0]
    prompt = tok("def parse(text):\n    return", add_special_tokens=False)["input_ids"]
    r = post(router.url, "/v1/completions", prompt=prompt, max_tokens=120, temperature=0,
             response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    vocab = _hf_model(str(target_dir)).config.vocab_size
    grammar = compile_grammar("json_schema", SCHEMA, load_tokenizer(str(target_dir / "tokenizer.json"), vocab, (EOS,)))
    want = hf_generate(target_dir, prompt, 120, [grammar_processor(target_dir, grammar, len(prompt))])
    assert choice["token_ids"] == [t for t in want if t != EOS][:len(choice["token_ids"])]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["text"]), SCHEMA)


def test_twenty_json_schema_requests_parse_validate_and_speculate(stack):
    router = stack["router"]
    accepted = metric(router.url, "tandem:spec_decode_num_accepted_tokens_total")
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}

    def one(i: int) -> httpx.Response:
        sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": i}
        if i % 4 < 2:
            return post(router.url, "/v1/chat/completions", messages=[{"role": "user", "content": f"pet {i}"}],
                        max_tokens=120, response_format=fmt, **sampling)
        return post(router.url, "/v1/completions", prompt=f"# pet number {i}\n", max_tokens=120, response_format=fmt,
                    **sampling)

    with cf.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(one, range(20)))
    for r in responses:
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        jsonschema.validate(json.loads(text), SCHEMA)
        assert choice["finish_reason"] == "stop"
    assert metric(router.url, "tandem:spec_decode_num_accepted_tokens_total") > accepted
    assert metric(router.url, "tandem:grammar_mask_bytes_total") > 0


@pytest.mark.parametrize("body,check", [
    ({"response_format": {"type": "json_object"}}, lambda s: isinstance(json.loads(s), dict)),
    ({"structured_outputs": {"regex": "[0-9]{3}-[0-9]{2}"}}, lambda s: len(s) == 6 and s[3] == "-"),
    ({"structured_outputs": {"choice": ["yes", "no", "maybe so"]}}, lambda s: s in {"yes", "no", "maybe so"}),
    ({"guided_choice": ["left", "right"]}, lambda s: s in {"left", "right"}),
    ({"guided_json": json.dumps({"type": "array", "items": {"type": "boolean"}, "maxItems": 2})},
     lambda s: isinstance(json.loads(s), list)),
], ids=["json_object", "regex", "choice", "guided_choice", "guided_json"])
def test_other_constraints(stack, body, check):
    r = post(stack["router"].url, "/v1/completions", prompt="x = ", max_tokens=60, temperature=0.7, seed=3, **body)
    assert r.status_code == 200, r.text
    assert check(r.json()["choices"][0]["text"]), r.json()


def test_grpc_structured_output(stack):
    with grpc.insecure_channel(stack["router"].grpc_address) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        out = stub.GenerateUnary(generate_pb2.GenerateRequest(
            prompt="answer: ", max_tokens=20, sampling=common_pb2.SamplingParams(temperature=0.0),
            structured_output=generate_pb2.StructuredOutput(choice=generate_pb2.Choices(choices=["alpha", "beta"]))))
    assert out.text in {"alpha", "beta"} and out.finish_reason == "stop"


def test_greedy_penalties_and_bias_equal_transformers_processors(stack):
    """repetition (HF's processor), presence/frequency (OpenAI's formula over output tokens), logit_bias and
    min_tokens, with speculation on: the same tokens as transformers' generate with those processors."""
    router, tok, target_dir = stack["router"], stack["tok"], stack["dirs"][0]
    prompt = tok("for i in range(10):\n    ", add_special_tokens=False)["input_ids"]
    n = len(prompt)
    bias = {5: 3.0, 17: -100.0, 40: 1.5}

    def presence_frequency(ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.bincount(ids[0, n:], minlength=scores.shape[-1]).float()
        return scores - 0.4 * counts - 0.6 * (counts > 0).float()

    def logit_bias(ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for t, b in bias.items():
            scores[:, t] += b
        return scores

    def min_tokens(ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if ids.shape[1] - n < 20:
            scores[:, [EOS, 9]] = float("-inf")
        return scores

    # vLLM's order: logit_bias and min_tokens, then repetition, frequency and presence
    want = hf_generate(target_dir, prompt, 40, [_Processor(logit_bias), _Processor(min_tokens),
                                                RepetitionPenaltyLogitsProcessor(1.3), _Processor(presence_frequency)])
    r = post(router.url, "/v1/completions", prompt=prompt, max_tokens=40, temperature=0, repetition_penalty=1.3,
             presence_penalty=0.6, frequency_penalty=0.4, logit_bias={str(t): b for t, b in bias.items()},
             min_tokens=20, stop_token_ids=[9])
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["token_ids"]
    cut = next((i for i, t in enumerate(want) if t in (EOS, 9)), len(want))
    assert got == want[:cut]
    assert len(set(want[:cut])) > 10, "the penalties must matter for this test to mean anything"


def test_min_p_one_samples_only_the_most_likely_token_so_equals_greedy(stack):
    """min_p is applied on both services (the draft's q, the target's p): at min_p 1 a sampled request
    keeps only each position's most likely token, so, speculation on, it is the greedy answer."""
    router = stack["router"]
    prompt = "def tokenize(text):\n    "
    greedy = post(router.url, "/v1/completions", prompt=prompt, max_tokens=30, temperature=0, ignore_eos=True)
    accepted = metric(router.url, "tandem:spec_decode_num_accepted_tokens_total")
    for seed in (1, 2):
        r = post(router.url, "/v1/completions", prompt=prompt, max_tokens=30, temperature=1.0, min_p=1.0, seed=seed,
                 ignore_eos=True)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == greedy.json()["choices"][0]["token_ids"]
    assert metric(router.url, "tandem:spec_decode_num_accepted_tokens_total") > accepted
    free = post(router.url, "/v1/completions", prompt=prompt, max_tokens=30, temperature=1.0, seed=1, ignore_eos=True)
    assert free.json()["choices"][0]["token_ids"] != greedy.json()["choices"][0]["token_ids"]
    assert post(router.url, "/v1/completions", prompt=prompt, min_p=1.5).json()["error"]["param"] == "min_p"


def test_special_tokens_stay_in_the_text_when_asked(stack):
    """vLLM's skip_special_tokens: false keeps a special token the model writes (here the tokenizer's
    <s>, pushed by a bias) in the text, as tool-call markers that are special tokens need."""
    router = stack["router"]
    body = {"prompt": "x = ", "max_tokens": 3, "temperature": 0, "logit_bias": {"0": 100}}
    kept = post(router.url, "/v1/completions", skip_special_tokens=False, **body).json()["choices"][0]
    skipped = post(router.url, "/v1/completions", **body).json()["choices"][0]
    assert kept["token_ids"] == skipped["token_ids"] == [0, 0, 0]
    assert kept["text"] == "<s><s><s>" and skipped["text"] == ""


def test_n_choices_share_one_prompt_computation(stack):
    router, tok = stack["router"], stack["tok"]
    prompt = tok("import os\nimport sys\n\n\ndef main(argv):\n    ", add_special_tokens=False)["input_ids"]
    computed, forked = (metric(router.url, "tandem:target_prompt_tokens_computed_total"),
                        metric(router.url, "tandem:forked_sequences_total"))
    r = post(router.url, "/v1/completions", prompt=prompt, max_tokens=12, n=4, temperature=1.0, seed=7,
             ignore_eos=True)
    assert r.status_code == 200, r.text
    out = r.json()
    assert sorted(c["index"] for c in out["choices"]) == [0, 1, 2, 3]
    assert all(len(c["token_ids"]) == 12 for c in out["choices"])
    assert len({tuple(c["token_ids"]) for c in out["choices"]}) > 1  # derived seeds: the choices differ
    assert counts(out["usage"]) == {"prompt_tokens": len(prompt),
                                    "completion_tokens": 48, "total_tokens": len(prompt) + 48}
    assert metric(router.url, "tandem:target_prompt_tokens_computed_total") - computed == len(prompt)
    assert metric(router.url, "tandem:forked_sequences_total") - forked == 3
    again = post(router.url, "/v1/completions", prompt=prompt, max_tokens=12, n=4, temperature=1.0, seed=7,
                 ignore_eos=True).json()
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in out["choices"]]  # seeded


def test_n_choices_stream_with_indexes(stack):
    with httpx.stream("POST", f"{stack['router'].url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "n": 3,
            "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    finished = [e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1, 2]
    texts = {i: "".join(e["choices"][0]["delta"]["content"] for e in events if e["choices"][0]["index"] == i)
             for i in range(3)}
    assert texts[0] == texts[1] == texts[2]  # greedy: n identical answers


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # "auto": no parser
    ({"frobnicate": 1, "audio": {}}, "audio"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ({"logit_bias": {"999999": 1.0}}, "logit_bias"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0.tool_calls"),
])
def test_unsupported_or_invalid_fields_are_named(stack, body, param):
    r = post(stack["router"].url, "/v1/chat/completions",
             **{"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_harmless_openai_fields_are_accepted(stack):
    r = post(stack["router"].url, "/v1/chat/completions", messages=[{"role": "user", "content": "x", "name": "ann"}],
             max_tokens=3, user="u-1", metadata={"a": "b"}, store=False)
    assert r.status_code == 200, r.text
