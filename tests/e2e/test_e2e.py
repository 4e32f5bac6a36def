"""Tandem end to end: three processes, real clients (the official openai client, a gRPC client
generated from proto/, raw HTTP for malformed input), faults injected by killing processes."""

from __future__ import annotations

import concurrent.futures as cf
import signal
import time

import grpc
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.conftest import Reference, auth_metadata, grpc_channel, http_client

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n    print(", "# Copyright\n\"\"\"Utilities for parsing", "x = [",
           "def read_config(path):\n    with open(path) as f:\n        return json.load(",
           "try:\n    import numpy as np\nexcept ImportError:\n"]


def long_prompt(n_lines: int) -> str:
    return "".join(f"value_{i} = compute({i}, key='k{i}')\n" for i in range(n_lines))


@pytest.fixture(scope="module")
def client(stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key=getattr(stack, "api_key", "") or "unused", timeout=120,
                  max_retries=0, http_client=http_client(stack))


@pytest.fixture(scope="module")
def model(stack) -> str:
    return getattr(stack, "served_name", None) or stack.model_name


def test_completions_greedy_equal_transformers(client, model, ref):
    for prompt in PROMPTS[:4]:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        expected = ref.greedy(ref.encode(prompt), 24)
        assert out.choices[0].model_extra["token_ids"] == expected
        assert out.choices[0].text == ref.decode(expected)
        assert out.usage.completion_tokens == 24


def test_streaming_completion_equals_non_streaming(client, model, ref):
    prompt = PROMPTS[2]
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=30, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == ref.decode(ref.greedy(ref.encode(prompt), 30))


def test_chat_streaming_and_not(client, model, ref):
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0,
                                           extra_body={"ignore_eos": True})
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=messages, max_tokens=20, temperature=0, stream=True, extra_body={"ignore_eos": True})
        if c.choices)
    assert whole.choices[0].message.content == streamed
    prompt_ids = ref.encode("user: Write a function that adds two numbers.\nassistant:")  # the plain fallback
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert whole.choices[0].message.content == ref.decode(ref.greedy(prompt_ids, 20))


def test_grpc_generate_streaming_and_unary(stack, ref):
    prompt_ids = ref.encode(PROMPTS[5])
    auth = auth_metadata(stack)
    with grpc_channel(stack) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        req = generate_pb2.GenerateRequest(prompt_token_ids=prompt_ids, max_tokens=25, ignore_eos=True,
                                           sampling=common_pb2.SamplingParams(temperature=0))
        ids = [t for msg in stub.Generate(req, timeout=60, metadata=auth) for t in msg.token_ids]
        unary = stub.GenerateUnary(req, timeout=60, metadata=auth)
        with pytest.raises(grpc.RpcError) as bad:
            bad_params = common_pb2.SamplingParams(temperature=-1)
            stub.GenerateUnary(generate_pb2.GenerateRequest(prompt="x", max_tokens=5, sampling=bad_params), timeout=10,
                               metadata=auth)
    expected = ref.greedy(prompt_ids, 25)
    assert ids == expected and list(unary.token_ids) == expected and unary.finish_reason == "length"
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in bad.value.details()


