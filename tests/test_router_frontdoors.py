"""The router's public doors, driven by real clients over loopback against real target and draft
services: HTTP (OpenAI-compatible completions and chat, SSE, models, health, readiness, metrics),
the bad-input battery (each a 4xx with an OpenAI-shaped error naming the field), 429 under
overload, and the public gRPC API (tandem.v1.Generate, health, reflection).
Reference for every greedy output and logprob: transformers on the target checkpoint."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import shutil
import threading

import grpc
import httpx
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from transformers import AutoTokenizer

from router.config import RouterConfig
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.conftest import hf_greedy, hf_logits
from tests.stack import counts, running_stack, start_router, wait_until

GREEDY_PB = common_pb2.SamplingParams(temperature=0.0)

MAX_MODEL_LEN = 512  # model_pair's max_position_embeddings
TEXT_PROMPT = "def fill(text, width=70, **kwargs):\n    "
IDS_PROMPT = [(11 * j) % 300 + 2 for j in range(23)]


@pytest.fixture(scope="module")
def stack(model_pair):
    config = RouterConfig(max_num_batched_tokens=64, max_num_seqs=8, draft_timeout_s=2.0, target_grace_s=2.0)
    with running_stack(model_pair, config) as s:
        s["tok"] = AutoTokenizer.from_pretrained(model_pair[0])
        yield s


def encode(tok, text: str) -> list[int]:  # noqa: ANN001
    return tok(text, add_special_tokens=False)["input_ids"]


def dec(tok, ids: list[int]) -> str:  # noqa: ANN001
    """Text as the router shows it: special tokens (<s>, </s>) are skipped."""
    return tok.decode(ids, skip_special_tokens=True)


def post(url: str, path: str, **body) -> httpx.Response:  # noqa: ANN003
    body = {"model": "tiny", "temperature": 0, "ignore_eos": True, "return_token_ids": True, **body}
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def sse(url: str, path: str, **body) -> list[dict]:  # noqa: ANN003
    """The JSON events of one streamed request; asserts the SSE framing and the final [DONE]."""
    body = {"model": "tiny", "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": True, **body}
    lines = []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                lines.append(line)
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    assert all(line.startswith("data: {") for line in lines[:-1]), lines
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def ref_logprobs(model_dir, prompt: list[int], out: list[int],  # noqa: ANN001
                 n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen logprobs, top-n ids, top-n logprobs) of transformers' raw distribution at each output position."""
    logits = hf_logits(model_dir, prompt + out[:-1])[len(prompt) - 1:]
    lp = torch.log_softmax(logits.double(), -1)
    top_lp, top_ids = lp.topk(n, -1)
    return lp.gather(1, torch.tensor(out)[:, None])[:, 0], top_ids, top_lp


