"""A reasoning model's thinking as chat's reasoning_content (router.gateway.reasoning), apart from its answer:

- deepseek_r1: the output starts inside a think block, up to </think>; cut short, all of it is reasoning
- qwen3: a block only where the output opens one with <think>; otherwise all of it is the answer
- streamed in any pieces, the reasoning and the answer add up to the whole answer's; no chunk shows a
  piece of a marker; every token's id arrives once; with tools, the calls are read from the answer only
- through the stack: a greedy chat's reasoning is the text the same prompt completes to; a constrained
  request has no think block, so nothing is taken from it
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from common.sampling import SamplingParams
from router.codec import TextCodec
from router.config import RouterConfig
from router.core import Delta, FinishReason, Request, RequestError
from router.gateway.openai_format import ChatFormat
from router.gateway.reasoning import Reasoning
from router.gateway.tools import tool_calling
from tests.conftest import hf_greedy
from tests.stack import running_stack

R1, QWEN3 = Reasoning.named("deepseek_r1"), Reasoning.named("qwen3")


@pytest.mark.parametrize("parser,text,finished,want", [
    (R1, "plan it</think>\n\nParis.", True, ("plan it", "\n\nParis.")),
    (R1, "<think>plan it</think>Paris.", True, ("plan it", "Paris.")),  # a model that writes the tag itself
    (R1, "plan it", True, ("plan it", None)),  # cut short while thinking
    (R1, "plan it</th", False, ("plan it", None)),  # "</th" may be the marker: held back
    (R1, "a < b", False, ("a < b", None)),
    (QWEN3, "<think>\nhmm\n</think>\n\nHi", True, ("\nhmm\n", "\n\nHi")),
    (QWEN3, "Hi there", True, ("", "Hi there")),  # no block opened: all answer
    (QWEN3, "<th", False, ("", None)),  # may be opening a block
    (QWEN3, "<th", True, ("", "<th")),
    (QWEN3, "<think>hmm", True, ("hmm", None)),
    (QWEN3, "<b>bold</b>", False, ("", "<b>bold</b>")),
])
def test_split(parser, text, finished, want):
    assert parser.split(text, finished) == want


def request() -> Request:
    return Request(request_id="r", prompt_ids=[1], sampling=SamplingParams(), max_tokens=99)


def stream(fmt: ChatFormat, pieces: list[str], finish: FinishReason = FinishReason.STOP) -> list[dict]:
    deltas = [Delta([i], p, completion_tokens=i + 1) for i, p in enumerate(pieces)]
    deltas[-1].finish_reason = finish
    return [c["choices"][0] for d in deltas if (c := fmt.chunk(d)) is not None]


def pieces_of(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


CASES = [
    (R1, None, "Step 1: the user wants a city. </think>\n\nParis is the capital."),
    (R1, None, "no end to this thinking"),
    (QWEN3, None, "<think>\nthey ask for the time</think>\n\nIt is <b>noon</b>."),
    (QWEN3, None, "Plain answer with a <tag> and a < sign"),
    (QWEN3, "hermes", '<think>need a tool</think>On it.<tool_call>{"name": "now", "arguments": {"tz": "UTC"}}'
                      '</tool_call>'),
]


@pytest.mark.parametrize("parser,tools,text", CASES)
def test_streamed_in_any_pieces_adds_up_to_the_whole_answer(parser, tools, text):
    calling = tool_calling([{"type": "function", "function": {"name": "now"}}], "auto", None, tools) if tools else None
    whole = ChatFormat(lambda ids: "", "m", request(), True, tools=calling, reasoning=parser)
    [choice] = whole.whole([Delta([0], text, finish_reason=FinishReason.STOP, completion_tokens=1)])["choices"]
    want = choice["message"]
    rng = random.Random(0)
    for _ in range(40):
        pieces = pieces_of(text, rng)
        fmt = ChatFormat(lambda ids: "", "m", request(), True, tools=calling, reasoning=parser)
        chunks = stream(fmt, pieces)
        deltas = [c["delta"] for c in chunks]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == (want["reasoning_content"] or "")
        assert "".join(d.get("content") or "" for d in deltas) == (want["content"] or "")
        assert [tc["function"] for d in deltas for tc in d.get("tool_calls", [])] == \
            [tc["function"] for tc in want.get("tool_calls", [])]
        for d in deltas:  # never a piece of a marker
            assert not any(m in (d.get("content") or "") for m in ("<think>", "</think>", "</th", "<tool_call"))
        assert [t for c in chunks for t in c["token_ids"]] == list(range(len(pieces)))
        assert chunks[-1]["finish_reason"] == choice["finish_reason"]
    if tools:
        assert want["content"] == "On it." and want["reasoning_content"] == "need a tool"
        assert choice["finish_reason"] == "tool_calls"


# -- through the stack --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(model_pair):
    config = RouterConfig(max_num_batched_tokens=128, max_num_seqs=16, draft_timeout_s=5.0, target_grace_s=2.0,
                          reasoning_parser="deepseek_r1")
    with running_stack(model_pair, config) as s:
        yield s


def post(url: str, path: str, **body) -> httpx.Response:  # noqa: ANN003
    return httpx.post(f"{url}{path}", json={"model": "tiny", "temperature": 0, "max_tokens": 24, **body}, timeout=60)


def test_a_thinking_answer_is_reasoning_and_a_constrained_one_is_content(stack):
    url = stack["router"].url
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    prompt = httpx.post(f"{url}/tokenize", json={"model": "tiny", "messages": messages}).json()["tokens"]
    completed = post(url, "/v1/completions", prompt=prompt).json()["choices"][0]["text"]
    r = post(url, "/v1/chat/completions", messages=messages)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    # the tiny model never writes </think>: as for a DeepSeek-R1 cut short, all of it is reasoning
    assert message["reasoning_content"] == completed and message["content"] is None
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 24, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("reasoning_content") or "" for e in events) == completed
    constrained = post(url, "/v1/chat/completions", messages=messages, response_format={"type": "json_object"})
    message = constrained.json()["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"].startswith("{")


# -- a constraint that holds once the thinking ends -------------------------------------------------

def test_the_grammar_waits_for_the_thinking_to_end(model_pair):
    """While the model thinks nothing is masked; a draft ending the thinking is verified last, the
    position after it takes the grammar's first mask; then the grammar holds as ever."""
    from router.structured import Constraint, Grammars

    target_dir = Path(model_pair[0])
    grammars = Grammars(target_dir, 400, [1])
    grammar = grammars.compile(Constraint("json_object", None, "response_format"))
    think_end = 7
    seq = grammars.state(grammar, opens_after=think_end)
    assert seq.masks([20, 21, 22]) == ([20, 21, 22], [])  # thinking: free
    kept, masks = seq.masks([20, think_end, 22, 23])
    assert kept == [20, think_end] and len(masks) == 3
    fresh = grammars.state(grammar)
    assert masks[-1] == fresh.masks([])[1][0]  # the grammar's first mask, after the think-end token
    assert seq.advance([20, 21]) == ([20, 21], False) and seq.opens_after == think_end
    brace = fresh.matcher  # a token the JSON grammar takes first, and one it refuses there
    first = brace.mask()
    ok = next(t for t in range(2, 300) if brace.allowed(first, t))
    refused = next(t for t in range(2, 300) if not brace.allowed(first, t) and t != think_end)
    assert seq.advance([think_end, ok]) == ([think_end, ok], False) and seq.opens_after is None
    assert seq.masks([refused])[0] == []  # now it holds
    stopped = grammars.state(grammar, opens_after=think_end)
    assert stopped.advance([20, 1, 21]) == ([20, 1], True)  # EOS while thinking ends the sequence