def _check_one(client, model, ref, i: int) -> None:
    """One of the mixed-load requests: its own prompt length, streaming, stop string or logprobs."""
    prompt = PROMPTS[i % len(PROMPTS)] if i % 4 else long_prompt(4 + i // 4)
    ids = ref.encode(prompt)
    expected = ref.greedy(ids, 24)
    text = ref.decode(expected)
    kind = i % 4
    if kind == 1:  # streaming
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == text
    elif kind == 2 and len(text) > 8:  # a stop string taken from the middle of the known output
        stop = text[len(text) // 2: len(text) // 2 + 3]
        out = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == text[: text.find(stop)]
        assert out.choices[0].finish_reason == "stop"
    elif kind == 3:  # logprobs against transformers
        out = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, logprobs=2,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == expected
        want = ref.logprobs(ids + expected, len(ids))
        got = out.choices[0].logprobs.token_logprobs
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-3
        assert all(len(t) <= 2 for t in out.choices[0].logprobs.top_logprobs)
    else:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == expected


def test_32_concurrent_mixed_requests(client, model, ref):
    for i in range(32):  # references first, so the load below is not paced by transformers
        ref.greedy(ref.encode(PROMPTS[i % len(PROMPTS)] if i % 4 else long_prompt(4 + i // 4)), 24)
    with cf.ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda i: _check_one(client, model, ref, i), range(32)))


BAD_BODIES = [
    (b"{not json", 400), (b"[1, 2]", 400), (b'{"model": "M", "prompt": "x", "max_tokens": "ten"}', 400),
    (b'{"prompt": "x"}', 400), (b'{"model": "M"}', 400), (b'{"model": "M", "prompt": "x", "max_tokens": 0}', 400),
    (b'{"model": "M", "prompt": "x", "max_tokens": 100000000}', 400),
    (b'{"model": "M", "prompt": "x", "temperature": -0.5}', 400), (b'{"model": "M", "prompt": "x", "top_p": 1.5}', 400),
    (b'{"model": "M", "prompt": "\xff\xfe bad utf8"}', 400), (b'{"model": "nope", "prompt": "x"}', 404),
    (b'{"model": "M", "prompt": "x", "temperature": "hot"}', 400), (b'{"model": "M", "prompt": ""}', 400),
]


def test_bad_input_battery_gets_4xx_and_server_keeps_serving(stack, client, model, ref):
    with http_client(stack, timeout=60) as http:
        for body, status in BAD_BODIES:
            r = http.post(f"{stack.url}/v1/completions", content=body.replace(b'"M"', f'"{model}"'.encode()),
                          headers={"Content-Type": "application/json"})
            assert r.status_code == status, (body, r.text)
            assert r.json()["error"]["message"]
        too_long = long_prompt(200)  # far beyond max_model_len
        with pytest.raises(BadRequestError, match="max_model_len"):
            client.completions.create(model=model, prompt=too_long, max_tokens=5)
        with pytest.raises(NotFoundError):
            client.completions.create(model="other-model", prompt="x", max_tokens=5)
        huge = b'{"model": "x", "prompt": "' + b"a" * (5 * 2**20) + b'"}'
        big = http.post(f"{stack.url}/v1/completions", content=huge, headers={"Content-Type": "application/json"})
        assert big.status_code == 413
        test_completions_greedy_equal_transformers(client, model, ref)  # still serving, still correct


def _peak_rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status").read().splitlines():  # noqa: SIM115
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_64_mib_body_gets_a_readable_413_and_costs_the_router_no_memory(stack, client, model, ref):
    """Sent with a Content-Length, or chunked with none: either way the client reads a 413 (not a
    reset connection), and the router's peak memory grows by far less than the body."""
    router = getattr(stack, "procs", {}).get("router")
    before = _peak_rss_bytes(router.pid) if router else 0
    size = 64 * 2**20
    piece = b"a" * 2**20

    def chunks():
        yield b'{"model": "' + model.encode() + b'", "prompt": "'
        for _ in range(size // len(piece)):
            yield piece
        yield b'"}'

    whole = b"".join(chunks())
    with http_client(stack) as http:
        for content in (whole, chunks()):
            r = http.post(f"{stack.url}/v1/completions", content=content, headers={"Content-Type": "application/json"})
            assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]
    del whole
    if router:
        grown = _peak_rss_bytes(router.pid) - before
        assert grown < size // 4, f"the router's peak memory grew by {grown / 2**20:.0f} MiB"
    test_completions_greedy_equal_transformers(client, model, ref)


def _load(client, model, ref, n: int, max_tokens: int) -> list[cf.Future]:
    pool = cf.ThreadPoolExecutor(n)
    futures = []
    for i in range(n):
        prompt = PROMPTS[i % len(PROMPTS)]

        def one(prompt: str = prompt) -> tuple[str, list[int]]:
            out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
            return prompt, out.choices[0].model_extra["token_ids"]

        futures.append(pool.submit(one))
    pool.shutdown(wait=False)
    return futures


def _metric(stack, name: str) -> float:
    with http_client(stack, timeout=10) as http:
        text = http.get(f"{stack.url}/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_draft_killed_and_restarted_under_load_loses_nothing(stack, client, model, ref):
    futures = _load(client, model, ref, 8, 120)
    time.sleep(1.0)
    stack.kill("draft", signal.SIGKILL)
    time.sleep(1.0)
    stack.start_service("draft")
    results = [f.result(timeout=180) for f in futures]
    for prompt, ids in results:
        assert ids == ref.greedy(ref.encode(prompt), 120)
    stack.wait_service("draft", 60)
    deadline = time.monotonic() + 30
    while _metric(stack, "tandem:draft_available") != 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _metric(stack, "tandem:draft_available") == 1


def test_target_killed_and_restarted_requests_recompute_or_fail_503(stack, client, model, ref):
    futures = _load(client, model, ref, 6, 100)
    time.sleep(1.0)
    stack.kill("target", signal.SIGKILL)
    time.sleep(0.5)
    stack.start_service("target")
    t0 = time.monotonic()
    for f in futures:
        try:
            prompt, ids = f.result(timeout=120)  # nothing hangs past its deadline
        except Exception as err:  # noqa: BLE001 - the one allowed failure is a clear 503
            assert getattr(err, "status_code", None) == 503, err
            continue
        assert ids == ref.greedy(ref.encode(prompt), 100)
    assert time.monotonic() - t0 < 120
    stack.wait_service("target", 60)
    with http_client(stack, timeout=10) as http:  # the router takes the target back (lease, GetInfo) first
        deadline = time.monotonic() + 60
        while http.get(f"{stack.url}/ready").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
    test_completions_greedy_equal_transformers(client, model, ref)


def test_multi_turn_chat_attaches_the_cached_history_in_both_services(stack, client, model, ref):
    """Each turn resends the conversation: its earlier turns are cached KV in the target and the draft.
    Seeded sampling from the top token alone: the greedy answer, and a request that keeps the draft at
    work (on the cores it shares with the target a greedy one may find it resting, router.regime)."""
    before = {s: _metric(stack, f'tandem:prefix_cache_hits_total{{service="{s}"}}') for s in ("target", "draft")}
    messages = [("system", long_prompt(12)), ("user", "Sum the values.")]
    for turn in range(3):
        out = client.chat.completions.create(model=model, messages=[{"role": r, "content": c} for r, c in messages],
                                             max_tokens=16, temperature=1.0, seed=turn,
                                             extra_body={"ignore_eos": True, "top_k": 1})
        prompt = "".join(f"{role}: {content}\n" for role, content in messages) + "assistant:"  # the plain fallback
        assert out.choices[0].message.content == ref.decode(ref.greedy(ref.encode(prompt), 16))
        messages += [("assistant", out.choices[0].message.content), ("user", f"Now only the first {turn + 2}.")]
    for service, hits in before.items():
        after = _metric(stack, f'tandem:prefix_cache_hits_total{{service="{service}"}}')
        assert after >= hits + 2 * 12 * 8, f"{service}: the 12-line system prompt, cached, in turns 2 and 3"


def test_seeded_sampling_reproducible(client, model):
    def run() -> list[str]:
        return [client.completions.create(model=model, prompt=p, max_tokens=16, temperature=0.8, seed=7 + i,
                                          extra_body={"ignore_eos": True}).choices[0].text
                for i, p in enumerate(PROMPTS[:3])]
    assert run() == run()




def test_structured_output_n_tools_and_responses_with_the_official_client(client, model):
    """response_format json_schema and n through the openai client: every choice parses and validates;
    a required tool call is a valid call; tool_choice "auto" without a parser is a 400 naming it rather
    than free text; the Responses API answers the chat answer as an output item."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "ok": {"type": "boolean"}},
              "required": ["name", "ok"], "additionalProperties": False}
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "a record"}], max_tokens=80, temperature=0.7, seed=5, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": schema}})
    assert sorted(c.index for c in out.choices) == [0, 1]
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)
        assert choice.finish_reason == "stop"
    tools = [{"type": "function", "function": {"name": "record", "parameters": schema}}]
    called = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], tools=tools,
                                            tool_choice="required", parallel_tool_calls=False, temperature=0)
    [call] = called.choices[0].message.tool_calls
    assert call.function.name == "record" and called.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), schema)
    with pytest.raises(BadRequestError, match="tool_choice"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=12,
                                          temperature=0)
    answer = client.responses.create(model=model, input="Hi", max_output_tokens=12, temperature=0)
    assert answer.output_text == chat.choices[0].message.content and answer.usage.output_tokens == 12
    more = client.responses.create(model=model, input="More", previous_response_id=answer.id, max_output_tokens=8,
                                   temperature=0)
    assert client.responses.retrieve(more.id).output_text == more.output_text
    assert [i.role for i in client.responses.input_items.list(more.id).data] == ["user", "assistant", "user"]
    predicted = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=12, temperature=0, prediction={
                                                   "type": "content", "content": chat.choices[0].message.content})
    assert predicted.choices[0].message.content == chat.choices[0].message.content, "a prediction changes no token"


def test_anthropic_messages_with_the_official_client(stack, client, model):
    """Anthropic's client, its key sent as x-api-key: a text answer is the chat answer, streamed to the same
    message, and a forced tool call is a tool_use block."""
    import httpx2
    from anthropic import Anthropic

    anthropic = Anthropic(base_url=stack.url, api_key=getattr(stack, "api_key", "") or "unused", max_retries=0,
                          http_client=httpx2.Client(verify=stack.ssl_context() or True, timeout=120))
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=12,
                                          temperature=0)
    asked = {"model": model, "max_tokens": 12, "messages": [{"role": "user", "content": "Hi"}],
             "extra_body": {"temperature": 0}}
    answer = anthropic.messages.create(**asked)
    assert answer.content[0].text == chat.choices[0].message.content
    with anthropic.messages.stream(**asked) as s:
        assert s.get_final_message().content[0].text == answer.content[0].text
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
            "additionalProperties": False}
    called = anthropic.messages.create(**asked | {"max_tokens": 40}, tools=[{"name": "weather", "input_schema": city}],
                                       tool_choice={"type": "tool", "name": "weather"})
    assert called.stop_reason == "tool_use" and called.content[0].name == "weather"
    assert isinstance(called.content[0].input["city"], str)


def test_a_lora_adapter_named_as_the_model_answers_as_its_merged_checkpoint(stack, client, model, ref):
    """The target started with --lora-modules sql=DIR: "model": "sql" gets transformers' greedy answer on
    the adapter merged into the base checkpoint, the base model's requests their own, side by side."""
    if not hasattr(stack, "lora"):
        pytest.skip("the deployed stack serves no test adapter")
    merged = Reference(stack.lora / "merged")
    assert [m.id for m in client.models.list().data] == [model, "sql"]
    prompts = [ref.encode(p) for p in PROMPTS[:4]]
    with cf.ThreadPoolExecutor(8) as pool:
        futures = [(p, m, pool.submit(client.completions.create, model=m, prompt=p, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True}))
                   for p in prompts for m in (model, "sql")]
        for p, m, f in futures:
            want = (merged if m == "sql" else ref).greedy(p, 16)
            assert f.result().choices[0].token_ids == want, m