def metrics_text(url: str) -> str:
    r = httpx.get(f"{url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text


def sample(text: str, name: str, labels: str = "") -> float | None:
    """Value of one exposition sample (name{labels} value), None when absent."""
    pat = re.compile(rf'^{re.escape(name)}(\{{(?:[^}}"]|"[^"]*")*\}})? (\S+)$', re.M)  # label values may hold }
    for m in pat.finditer(text):
        if labels in (m.group(1) or ""):
            return float(m.group(2))
    return None


def assert_error(r: httpx.Response, status: int, field: str | None = None, param: str | None = None,
                 kind: str = "invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    assert err["type"] == kind, err
    assert isinstance(err["message"], str) and err["message"], err
    if field is not None:
        assert field in err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


# ---- HTTP: completions ---------------------------------------------------------------------------
def test_completion_text_prompt_greedy_matches_transformers(stack):
    router, tok, target_dir = stack["router"], stack["tok"], stack["dirs"][0]
    ids = encode(tok, TEXT_PROMPT)
    r = post(router.url, "/v1/completions", prompt=TEXT_PROMPT, max_tokens=30)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["model"] == "tiny" and out["id"].startswith("cmpl-")
    choice = out["choices"][0]
    want = hf_greedy(target_dir, ids, 30)
    assert choice["token_ids"] == want
    assert choice["text"] == dec(tok, want)
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert counts(out["usage"]) == {"prompt_tokens": len(ids), "completion_tokens": 30, "total_tokens": len(ids) + 30}


def test_completion_streaming_equals_greedy_and_reports_usage(stack):
    router, target_dir = stack["router"], stack["dirs"][0]
    events = sse(router.url, "/v1/completions", prompt=IDS_PROMPT, max_tokens=25,
                 stream_options={"include_usage": True})
    *chunks, usage = events
    assert len(chunks) >= 2, "a 25-token completion must stream in more than one chunk"
    assert all(e["object"] == "text_completion" for e in events)
    assert len({e["id"] for e in events}) == 1
    ids = [t for e in chunks for t in e["choices"][0]["token_ids"]]
    assert ids == hf_greedy(target_dir, IDS_PROMPT, 25)
    assert [e["choices"][0]["finish_reason"] for e in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert "".join(e["choices"][0]["text"] for e in chunks) == dec(stack["tok"], ids)
    assert usage["choices"] == []
    assert counts(usage["usage"]) == {"prompt_tokens": len(IDS_PROMPT), "completion_tokens": 25,
                              "total_tokens": len(IDS_PROMPT) + 25}
    # without include_usage there is no usage event
    plain = sse(router.url, "/v1/completions", prompt=IDS_PROMPT, max_tokens=5)
    assert all("usage" not in e for e in plain) and plain[-1]["choices"][0]["finish_reason"] == "length"


def test_continuous_usage_stats_give_every_chunk_the_usage_so_far(stack):
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage counts the tokens streamed up to it."""
    router = stack["router"]
    for path, extra in (("/v1/completions", {"prompt": IDS_PROMPT}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        events = sse(router.url, path, **extra, max_tokens=12, n=2, ignore_eos=True, return_token_ids=True,
                     stream_options={"include_usage": True, "continuous_usage_stats": True})
        *chunks, last = events
        assert last["choices"] == [] and len(chunks) >= 2, path
        streamed = {0: 0, 1: 0}
        for e in chunks:
            for c in e["choices"]:
                streamed[c["index"]] += len(c["token_ids"])
            usage = e["usage"]
            assert usage["completion_tokens"] == sum(streamed.values()), (path, e)
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert counts(last["usage"]) == counts(chunks[-1]["usage"]) and last["usage"]["completion_tokens"] == 24
    # without include_usage it asks for nothing (as vLLM)
    plain = sse(router.url, "/v1/completions", prompt=IDS_PROMPT, max_tokens=4,
                stream_options={"continuous_usage_stats": True})
    assert all("usage" not in e for e in plain)


def test_eos_finishes_with_stop_unless_ignored(stack):
    router, target_dir = stack["router"], stack["dirs"][0]
    want = hf_greedy(target_dir, IDS_PROMPT, 25)
    assert 1 in want, "this prompt's greedy continuation reaches EOS (id 1)"
    for stream in (False, True):
        body = {"prompt": IDS_PROMPT, "max_tokens": 25, "ignore_eos": False}
        if stream:
            chunks = sse(router.url, "/v1/completions", **body)
            ids = [t for e in chunks for t in e["choices"][0]["token_ids"]]
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            r = post(router.url, "/v1/completions", **body)
            assert r.status_code == 200, r.text
            ids, finish = r.json()["choices"][0]["token_ids"], r.json()["choices"][0]["finish_reason"]
            assert r.json()["usage"]["completion_tokens"] == len(ids)
        assert ids == want[:want.index(1)] and finish == "stop"


def _stop_case(tok, target_dir) -> tuple[list[int], list[int], str, str]:  # noqa: ANN001
    """A greedy continuation and a stop string that really occurs in its text (not at the start)."""
    want = hf_greedy(target_dir, IDS_PROMPT, 40)
    text = dec(tok, want)
    for i in range(4, len(text) - 3):
        stop = text[i:i + 2]
        if stop.isascii() and stop.strip() == stop and stop.isprintable() and text.find(stop) == i:
            return want, text, stop, text[:i]
    pytest.fail(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_stop_string_cuts_text_before_it(stack, stream):
    router, tok, target_dir = stack["router"], stack["tok"], stack["dirs"][0]
    want, _, stop, expected = _stop_case(tok, target_dir)
    body = {"prompt": IDS_PROMPT, "max_tokens": 40, "stop": [stop, "\x00never"]}
    if stream:
        chunks = [e for e in sse(router.url, "/v1/completions", **body) if e["choices"]]
        text = "".join(e["choices"][0]["text"] for e in chunks)
        ids = [t for e in chunks for t in e["choices"][0]["token_ids"]]
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        r = post(router.url, "/v1/completions", **body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text, ids, finish = choice["text"], choice["token_ids"], choice["finish_reason"]
        assert r.json()["usage"]["completion_tokens"] == len(ids)
    assert text == expected and stop not in text
    assert finish == "stop"
    # generation ran exactly up to the token that completed the stop string
    assert ids == want[:len(ids)] and len(ids) < 40
    assert stop in dec(tok, ids) and stop not in dec(tok, ids[:-1])
    # vLLM's include_stop_str_in_output: the same tokens, the stop string kept
    kept = post(router.url, "/v1/completions", **body, include_stop_str_in_output=True).json()["choices"][0]
    assert kept["text"] == expected + stop and kept["token_ids"] == ids and kept["stop_reason"] == stop


def test_completion_logprobs_match_transformers(stack):
    router, tok, target_dir = stack["router"], stack["tok"], stack["dirs"][0]
    r = post(router.url, "/v1/completions", prompt=IDS_PROMPT, max_tokens=12, logprobs=2)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids, lp = choice["token_ids"], choice["logprobs"]
    assert ids == hf_greedy(target_dir, IDS_PROMPT, 12)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 12
    assert lp["tokens"] == [dec(tok, [t]) for t in ids]
    chosen, top_ids, top_lp = ref_logprobs(target_dir, IDS_PROMPT, ids, 2)
    assert torch.allclose(torch.tensor(lp["token_logprobs"], dtype=torch.double), chosen, atol=1e-3)
    for i, top in enumerate(lp["top_logprobs"]):
        # keyed by token text: two alternatives that decode alike collapse into one key
        assert set(top) == {dec(tok, [t]) for t in top_ids[i].tolist()}
        assert max(top.values()) == pytest.approx(top_lp[i, 0].item(), abs=1e-3)
        assert top[lp["tokens"][i]] == pytest.approx(lp["token_logprobs"][i], abs=1e-3)  # greedy: chosen is top-1
    # streamed: every chunk carries the logprobs of its own tokens
    chunks = sse(router.url, "/v1/completions", prompt=IDS_PROMPT, max_tokens=12, logprobs=2)
    for e in chunks:
        c = e["choices"][0]
        assert len(c["logprobs"]["token_logprobs"]) == len(c["token_ids"])
    streamed = [v for e in chunks for v in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(lp["token_logprobs"], abs=1e-5)


LONG_IDS = [(7 * j) % 300 + 2 for j in range(150)]  # prefilled in three chunks (64-token steps)


def test_echo_with_logprobs_scores_the_prompt_as_transformers(stack):
    """What an eval harness asks (echo, logprobs, max_tokens 0): the prompt's text and every prompt
    token's logprob but the first (null, as OpenAI's), from the target's chunks; with max_tokens > 0
    the answer follows, its logprobs as without echo."""
    router, tok, target_dir = stack["router"], stack["tok"], stack["dirs"][0]
    r = post(router.url, "/v1/completions", prompt=LONG_IDS, echo=True, logprobs=2, max_tokens=0)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == dec(tok, LONG_IDS) and choice["token_ids"] == [] and choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 0
    assert lp["tokens"] == [dec(tok, [t]) for t in LONG_IDS] and lp["token_logprobs"][0] is None
    ref = torch.log_softmax(hf_logits(target_dir, LONG_IDS).double(), -1)
    want = ref[torch.arange(len(LONG_IDS) - 1), torch.tensor(LONG_IDS[1:])]
    assert torch.allclose(torch.tensor(lp["token_logprobs"][1:], dtype=torch.double), want, atol=1e-3)
    assert lp["top_logprobs"][0] is None
    for pos, top in enumerate(lp["top_logprobs"][1:]):
        assert max(top.values()) == pytest.approx(ref[pos].max().item(), abs=1e-3)

    plain = post(router.url, "/v1/completions", prompt=TEXT_PROMPT, max_tokens=5, logprobs=1).json()["choices"][0]
    echoed = post(router.url, "/v1/completions", prompt=TEXT_PROMPT, max_tokens=5, logprobs=1, echo=True)
    choice = echoed.json()["choices"][0]
    prompt = encode(tok, TEXT_PROMPT)
    assert choice["text"] == TEXT_PROMPT + plain["text"] and choice["token_ids"] == plain["token_ids"]
    assert len(choice["logprobs"]["token_logprobs"]) == len(prompt) + 5
    assert choice["logprobs"]["token_logprobs"][len(prompt):] == pytest.approx(
        plain["logprobs"]["token_logprobs"], abs=1e-5)
    # n choices share the prompt (computed once, forked): each echoes it, with the same logprobs
    both = post(router.url, "/v1/completions", prompt=TEXT_PROMPT, max_tokens=5, logprobs=1, echo=True, n=2)
    assert [c["text"] for c in both.json()["choices"]] == [choice["text"]] * 2, both.text
    first, second = (c["logprobs"]["token_logprobs"][:len(prompt)] for c in both.json()["choices"])
    assert first == second and first[0] is None
    assert first[1:] == pytest.approx(choice["logprobs"]["token_logprobs"][1:len(prompt)], abs=1e-4)
    # echo alone (no logprobs) only prepends the text; streamed, each choice's first chunk carries it
    alone = post(router.url, "/v1/completions", prompt=TEXT_PROMPT, max_tokens=5, echo=True).json()["choices"][0]
    assert alone["text"] == choice["text"] and alone["logprobs"] is None
    bare = post(router.url, "/v1/completions", prompt=TEXT_PROMPT, max_tokens=0, echo=True).json()["choices"][0]
    assert bare["text"] == TEXT_PROMPT and bare["logprobs"] is None and bare["token_ids"] == []
    chunks = sse(router.url, "/v1/completions", prompt=[TEXT_PROMPT, "x = 1\n"], max_tokens=5, echo=True)
    for index, head in ((0, TEXT_PROMPT), (1, "x = 1\n")):
        texts = [e["choices"][0]["text"] for e in chunks if e["choices"][0]["index"] == index]
        assert texts[0].startswith(head) and not any(t.startswith(head) for t in texts[1:] if t)
    assert "".join(e["choices"][0]["text"] for e in chunks if e["choices"][0]["index"] == 0) == choice["text"]


def test_final_text_has_every_token(stack, channel):
    """The text of a finished request is the decode of all its tokens, at every door, including the
    tokens of the step that finished it (by max_tokens, or by EOS)."""
    router, tok = stack["router"], stack["tok"]
    texts = {}
    r = post(router.url, "/v1/completions", prompt=IDS_PROMPT, max_tokens=20)
    texts["completion"] = (r.json()["choices"][0]["text"], r.json()["choices"][0]["token_ids"])
    chunks = sse(router.url, "/v1/completions", prompt=IDS_PROMPT, max_tokens=20)
    texts["completion-sse"] = ("".join(e["choices"][0]["text"] for e in chunks),
                               [t for e in chunks for t in e["choices"][0]["token_ids"]])
    r = post(router.url, "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=20)
    texts["chat"] = (r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["token_ids"])
    one = generate_pb2_grpc.GenerateStub(channel).GenerateUnary(generate_pb2.GenerateRequest(
        prompt_token_ids=IDS_PROMPT, max_tokens=20, ignore_eos=True, sampling=GREEDY_PB), timeout=60)
    texts["grpc"] = (one.text, list(one.token_ids))
    r = post(router.url, "/v1/completions", prompt=IDS_PROMPT, max_tokens=25, ignore_eos=False)  # ends at EOS
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    texts["completion-eos"] = (r.json()["choices"][0]["text"], r.json()["choices"][0]["token_ids"])
    wrong = {door: (text, dec(tok, ids)) for door, (text, ids) in texts.items() if text != dec(tok, ids)}
    assert not wrong, wrong


# ---- HTTP: chat --------------------------------------------------------------------------------
def test_chat_fallback_template_greedy_usage_and_logprobs(stack):
    router, tok, target_dir = stack["router"], stack["tok"], stack["dirs"][0]
    prompt = encode(tok, "user: Wrap this text.\nassistant:")
    r = post(router.url, "/v1/chat/completions", messages=[{"role": "user", "content": "Wrap this text."}],
             max_tokens=10, logprobs=True, top_logprobs=2)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    choice = out["choices"][0]
    want = hf_greedy(target_dir, prompt, 10)
    assert choice["token_ids"] == want
    assert choice["message"] == {"role": "assistant", "content": dec(tok, want)}
    assert choice["finish_reason"] == "length"
    assert counts(out["usage"]) == {"prompt_tokens": len(prompt),
                                    "completion_tokens": 10, "total_tokens": len(prompt) + 10}
    content = choice["logprobs"]["content"]
    assert len(content) == 10
    chosen, top_ids, top_lp = ref_logprobs(target_dir, prompt, want, 2)
    for i, entry in enumerate(content):
        assert entry["token"] == dec(tok, [want[i]])
        assert entry["logprob"] == pytest.approx(chosen[i].item(), abs=1e-3)
        assert [t["token"] for t in entry["top_logprobs"]] == [dec(tok, [t]) for t in top_ids[i].tolist()]
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(top_lp[i].tolist(), abs=1e-3)
    # content parts are joined; max_completion_tokens is honoured
    r = post(router.url, "/v1/chat/completions", max_completion_tokens=10,
             messages=[{"role": "user", "content": [{"type": "text", "text": "Wrap "},
                                                    {"type": "text", "text": "this text."}]}])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want and r.json()["choices"][0]["logprobs"] is None


def test_chat_streaming(stack):
    router, tok, target_dir = stack["router"], stack["tok"], stack["dirs"][0]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = encode(tok, "system: Be brief.\nuser: Hi\nassistant:")
    *chunks, usage = sse(router.url, "/v1/chat/completions", messages=msgs, max_tokens=15,
                         stream_options={"include_usage": True})
    assert all(e["object"] == "chat.completion.chunk" for e in chunks + [usage])
    # as OpenAI streams: the role in a choice's first delta only
    assert [e["choices"][0]["delta"].get("role") for e in chunks] == ["assistant"] + [None] * (len(chunks) - 1)
    ids = [t for e in chunks for t in e["choices"][0]["token_ids"]]
    assert ids == hf_greedy(target_dir, prompt, 15)
    assert "".join(e["choices"][0]["delta"]["content"] for e in chunks) == dec(tok, ids)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert counts(usage["usage"]) == {"prompt_tokens": len(prompt), "completion_tokens": 15,
                              "total_tokens": len(prompt) + 15}


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
                 "{% if m['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}{% endif %}"
                 "<{{ m['role'] }}>{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_chat_with_template_router(stack, tmp_path):
    """A router whose tokenizer_config carries a Jinja chat template tokenizes what transformers'
    apply_chat_template produces (special tokens included) and generates its greedy continuation."""
    target_dir, tok_dir = stack["dirs"][0], tmp_path / "tok"
    tok_dir.mkdir()
    shutil.copy(target_dir / "tokenizer.json", tok_dir / "tokenizer.json")
    cfg = json.loads((target_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": CHAT_TEMPLATE}))
    hf = AutoTokenizer.from_pretrained(tok_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Wrap this text."}]
    prompt = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    if isinstance(prompt, dict):
        prompt = prompt["input_ids"]
    assert prompt[0] == 0 and 1 in prompt  # <s> and </s> became their special ids
    # a second router on the stack's target: with the first one's identity (the lease holder's)
    same = RouterConfig(router_id=stack["router"].server.config.router_id)
    router = start_router(same, stack["parts"]["target"].address, None, tok_dir)
    try:
        r = post(router.url, "/v1/chat/completions", messages=msgs, max_tokens=8)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["prompt_tokens"] == len(prompt)
        assert out["choices"][0]["token_ids"] == hf_greedy(target_dir, prompt, 8)
        # the template's raise_exception becomes a 400 naming messages
        r = post(router.url, "/v1/chat/completions", messages=[{"role": "tool", "content": "x"}], max_tokens=2)
        assert_error(r, 400, "tool messages are not supported", "messages")
        # vLLM's template options, as transformers renders them: no turn opened, or the last one continued
        started = [*msgs, {"role": "assistant", "content": "Sure, here"}]
        for options in ({"add_generation_prompt": False}, {"add_generation_prompt": False,
                                                           "continue_final_message": True}):
            want = hf.apply_chat_template(started, tokenize=True, return_dict=False, **options)
            want = want["input_ids"] if isinstance(want, dict) else want
            r = post(router.url, "/v1/chat/completions", messages=started, max_tokens=4, **options)
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want), r.text
            assert r.json()["choices"][0]["token_ids"] == hf_greedy(target_dir, want, 4)
        r = post(router.url, "/v1/chat/completions", messages=msgs, max_tokens=2, continue_final_message=True,
                 add_generation_prompt=False)
        assert_error(r, 400, "assistant message last", "continue_final_message")
    finally:
        router.stop()


def test_tokenize_and_detokenize_as_the_doors_do(stack):
    """vLLM's /tokenize gives the ids the completions and chat doors compute from (their usage counts
    them), /detokenize the text an answer of those ids shows."""
    url, tok = stack["router"].url, stack["tok"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for body, door in (({"prompt": TEXT_PROMPT}, "/v1/completions"), ({"messages": msgs}, "/v1/chat/completions")):
        r = httpx.post(f"{url}/tokenize", json={"model": "tiny", **body}, timeout=30)
        assert r.status_code == 200, r.text
        out = r.json()
        used = post(url, door, **body, max_tokens=1).json()["usage"]["prompt_tokens"]
        assert out["count"] == len(out["tokens"]) == used and out["max_model_len"] == MAX_MODEL_LEN
    ids = encode(tok, TEXT_PROMPT)
    r = httpx.post(f"{url}/detokenize", json={"model": "tiny", "tokens": ids}, timeout=30)
    assert r.status_code == 200 and r.json() == {"prompt": dec(tok, ids)}
    assert_error(httpx.post(f"{url}/detokenize", json={"model": "tiny", "tokens": [1, 10**6]}), 400, "tokens", "tokens")
    assert_error(httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": "a", "messages": msgs}), 400,
                 "prompt or messages", "prompt")
    assert_error(httpx.post(f"{url}/tokenize", json={"model": "gpt-9", "prompt": "a"}), 404, "gpt-9", "model",
                 "not_found_error")


# ---- HTTP: models, health, readiness, metrics ----------------------------------------------------
def test_models_health_ready(stack):
    url = stack["router"].url
    r = httpx.get(f"{url}/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["tiny"]
    assert body["data"][0]["object"] == "model" and body["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(f"{url}/health").status_code == 200
    r = httpx.get(f"{url}/ready")
    assert r.status_code == 200 and r.json()["status"] == "ready" and r.json()["draft_available"] is True
    assert r.json()["target"] == stack["parts"]["target"].address


DOCUMENTED = ["tandem:time_to_first_token_seconds", "tandem:inter_token_latency_seconds",
              "tandem:spec_decode_num_drafts", "tandem:spec_decode_num_draft_tokens",
              "tandem:spec_decode_num_accepted_tokens", "tandem:spec_decode_num_accepted_tokens_per_pos",
              "tandem:pipeline_hits", "tandem:draft_fallbacks", "tandem:kv_cache_usage_perc",
              "tandem:num_requests_waiting", "tandem:num_requests_running", "tandem:step_time_seconds",
              "tandem:http_requests", "tandem:router_draining", "tandem:background_responses_running"]


def test_metrics_expose_documented_names_with_consistent_values(stack):
    url = stack["router"].url
    before = sample(metrics_text(url), "tandem:time_to_first_token_seconds_count") or 0
    for _ in range(3):  # speculative requests of this test's own (whatever ran before it in the module)
        post(url, "/v1/completions", prompt=IDS_PROMPT, max_tokens=20)
    # the gauges are refreshed by the loop once it is idle again
    assert wait_until(lambda: sample(metrics_text(url), "tandem:num_requests_running") == 0, 10)
    text = metrics_text(url)
    for name in DOCUMENTED:
        # counters carry Prometheus' _total suffix in the exposition, as vLLM's do
        assert re.search(rf"^# TYPE {re.escape(name)}(_total counter| gauge| histogram)$", text, re.M), name
    assert sample(text, "tandem:num_requests_waiting") == 0
    assert sample(text, "tandem:time_to_first_token_seconds_count") == before + 3, "each request observed one TTFT"
    assert sample(text, "tandem:inter_token_latency_seconds_count") > 0
    drafts = sample(text, "tandem:spec_decode_num_drafts_total")
    draft_tokens = sample(text, "tandem:spec_decode_num_draft_tokens_total")
    accepted = sample(text, "tandem:spec_decode_num_accepted_tokens_total")
    assert 0 < drafts <= draft_tokens and 0 <= accepted <= draft_tokens
    per_pos = [float(v) for v in re.findall(
        r'^tandem:spec_decode_num_accepted_tokens_per_pos_total\{position="\d+"\} (\S+)$', text, re.M)]
    assert sum(per_pos) == accepted
    assert sample(text, "tandem:pipeline_hits_total") <= sample(text, "tandem:pipeline_lookups_total")
    for service in ("target", "draft"):
        assert sample(text, "tandem:kv_cache_usage_perc", f'service="{service}"') == 0  # idle: nothing reserved
    for part in ("target", "draft", "router"):
        assert sample(text, "tandem:step_time_seconds_count", f'part="{part}"') > 0, part
    answered = sample(text, "tandem:http_requests_total", 'route="/v1/completions",status="200"')
    refused = sample(text, "tandem:http_requests_total", 'route="/v1/completions",status="400"') or 0
    post(url, "/v1/completions", prompt=IDS_PROMPT, max_tokens=2)
    httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -1})
    httpx.get(f"{url}/no/such/path")
    httpx.get(f"{url}/v1/responses/resp_nothing")  # a route with a parameter counts under its template
    text = metrics_text(url)
    assert sample(text, "tandem:http_requests_total", 'route="/v1/completions",status="200"') == answered + 1
    assert sample(text, "tandem:http_requests_total", 'route="/v1/completions",status="400"') == refused + 1
    assert sample(text, "tandem:http_requests_total", 'route="other",status="404"') >= 1
    assert sample(text, "tandem:http_requests_total", 'route="/v1/responses/{response_id}",status="404"') == 1


def test_several_prompts_are_answered_as_one_request(stack):
    """OpenAI's list of prompts (texts, or token-id lists): choice i of prompt p is index p x n + i,
    each equal to the prompt asked alone; usage counts every prompt once and every choice."""
    router, tok, target_dir = stack["router"], stack["tok"], stack["dirs"][0]
    second = IDS_PROMPT[:9]
    want = [hf_greedy(target_dir, encode(tok, TEXT_PROMPT), 6), hf_greedy(target_dir, second, 6)]
    texts = post(router.url, "/v1/completions", prompt=[TEXT_PROMPT, dec(tok, second)], max_tokens=6)
    assert texts.status_code == 200, texts.text
    assert texts.json()["choices"][0]["token_ids"] == want[0]
    r = post(router.url, "/v1/completions", prompt=[encode(tok, TEXT_PROMPT), second], n=2, max_tokens=6)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["token_ids"] for c in out["choices"]] == [want[0], want[0], want[1], want[1]]
    assert [c["text"] for c in out["choices"]] == [dec(tok, w) for w in (want[0], want[0], want[1], want[1])]
    prompt_tokens = len(encode(tok, TEXT_PROMPT)) + len(second)
    assert counts(out["usage"]) == {"prompt_tokens": prompt_tokens,
                                    "completion_tokens": 24, "total_tokens": prompt_tokens + 24}
    events = sse(router.url, "/v1/completions", prompt=[encode(tok, TEXT_PROMPT), second], n=2, max_tokens=6,
                 stream_options={"include_usage": True})
    *chunks, usage = events
    assert len({e["id"] for e in events}) == 1
    streamed: dict[int, list[int]] = {}
    for e in chunks:
        (choice,) = e["choices"]
        streamed.setdefault(choice["index"], []).extend(choice["token_ids"])
    assert streamed == {0: want[0], 1: want[0], 2: want[1], 3: want[1]}
    assert usage["usage"] == out["usage"]


def test_a_prompt_past_the_context_keeps_its_last_tokens_when_asked(stack):
    """vLLM's truncate_prompt_tokens: the last k prompt tokens (-1: what leaves room for max_tokens),
    answered as transformers answers that truncated prompt; without it, a 400."""
    router, tok, target_dir = stack["router"], stack["tok"], stack["dirs"][0]
    text = TEXT_PROMPT * 80  # far past max_model_len
    ids = encode(tok, text)
    assert len(ids) > MAX_MODEL_LEN
    assert post(router.url, "/v1/completions", prompt=text, max_tokens=8).status_code == 400
    out = post(router.url, "/v1/completions", prompt=text, max_tokens=8, truncate_prompt_tokens=40, echo=True,
               ignore_eos=True).json()
    choice = out["choices"][0]
    assert out["usage"]["prompt_tokens"] == 40 and choice["token_ids"] == hf_greedy(target_dir, ids[-40:], 8)
    assert choice["text"] == dec(tok, ids[-40:]) + dec(tok, choice["token_ids"]), "the echo is the prompt kept"
    room = post(router.url, "/v1/completions", prompt=text, max_tokens=8, truncate_prompt_tokens=-1).json()
    assert room["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 8
    default = post(router.url, "/v1/completions", prompt=text, truncate_prompt_tokens=-1)  # max_tokens: OpenAI's 16
    assert default.status_code == 200, default.text
    assert default.json()["usage"] == {**default.json()["usage"], "prompt_tokens": MAX_MODEL_LEN - 16,
                                       "completion_tokens": 16}
    chat = post(router.url, "/v1/chat/completions", max_tokens=4, truncate_prompt_tokens=12,
                messages=[{"role": "user", "content": text}], chat_template_kwargs={"truncating": True}).json()
    assert chat["usage"]["prompt_tokens"] == 12, "(a template variable of any name is the template's)"
    bad = post(router.url, "/v1/completions", prompt=text, max_tokens=8, truncate_prompt_tokens=0)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"


def test_null_means_the_default(stack):
    """OpenAI's optional fields are nullable; clients that send null get what leaving them out gives."""
    router = stack["router"]
    plain = post(router.url, "/v1/completions", prompt=IDS_PROMPT, max_tokens=4)
    nulls = post(router.url, "/v1/completions", prompt=IDS_PROMPT, max_tokens=4, stream=None, n=None, echo=None,
                 stop=None, logprobs=None, seed=None, stream_options=None, tools=None, user=None)
    assert nulls.status_code == 200, nulls.text
    assert nulls.json()["choices"] == plain.json()["choices"]


# ---- HTTP: bad input -----------------------------------------------------------------------------
TOO_LONG = [(5 * j) % 300 + 2 for j in range(MAX_MODEL_LEN + 10)]
OK = {"model": "tiny", "prompt": IDS_PROMPT, "max_tokens": 3}
CHAT_OK = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def _without(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


# (path, body: dict or raw bytes, status, text the message names, param, error type)
BAD = {
    "malformed-json": ("/v1/completions", b'{"model": "tiny", "prompt": [1, 2', 400, "JSON", None, None),
    "json-array": ("/v1/completions", b'[{"model": "tiny", "prompt": "hi"}]', 400, "object", None, None),
    "invalid-utf8": ("/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe\xfd"}', 400, "UTF-8", None, None),
    "nested-too-deeply": ("/v1/completions", b'{"model": "tiny", "prompt": ' + b"[" * 10**5 + b"]" * 10**5 + b"}", 400,
                          "nested too deeply", None, None),  # Python's decoder raised RecursionError: a 500
    "max_tokens-string": ("/v1/completions", {**OK, "max_tokens": "ten"}, 400, "max_tokens", "max_tokens", None),
    "temperature-string": ("/v1/completions", {**OK, "temperature": "hot"}, 400, "temperature", "temperature",
                           None),
    "stop-int": ("/v1/completions", {**OK, "stop": 5}, 400, "stop", "stop", None),
    "stop-empty": ("/v1/completions", {**OK, "stop": [""]}, 400, "stop", "stop", None),
    "missing-model": ("/v1/completions", _without(OK, "model"), 400, "model", "model", None),
    "missing-prompt": ("/v1/completions", _without(OK, "prompt"), 400, "prompt", "prompt", None),
    "missing-messages": ("/v1/chat/completions", _without(CHAT_OK, "messages"), 400, "messages", "messages", None),
    "empty-messages": ("/v1/chat/completions", {**CHAT_OK, "messages": []}, 400, "messages", "messages", None),
    "bad-role": ("/v1/chat/completions", {**CHAT_OK, "messages": [{"role": "wizard", "content": "x"}]}, 400,
                 "role", "messages.0.role", None),
    "empty-prompt": ("/v1/completions", {**OK, "prompt": ""}, 400, "prompt", "prompt", None),
    "empty-prompt-ids": ("/v1/completions", {**OK, "prompt": []}, 400, "prompt", "prompt", None),
    "prompt-too-long": ("/v1/completions", {**OK, "prompt": TOO_LONG}, 400, "max_model_len", "prompt", None),
    "max_tokens-0": ("/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens", "max_tokens", None),
    "max_tokens-huge": ("/v1/completions", {**OK, "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens", "max_tokens",
                        None),
    "max_tokens-enormous": ("/v1/completions", {**OK, "max_tokens": 2**70}, 400, "max_tokens", "max_tokens", None),
    "temperature-negative": ("/v1/completions", {**OK, "temperature": -0.5}, 400, "temperature", "temperature",
                             None),
    "top_p-1.5": ("/v1/completions", {**OK, "top_p": 1.5}, 400, "top_p", "top_p", None),
    "top_p-0": ("/v1/completions", {**OK, "top_p": 0}, 400, "top_p", "top_p", None),  # was read as 1.0
    "top_k-negative": ("/v1/completions", {**OK, "top_k": -1}, 400, "top_k", "top_k", None),
    "logprobs-99": ("/v1/completions", {**OK, "logprobs": 99}, 400, "logprobs", "logprobs", None),
    "chat-top_logprobs-99": ("/v1/chat/completions", {**CHAT_OK, "logprobs": True, "top_logprobs": 99}, 400,
                             "top_logprobs", "top_logprobs", None),
    "chat-top_logprobs-without-logprobs": ("/v1/chat/completions", {**CHAT_OK, "top_logprobs": 2}, 400,
                                           "top_logprobs", "top_logprobs", None),
    "n-0": ("/v1/completions", {**OK, "n": 0}, 400, "n", "n", None),
    "chat-n-17": ("/v1/chat/completions", {**CHAT_OK, "n": 17}, 400, "n", "n", None),
    "unknown-model": ("/v1/completions", {**OK, "model": "gpt-9"}, 404, "gpt-9", "model", "not_found_error"),
    "token-id-beyond-vocab": ("/v1/completions", {**OK, "prompt": [5, 6, 10**6]}, 400, "prompt", "prompt", None),
    "token-id-negative": ("/v1/completions", {**OK, "prompt": [5, -1]}, 400, "prompt", "prompt", None),
    "seed-negative": ("/v1/completions", {**OK, "seed": -1}, 400, "seed", "seed", None),
    "max_tokens-0-without-echo": ("/v1/completions", {**OK, "max_tokens": 0, "logprobs": 1}, 400, "echo",
                                  "max_tokens", None),
    "suffix": ("/v1/completions", {**OK, "suffix": "x"}, 400, "suffix", "suffix", None),
    "priority-served-fcfs": ("/v1/completions", {**OK, "priority": -1}, 400, "--scheduling-policy", "priority",
                             None),
    "stream_options-unknown": ("/v1/completions", {**OK, "stream_options": {"include_usage": True, "every": 1}},
                               400, "every", "stream_options.every", None),
    "prompts-one-empty": ("/v1/completions", {**OK, "prompt": ["hi", ""]}, 400, "prompt", "prompt", None),
    "prompts-of-mixed-kinds": ("/v1/completions", {**OK, "prompt": ["hi", [5, 6]]}, 400, "one kind", "prompt",
                               None),
    "prompts-too-many-choices": ("/v1/completions", {**OK, "prompt": [[5, 6]] * 5, "n": 16}, 400, "80 choices",
                                 "prompt", None),
    "prompts-one-too-long": ("/v1/completions", {**OK, "prompt": [[5, 6], TOO_LONG]}, 400, "max_model_len",
                             "prompt", None),
    "prompts-with-tandem_metrics": ("/v1/completions", {**OK, "prompt": ["a", "b"], "tandem_metrics": True}, 400,
                                    "one prompt", "tandem_metrics", None),
    # valid JSON, no text: tokenizing it raised UnicodeEncodeError (a 500 in plain text)
    "lone-surrogate": ("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b"}', 400, "surrogate", "prompt",
                       None),
    "lone-surrogate-chat": ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": '
                            b'"\\udc00"}]}', 400, "surrogate", "messages.0.content", None),
}


@pytest.fixture(scope="module")
def sanity(stack):
    """One short greedy request and its reference: run after each bad request."""
    want = hf_greedy(stack["dirs"][0], IDS_PROMPT, 3)

    def check() -> None:
        r = post(stack["router"].url, "/v1/completions", prompt=IDS_PROMPT, max_tokens=3)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want

    return check


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_gets_4xx_naming_the_field(stack, sanity, case):
    path, body, status, names, param, kind = BAD[case]
    url = stack["router"].url + path
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(url, json=body, timeout=30)
    assert_error(r, status, names, param, kind or "invalid_request_error")
    if isinstance(body, dict):
        # the same input streamed is refused the same way, before any event is sent
        r2 = httpx.post(url, json={**body, "stream": True}, timeout=30)
        assert r2.status_code == status and r2.headers["content-type"].startswith("application/json"), r2.text
    sanity()


def test_oversized_body_is_413(stack, sanity):
    url = stack["router"].url + "/v1/completions"
    big = json.dumps({**OK, "prompt": "a" * (4 * 2**20 + 1)}).encode()
    r = httpx.post(url, content=big, headers={"content-type": "application/json"}, timeout=30)
    assert_error(r, 413)

    def chunks():  # no content-length: the size is found while reading
        for i in range(0, len(big), 2**16):
            yield big[i:i + 2**16]

    r = httpx.post(url, content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    assert_error(r, 413)
    sanity()


def test_overload_gets_429_and_the_rest_succeed(stack):
    """max_num_seqs=1, max_waiting=1: of simultaneous long requests one runs, one waits, the rest
    are refused with 429 (HTTP) or RESOURCE_EXHAUSTED (gRPC); every admitted one is exact."""
    target_dir = stack["dirs"][0]
    owner = stack["router"].server.config.router_id  # the lease holder's identity: same target, second router
    router = start_router(RouterConfig(max_num_seqs=1, max_waiting=1, router_id=owner),
                          stack["parts"]["target"].address, None, target_dir)
    want = hf_greedy(target_dir, IDS_PROMPT, 60)
    barrier = threading.Barrier(6)

    def http_call(_: int) -> tuple[str, object]:
        barrier.wait()
        r = post(router.url, "/v1/completions", prompt=IDS_PROMPT, max_tokens=60)
        return "http", r

    def grpc_call(_: int) -> tuple[str, object]:
        with grpc.insecure_channel(router.grpc_address) as ch:
            stub = generate_pb2_grpc.GenerateStub(ch)
            barrier.wait()
            try:
                return "grpc", stub.GenerateUnary(generate_pb2.GenerateRequest(
                    prompt_token_ids=IDS_PROMPT, max_tokens=60, ignore_eos=True, sampling=GREEDY_PB), timeout=60)
            except grpc.RpcError as err:
                return "grpc", err

    try:
        with cf.ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda i: (http_call if i < 4 else grpc_call)(i), range(6)))
        ok = refused = 0
        for kind, res in results:
            if kind == "http":
                if res.status_code == 429:
                    assert_error(res, 429, "waiting", kind="rate_limit_error")
                    refused += 1
                else:
                    assert res.status_code == 200, res.text
                    assert res.json()["choices"][0]["token_ids"] == want
                    ok += 1
            elif isinstance(res, grpc.RpcError):
                assert res.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, res
                refused += 1
            else:
                assert list(res.token_ids) == want and res.finish_reason == "length"
                ok += 1
        assert ok >= 1 and refused >= 1, (ok, refused)
        # once the queue drains, the same router serves again
        r = post(router.url, "/v1/completions", prompt=IDS_PROMPT, max_tokens=60)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want
        # three prompts where one may wait: refused whole, the prompt queued before the refusal withdrawn
        aborted = sample(metrics_text(router.url), "tandem:requests_total", 'finish_reason="abort"') or 0
        assert_error(post(router.url, "/v1/completions", prompt=[IDS_PROMPT] * 3, max_tokens=60), 429, "waiting",
                     kind="rate_limit_error")
        assert sample(metrics_text(router.url), "tandem:requests_total", 'finish_reason="abort"') == aborted + 1
        r = post(router.url, "/v1/completions", prompt=IDS_PROMPT, max_tokens=60)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want
    finally:
        router.stop()


