"""vLLM's prompt_logprobs over HTTP, against transformers' log_softmax over the prompt:

- completions: each choice's prompt_logprobs is None for the first prompt token, then per token its
  id's logprob and rank (1 + the tokens more likely) and its top alternatives ranked 1..k; chat: the
  same list once, beside the choices, for the rendered conversation
- with echo and logprobs the OpenAI-shaped echo keeps its own logprobs; streaming is refused (vLLM's rule)
"""

from __future__ import annotations

import httpx
import pytest

from router.config import RouterConfig
from tests.conftest import hf_logits
from tests.stack import running_stack

PROMPT = [(13 * i) % 250 + 3 for i in range(40)]


@pytest.fixture(scope="module")
def stack(model_pair):
    with running_stack(model_pair, RouterConfig(max_num_batched_tokens=32, max_num_seqs=8)) as s:
        yield s


def _post(stack, path: str, **body) -> httpx.Response:  # noqa: ANN001, ANN003
    return httpx.post(f"{stack['router'].url}{path}", timeout=60, json={"model": "tiny", **body})


def _check(listed: list, prompt: list[int], ref, k: int) -> None:  # noqa: ANN001
    assert listed[0] is None and len(listed) == len(prompt)
    for pos, entry in enumerate(listed[1:]):
        token, row = prompt[pos + 1], ref[pos]
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        assert mine["rank"] == int((row > row[token]).sum()) + 1
        top = row.topk(k)
        for rank, (alt, logprob) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True), 1):
            if alt != token:
                assert entry[str(alt)]["rank"] == rank
                assert entry[str(alt)]["logprob"] == pytest.approx(logprob, abs=1e-4)
        assert set(entry) == {str(token), *map(str, top.indices.tolist())}


def test_completions_prompt_logprobs_are_transformers_with_ranks(stack):
    ref = hf_logits(stack["dirs"][0], PROMPT).log_softmax(-1)  # chunked: 40 prompt tokens in steps of 32
    r = _post(stack, "/v1/completions", prompt=PROMPT, max_tokens=3, temperature=0, prompt_logprobs=3, n=2)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        _check(choice["prompt_logprobs"], PROMPT, ref, 3)
        assert choice["logprobs"] is None
    echoed = _post(stack, "/v1/completions", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                   prompt_logprobs=2).json()["choices"][0]
    _check(echoed["prompt_logprobs"], PROMPT, ref, 2)
    assert echoed["logprobs"]["token_logprobs"][1] == pytest.approx(ref[0, PROMPT[1]].item(), abs=1e-4)
    assert len(echoed["logprobs"]["top_logprobs"][1]) == 1, "the echo's alternatives: its own logprobs = 1"


def test_chat_prompt_logprobs_cover_the_rendered_conversation(stack):
    messages = [{"role": "user", "content": "hello there"}]
    ids = _post(stack, "/tokenize", messages=messages).json()["tokens"]
    ref = hf_logits(stack["dirs"][0], ids).log_softmax(-1)
    r = _post(stack, "/v1/chat/completions", messages=messages, max_tokens=2, temperature=0, prompt_logprobs=1)
    assert r.status_code == 200, r.text
    _check(r.json()["prompt_logprobs"], ids, ref, 1)


def test_prompt_logprobs_are_refused_when_streaming_or_out_of_range(stack):
    r = _post(stack, "/v1/completions", prompt=PROMPT, max_tokens=2, prompt_logprobs=1, stream=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    r = _post(stack, "/v1/completions", prompt=PROMPT, max_tokens=2, prompt_logprobs=21)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