@pytest.fixture(scope="module")
def thinking_pair(model_pair, tmp_path_factory):
    """model_pair whose tokenizer reads one of its ids as "</think>" (not special), as Qwen3's and
    DeepSeek-R1's tokenizers have it."""
    import shutil

    root = tmp_path_factory.mktemp("thinking")
    dirs = [shutil.copytree(d, root / d.name) for d in map(Path, model_pair)]
    for d in dirs:  # the last merge's token gives its id to "</think>" (no later merge uses it)
        tok = json.loads((d / "tokenizer.json").read_text())
        vocab, merges = tok["model"]["vocab"], tok["model"]["merges"]
        last, think_id = max(vocab.items(), key=lambda kv: kv[1])
        del vocab[last]
        tok["model"]["merges"] = [m for m in merges if "".join(m if isinstance(m, list) else m.split(" ")) != last]
        tok["added_tokens"].append({"id": think_id, "content": "</think>", "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": False})
        (d / "tokenizer.json").write_text(json.dumps(tok))
    return (*dirs, think_id)


def test_a_reasoning_model_thinks_then_answers_as_the_schema_says(thinking_pair):
    target_dir, draft_dir, think_id = thinking_pair
    config = RouterConfig(max_num_batched_tokens=128, max_num_seqs=16, draft_timeout_s=5.0, target_grace_s=2.0,
                          reasoning_parser="deepseek_r1")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    with running_stack((target_dir, draft_dir), config) as s:
        url = s["router"].url
        body = {"messages": [{"role": "user", "content": "Think, then answer"}], "max_tokens": 60,
                "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
                "return_token_ids": True}
        # a bias makes the tiny model write some thoughts, then end them: the schema holds after that
        for bias in (4.0, 100.0):
            r = post(url, "/v1/chat/completions", logit_bias={str(think_id): bias}, **body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert think_id in choice["token_ids"], "the grammar let the thinking end"
            assert json.loads(choice["message"]["content"]) in ({"ok": True}, {"ok": False})
            thought = choice["token_ids"][:choice["token_ids"].index(think_id)]
            assert (choice["message"]["reasoning_content"] or "") == tok.decode(thought)
        told = post(url, "/v1/chat/completions", logit_bias={str(think_id): 100.0},
                    chat_template_kwargs={"enable_thinking": False}, **body).json()["choices"][0]
        assert think_id not in told["token_ids"], "told not to think: the schema holds from the first token"
        assert "reasoning_content" not in told["message"] and json.loads(told["message"]["content"])


def test_a_thinking_budget_ends_the_thinking_then_the_model_answers(thinking_pair):
    """vLLM's thinking_token_budget (and the Messages API's thinking.budget_tokens), speculation on: the
    first `budget` tokens are the model's own, then </think>, then transformers' greedy continuation of
    all that."""
    target_dir, draft_dir, think_id = thinking_pair
    config = RouterConfig(max_num_batched_tokens=128, max_num_seqs=16, draft_timeout_s=5.0, target_grace_s=2.0,
                          reasoning_parser="deepseek_r1", dynamic_k=False)
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    messages = [{"role": "user", "content": "Think briefly, then answer"}]
    with running_stack((target_dir, draft_dir), config) as s:
        url = s["router"].url
        prompt = httpx.post(f"{url}/tokenize", json={"model": "tiny", "messages": messages}).json()["tokens"]
        free = hf_greedy(target_dir, prompt, 30)
        assert think_id not in free, "the tiny model never ends its thinking by itself"
        for budget in (0, 5, 12):
            r = post(url, "/v1/chat/completions", messages=messages, max_tokens=30, ignore_eos=True,
                     thinking_token_budget=budget, return_token_ids=True)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            ids = choice["token_ids"]
            assert ids[:budget] == free[:budget] and ids[budget] == think_id
            assert ids[budget + 1:] == hf_greedy(target_dir, prompt + ids[:budget + 1], 30 - budget - 1)
            assert (choice["message"]["reasoning_content"] or "") == tok.decode(ids[:budget])
            assert choice["message"]["content"] == tok.decode(ids[budget + 1:])
            assert r.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] == budget + 1, "</think> too"
        reply = httpx.post(f"{url}/v1/responses", timeout=60, json={
            "model": "tiny", "input": messages[0]["content"], "max_output_tokens": 12, "temperature": 0}).json()
        assert reply["usage"]["output_tokens_details"]["reasoning_tokens"] == 12, "never ends its thinking: all of it"
        answer = httpx.post(f"{url}/v1/messages", timeout=60, json={
            "model": "tiny", "max_tokens": 12, "messages": messages, "temperature": 0,
            "thinking": {"type": "enabled", "budget_tokens": 4}}).json()
        assert [b["type"] for b in answer["content"]] == ["thinking", "text"]
        assert answer["content"][0]["thinking"] == tok.decode(free[:4])
        refused = post(url, "/v1/chat/completions", messages=messages, thinking_token_budget=-1)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "thinking_token_budget"
        raw = post(url, "/v1/completions", prompt="Think", thinking_token_budget=4)
        assert raw.status_code == 400 and "chat only" in raw.json()["error"]["message"]


def test_a_thinking_budget_needs_a_reasoning_parser(thinking_pair):
    codec = TextCodec(thinking_pair[0])
    try:
        assert codec.think_tokens("deepseek_r1") == (thinking_pair[2], None)
        for parser in (None, "qwen3"):  # qwen3 needs <think> as one token too, which this tokenizer lacks
            with pytest.raises(RequestError, match="--reasoning-parser"):
                codec.think_tokens(parser)
    finally:
        codec.close()