# ---- gRPC ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def channel(stack):
    ch = grpc.insecure_channel(stack["router"].grpc_address)
    yield ch
    ch.close()


def test_grpc_generate_streaming_and_unary_match_transformers(stack, channel):
    stub, target_dir = generate_pb2_grpc.GenerateStub(channel), stack["dirs"][0]
    want = hf_greedy(target_dir, IDS_PROMPT, 20)
    req = generate_pb2.GenerateRequest(request_id="g-1", prompt_token_ids=IDS_PROMPT, max_tokens=20,
                                       ignore_eos=True, sampling=GREEDY_PB)
    msgs = list(stub.Generate(req, timeout=60))
    assert len(msgs) >= 2
    assert [t for m in msgs for t in m.token_ids] == want
    assert "".join(m.text for m in msgs) == dec(stack["tok"], want)
    assert all(m.request_id == "g-1" for m in msgs)
    assert [m.finish_reason for m in msgs] == [""] * (len(msgs) - 1) + ["length"]
    assert msgs[-1].prompt_tokens == len(IDS_PROMPT) and msgs[-1].completion_tokens == 20
    one = stub.GenerateUnary(req, timeout=60)
    assert list(one.token_ids) == want and one.finish_reason == "length"
    assert one.cached_prompt_tokens == len(IDS_PROMPT) // 16 * 16, "the same prompt again: its full blocks cached"
    assert one.text == dec(stack["tok"], want)
    assert one.prompt_tokens == len(IDS_PROMPT) and one.completion_tokens == 20
    # text prompt, logprobs, stop string
    ids = encode(stack["tok"], TEXT_PROMPT)
    one = stub.GenerateUnary(generate_pb2.GenerateRequest(prompt=TEXT_PROMPT, max_tokens=8, ignore_eos=True,
                                                          logprobs=2, sampling=GREEDY_PB), timeout=60)
    assert list(one.token_ids) == hf_greedy(target_dir, ids, 8) and one.prompt_tokens == len(ids)
    assert one.request_id.startswith("gen-")
    chosen, top_ids, _ = ref_logprobs(target_dir, ids, list(one.token_ids), 2)
    assert [lp.token_id for lp in one.logprobs] == list(one.token_ids)
    assert [lp.logprob for lp in one.logprobs] == pytest.approx(chosen.tolist(), abs=1e-3)
    assert [list(lp.top_token_ids) for lp in one.logprobs] == top_ids.tolist()
    full, _, stop, expected = _stop_case(stack["tok"], target_dir)
    one = stub.GenerateUnary(generate_pb2.GenerateRequest(prompt_token_ids=IDS_PROMPT, max_tokens=40, stop=[stop],
                                                          ignore_eos=True, sampling=GREEDY_PB), timeout=60)
    assert one.text == expected and one.finish_reason == "stop"
    assert one.WhichOneof("stop_reason") == "stop_string" and one.stop_string == stop
    # a conversation: the chat door's prompt, the same answer
    chat = post(stack["router"].url, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}],
                max_tokens=8, ignore_eos=True, return_token_ids=True).json()
    want, hi = chat["choices"][0]["token_ids"], [generate_pb2.ChatMessage(role="user", content="hi")]
    one = stub.GenerateUnary(generate_pb2.GenerateRequest(messages=hi, max_tokens=8, ignore_eos=True,
                                                          sampling=GREEDY_PB), timeout=60)
    assert list(one.token_ids) == want and one.prompt_tokens == chat["usage"]["prompt_tokens"]
    assert one.WhichOneof("stop_reason") is None
    one = stub.GenerateUnary(generate_pb2.GenerateRequest(messages=hi, max_tokens=8, ignore_eos=True, sampling=(
        common_pb2.SamplingParams(temperature=0.0, stop_token_ids=[want[2]]))), timeout=60)
    assert list(one.token_ids) == want[:want.index(want[2])] and one.stop_token_id == want[2]
    # the prompt's logprobs: on the first message, one per prompt token but the first
    ref = torch.log_softmax(hf_logits(target_dir, LONG_IDS).double(), -1)
    msgs = list(stub.Generate(generate_pb2.GenerateRequest(prompt_token_ids=LONG_IDS, max_tokens=3, prompt_logprobs=1,
                                                           ignore_eos=True, sampling=GREEDY_PB), timeout=60))
    assert [lp.token_id for lp in msgs[0].prompt_logprobs] == LONG_IDS[1:]
    assert [lp.logprob for lp in msgs[0].prompt_logprobs] == pytest.approx(
        ref[torch.arange(len(LONG_IDS) - 1), torch.tensor(LONG_IDS[1:])].tolist(), abs=1e-3)
    assert [lp.rank for lp in msgs[0].prompt_logprobs] == [
        int((row > row[t]).sum()) + 1 for row, t in zip(ref, LONG_IDS[1:], strict=False)]  # 1: the most likely
    assert all(not m.prompt_logprobs for m in msgs[1:])
    alone = stub.GenerateUnary(generate_pb2.GenerateRequest(prompt_token_ids=LONG_IDS, max_tokens=0,
                                                            prompt_logprobs=0), timeout=60)
    assert len(alone.prompt_logprobs) == len(LONG_IDS) - 1 and not alone.token_ids and alone.finish_reason == "length"


GRPC_BAD = {
    "negative-temperature": (dict(prompt_token_ids=[5, 6], sampling=common_pb2.SamplingParams(temperature=-1.0)),
                             "temperature"),
    "prompt-and-ids": (dict(prompt="hi", prompt_token_ids=[5, 6]), "prompt"),
    "prompt-and-messages": (dict(prompt="hi", messages=[generate_pb2.ChatMessage(role="user", content="x")]),
                            "prompt"),
    "chat-role": (dict(messages=[generate_pb2.ChatMessage(role="wizard", content="x")]), "messages.0.role"),
    "empty-prompt": (dict(), "prompt"),
    "token-id-beyond-vocab": (dict(prompt_token_ids=[5, 10**6]), "prompt"),
    "too-long": (dict(prompt_token_ids=[5], max_tokens=MAX_MODEL_LEN), "max_tokens"),
    "negative-max_tokens": (dict(prompt_token_ids=[5], max_tokens=-3), "max_tokens"),
    "top_k-negative": (dict(prompt_token_ids=[5], sampling=common_pb2.SamplingParams(top_k=-2)), "top_k"),
    "logprobs-99": (dict(prompt_token_ids=[5], logprobs=99), "logprobs"),
    "zero-max_tokens": (dict(prompt_token_ids=[5], max_tokens=0), "max_tokens"),  # was read as "default"
    "prompt_logprobs-21": (dict(prompt_token_ids=[5], prompt_logprobs=21), "prompt_logprobs"),
    "zero-top_p": (dict(prompt_token_ids=[5], sampling=common_pb2.SamplingParams(top_p=0.0)), "top_p"),
    "empty-stop-string": (dict(prompt_token_ids=[5], stop=["x", ""]), "stop"),
}


@pytest.mark.parametrize("case", sorted(GRPC_BAD))
def test_grpc_bad_input_is_invalid_argument(stack, channel, case):
    stub = generate_pb2_grpc.GenerateStub(channel)
    fields, names = GRPC_BAD[case]
    req = generate_pb2.GenerateRequest(**fields)
    with pytest.raises(grpc.RpcError) as err:
        stub.GenerateUnary(req, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and names in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(req, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and names in err.value.details()
    one = stub.GenerateUnary(generate_pb2.GenerateRequest(prompt_token_ids=IDS_PROMPT, max_tokens=3,
                                                          ignore_eos=True, sampling=GREEDY_PB), timeout=30)
    assert list(one.token_ids) == hf_greedy(stack["dirs"][0], IDS_PROMPT, 3)


# bytes that are no GenerateRequest: field 2 (prompt, a string) holding invalid UTF-8; one cut short
UNDECODABLE = {"bad-utf8-prompt": (b"\x12\x03a\xffb", "UTF-8"), "truncated": (b"\x12\x09abc", "parsing")}


@pytest.mark.parametrize("case", sorted(UNDECODABLE))
def test_grpc_undecodable_request_is_invalid_argument(stack, channel, case):
    """grpc's own answer to a message it cannot parse is UNKNOWN; the door says INVALID_ARGUMENT and why."""
    raw, names = UNDECODABLE[case]
    parse = generate_pb2.GenerateResponse.FromString
    unary = channel.unary_unary("/tandem.v1.Generate/GenerateUnary", request_serializer=bytes,
                                response_deserializer=parse)
    streamed = channel.unary_stream("/tandem.v1.Generate/Generate", request_serializer=bytes,
                                    response_deserializer=parse)
    for call in (lambda: unary(raw, timeout=10), lambda: list(streamed(raw, timeout=10))):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert names in err.value.details(), err.value.details()


def test_grpc_cancelled_stream_frees_kv_in_both_services(stack, channel):
    """Seeded, so the draft works for it whatever the draft regime decided for the stack's compute (a
    seeded request's k never depends on timing): both services hold its KV while it streams."""
    trunner, drunner = stack["target"], stack["draft"]
    assert wait_until(lambda: trunner.blocks.num_free == trunner.config.num_blocks, 10)
    aborted = sample(metrics_text(stack["router"].url), "tandem:requests_total", 'finish_reason="abort"') or 0
    seeded = common_pb2.SamplingParams(temperature=1.0, seed=7)
    call = generate_pb2_grpc.GenerateStub(channel).Generate(generate_pb2.GenerateRequest(
        prompt_token_ids=TOO_LONG[:100], max_tokens=400, ignore_eos=True, sampling=seeded), timeout=60)
    got = [next(call) for _ in range(3)]
    assert all(m.token_ids for m in got)
    assert trunner.blocks.num_free < trunner.config.num_blocks  # the sequence holds KV while it streams
    if sample(metrics_text(stack["router"].url), "tandem:draft_available") == 1:  # (unless the draft fell back)
        assert drunner.blocks.num_free < drunner.config.num_blocks
    call.cancel()
    assert wait_until(lambda: trunner.blocks.num_free == trunner.config.num_blocks, 15)
    assert wait_until(lambda: drunner.blocks.num_free == drunner.config.num_blocks, 15)
    assert wait_until(lambda: sample(metrics_text(stack["router"].url), "tandem:requests_total",
                                     'finish_reason="abort"') == aborted + 1, 10)


def test_grpc_health_and_reflection(stack, channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "tandem.v1.Generate"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    (resp,) = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                             timeout=10))
    names = {s.name for s in resp.list_services_response.service}
    assert {"tandem.v1.Generate", "grpc.health.v1.Health"} <= names


# ---- last: the target goes away ---------------------------------------------------------------
def test_target_gone_ready_503_and_requests_fail_cleanly(stack, channel):
    router = stack["router"]
    stack["parts"]["target"].stop()
    # the router notices on its next step; past target_grace_s (2 s) the request fails with 503
    r = post(router.url, "/v1/completions", prompt=IDS_PROMPT, max_tokens=5)
    assert_error(r, 503, "unavailable", kind="unavailable")
    r = httpx.get(f"{router.url}/ready")
    assert_error(r, 503, kind="unavailable")
    assert httpx.get(f"{router.url}/health").status_code == 200  # alive, just not ready
    assert_error(post(router.url, "/v1/completions", prompt=IDS_PROMPT, max_tokens=5), 503, kind="unavailable")
    with pytest.raises(grpc.RpcError) as err:
        generate_pb2_grpc.GenerateStub(channel).GenerateUnary(
            generate_pb2.GenerateRequest(prompt_token_ids=IDS_PROMPT, max_tokens=3), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_router_does_not_import_torch():
    """The router is a CPU front end: it must start without loading PyTorch (seconds and GBs)."""
    import subprocess
    import sys

    code = "import sys, router.server, router.__main__, router.launch; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
