"""Tool calls on /v1/chat/completions (router.gateway.tools), as OpenAI's API and its official client have them:

- a named tool_choice answers one call whose arguments validate against that tool's parameters, the
  same tokens as the same schema asked through response_format (the structured-output path, itself
  tested against transformers); streamed, its arguments arrive piece by piece under one id
- "required" answers one call or more of the given tools (one with parallel_tool_calls: false),
  finish_reason "tool_calls"; cut short by max_tokens, the partial text comes back as content
- earlier calls and tools' answers sent back as history render as transformers renders them
- "auto" with the hermes parser: text, then <tool_call> blocks, answered as content and calls; streamed,
  the text streams until a block opens (never a piece of the marker), the calls come whole at the end
- what cannot be honoured ("auto" without a parser, an unknown tool, two constraints) is a 400 naming
  the field
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from common.sampling import SamplingParams
from router.chat import ChatFormatter
from router.config import RouterConfig
from router.core import Delta, FinishReason, Request, RequestError
from router.gateway.openai_format import ChatFormat
from router.gateway.tools import tool_calling
from tests.stack import running_stack
from tests.test_chat_templates import save_transformers5_layout

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# -- the choice, without a model -------------------------------------------------------------------

def test_a_named_choice_is_constrained_to_that_tools_parameters():
    calling = tool_calling(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None)
    assert calling.constraint().value == CLOCK and calling.finish_reason == "stop"
    content, [c] = calling.answer('{"zone": "UTC"}')
    assert content is None and c["id"].startswith("call_")
    assert c["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}


def test_required_is_an_array_of_the_tools_calls_one_unless_parallel():
    schema = tool_calling(TOOLS, "required", False).constraint().value
    assert schema["minItems"] == schema["maxItems"] == 1
    assert "maxItems" not in tool_calling(TOOLS, "required", None).constraint().value
    one = {"name": "get_time", "parameters": {"zone": "CET"}}
    jsonschema.validate([one], schema)
    for bad in ([], [{"name": "get_time", "parameters": {"city": "x"}}], [{"name": "nope", "parameters": {}}],
                [one, one]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    _, calls = tool_calling(TOOLS, "required", True).answer(json.dumps([one, {"name": "get_weather", "parameters": {
        "city": "Nîmes", "unit": "celsius"}}]))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_time", {"zone": "CET"}), ("get_weather", {"city": "Nîmes", "unit": "celsius"})]
    assert tool_calling(TOOLS, "required", True).answer('[{"name": "get_ti') == ('[{"name": "get_ti', None)


def test_no_tools_or_none_is_text():
    assert tool_calling(None, None, None) is None
    assert tool_calling(TOOLS, "none", None) is None


@pytest.mark.parametrize("tools,choice,field", [
    (TOOLS, None, "tool_choice"),  # "auto", OpenAI's default with tools, and no parser
    (TOOLS, "auto", "tool_choice"),
    (None, "required", "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
    (TOOLS, {"type": "function"}, "tool_choice"),
    (TOOLS, {"type": "function", "function": "get_time"}, "tool_choice"),
    (TOOLS, "sometimes", "tool_choice"),
    ([{"type": "retrieval"}], "required", "tools.0"),
    ([{"type": "function", "function": {"name": "has space"}}], "required", "tools.0.function.name"),
    ([TOOLS[0], TOOLS[0]], "required", "tools.1.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "required", "tools.0.function.parameters"),
])
def test_what_cannot_be_honoured_names_its_field(tools, choice, field):
    with pytest.raises(RequestError) as err:
        tool_calling(tools, choice, None)
    assert err.value.field == field


HERMES = tool_calling(TOOLS, "auto", None, parser="hermes")


@pytest.mark.parametrize("text,content,calls", [
    ("It is sunny.", "It is sunny.", None),
    ('Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
     "Let me check.\n", [("get_time", {"zone": "UTC"})]),  # the text as written, as vLLM's
    ('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n<tool_call>{"name": "get_weather", '
     '"arguments": {"city": "Oslo"}}</tool_call>', None,
     [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo"})]),
    ('<tool_call>{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),  # ended right after its JSON
    ('<tool_call>{"name": "get_time", "argu', None, None),  # cut short: text
    ('<tool_call>{"name": "launch", "arguments": {}}</tool_call>', None, None),  # no such tool: text
])
def test_auto_reads_hermes_blocks_as_calls_and_anything_else_as_text(text, content, calls):
    got_content, got_calls = HERMES.answer(text)
    if calls is None:
        assert (got_content, got_calls) == (text, None)
    else:
        assert got_content == content
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    assert HERMES.constraint() is None and HERMES.finish_reason == "tool_calls"


def test_auto_streams_text_up_to_where_a_call_might_open():
    assert HERMES.streamable("Hello") == 5
    assert HERMES.streamable("Hello <tool") == len("Hello ")  # might open a block: wait
    assert HERMES.streamable("Hello <tools are great") == len("Hello <tools are great")
    assert HERMES.streamable('Hi <tool_call>{"na') == len("Hi ")
    assert tool_calling(TOOLS, "required", None).streamable("[") == 0


def stream_chat(fmt: ChatFormat, pieces: list[str], finish: FinishReason = FinishReason.STOP) -> list[dict]:
    deltas = [Delta([i], p, completion_tokens=i + 1) for i, p in enumerate(pieces)]
    deltas[-1].finish_reason = finish
    return [c["choices"][0] for d in deltas if (c := fmt.chunk(d)) is not None]


def test_an_auto_answer_streams_its_text_then_its_calls_whole():
    req = Request(request_id="r", prompt_ids=[1], sampling=SamplingParams(), max_tokens=50)
    fmt = ChatFormat(lambda ids: "", "m", req, True, tools=HERMES)
    pieces = ["Checking", " the time <", "tool_", 'call>{"name": "get_time", ', '"arguments": {"zone": "CET"}}',
              "</tool_call>"]
    chunks = stream_chat(fmt, pieces)
    assert [c["delta"].get("content") for c in chunks[:-1]] == ["Checking", " the time "]
    assert chunks[0]["delta"]["role"] == "assistant" and "role" not in chunks[1]["delta"]
    last = chunks[-1]
    assert last["finish_reason"] == "tool_calls" and "content" not in last["delta"]
    [tc] = last["delta"]["tool_calls"]
    assert tc["index"] == 0 and tc["function"] == {"name": "get_time", "arguments": '{"zone": "CET"}'}
    assert [t for c in chunks for t in c["token_ids"]] == list(range(len(pieces)))  # every token, once
    plain = stream_chat(ChatFormat(lambda ids: "", "m", req, False, tools=HERMES), ["A <", "b> c"])
    assert "".join(c["delta"]["content"] for c in plain) == "A <b> c" and plain[-1]["finish_reason"] == "stop"
    fmt = ChatFormat(lambda ids: "", "m", req, False, tools=HERMES)
    cut = stream_chat(fmt, ["x <tool_call>{"], FinishReason.LENGTH)
    assert "".join(c["delta"]["content"] for c in cut) == "x <tool_call>{" and cut[-1]["finish_reason"] == "length"


QWEN25_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}"
    "{{- tool | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}{{- '<|im_start|>assistant' }}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + message.content }}"
    "{{- '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_history_with_calls_and_answers_renders_as_transformers(tmp_path):
    """The client sends its calls back with arguments as JSON text (OpenAI's shape); the template gets
    them as objects, as transformers' users pass them, so `arguments | tojson` is not a quoted string."""
    from router.gateway.openai_types import ChatBody

    d = save_transformers5_layout(tmp_path / "qwen", QWEN25_TOOLS, None)
    sent = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    body = ChatBody(model="m", messages=sent, tools=TOOLS, tool_choice="none")
    got = ChatFormatter.from_dir(d).render(body.conversation(), **body.template_options())
    hf_messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    want = AutoTokenizer.from_pretrained(d).apply_chat_template(hf_messages, tools=TOOLS, tokenize=False,
                                                                add_generation_prompt=True)
    assert got == want and '"arguments": {"city": "Paris"' in got and '"name": "get_time"' in got


# -- through the whole stack --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(model_pair):
    config = RouterConfig(max_num_batched_tokens=128, max_num_seqs=16, draft_timeout_s=5.0, target_grace_s=2.0,
                          tool_call_parser="hermes")
    with running_stack(model_pair, config) as s:
        s["client"] = OpenAI(base_url=f"{s['router'].url}/v1", api_key="unused", max_retries=0)
        yield s


def chat(url: str, **body) -> httpx.Response:  # noqa: ANN003
    return httpx.post(f"{url}/v1/chat/completions", timeout=120,
                      json={"model": "tiny", "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 80,
                            "return_token_ids": True, **body})


def test_a_named_call_is_that_tools_arguments_as_response_format_would_write_them(stack):
    url = stack["router"].url
    r = chat(url, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    [c] = choice["message"]["tool_calls"]
    assert choice["message"]["content"] is None and choice["finish_reason"] == "stop"
    assert c["type"] == "function" and c["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(c["function"]["arguments"]), WEATHER)
    schema = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    same = chat(url, tools=None, response_format=schema)
    assert same.status_code == 200, same.text
    assert choice["token_ids"] == same.json()["choices"][0]["token_ids"]  # same prompt (tools ignored by template)
    assert c["function"]["arguments"] == same.json()["choices"][0]["message"]["content"]


def test_required_answers_calls_of_the_given_tools(stack):
    client = stack["client"]
    for i, parallel in enumerate((False, True, True)):
        out = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=parallel, max_tokens=200, temperature=0.9, seed=i,
                                             n=2)
        for choice in out.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            calls = choice.message.tool_calls
            assert len(calls) == 1 or (parallel and len(calls) > 1)
            for c in calls:
                jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
            assert len({c.id for c in calls}) == len(calls)


def test_a_named_call_streams_its_arguments_under_one_id(stack):
    client = stack["client"]
    named = {"type": "function", "function": {"name": "get_time"}}
    whole = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=named, temperature=0)
    parts = list(client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=named,
                                                temperature=0, stream=True))
    deltas = [p.choices[0].delta for p in parts]
    first = deltas[0].tool_calls[0]
    assert deltas[0].role == "assistant" and first.id.startswith("call_") and first.function.name == "get_time"
    assert all(tc.id is None and tc.index == 0 for d in deltas[1:] for tc in (d.tool_calls or []))
    streamed = "".join(tc.function.arguments or "" for d in deltas for tc in (d.tool_calls or []))
    assert streamed == whole.choices[0].message.tool_calls[0].function.arguments
    assert [p.choices[0].finish_reason for p in parts][-1] == "stop"


def test_required_streams_whole_calls_and_a_cut_short_answer_is_content(stack):
    url = stack["router"].url
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0,
            "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert len(events) == 1, "the calls come whole, in the choice's last chunk"
    [choice] = events[0]["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["delta"]["role"] == "assistant"
    assert [tc["index"] for tc in choice["delta"]["tool_calls"]] == list(range(len(choice["delta"]["tool_calls"])))
    short = chat(url, tool_choice="required", max_tokens=3).json()["choices"][0]
    assert short["finish_reason"] == "length" and "tool_calls" not in short["message"]
    assert short["message"]["content"].startswith("[")


def test_history_with_a_call_and_its_answer_is_served(stack):
    called = {"id": "call_9", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [called]},
               {"role": "tool", "tool_call_id": "call_9", "content": "12:00"}]
    r = chat(stack["router"].url, messages=history, tool_choice="none", max_tokens=5)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] and "tool_calls" not in r.json()["choices"][0]["message"]


def test_auto_answers_text_and_the_calls_the_model_writes(stack):
    """The tiny model writes no calls by itself: a regex makes it write one in hermes' format (auto adds
    no constraint of its own, so the request may bring one)."""
    regex = r'On it\.<tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
    r = chat(stack["router"].url, structured_outputs={"regex": regex})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "On it."
    [c] = choice["message"]["tool_calls"]
    assert c["function"]["name"] == "get_time" and json.loads(c["function"]["arguments"])["zone"] in ("UTC", "CET")
    parts = list(stack["client"].chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, temperature=0, stream=True,
        extra_body={"structured_outputs": {"regex": regex}}))
    assert "".join(p.choices[0].delta.content or "" for p in parts) == "On it."
    [streamed] = parts[-1].choices[0].delta.tool_calls
    assert streamed.function.arguments == c["function"]["arguments"]
    assert parts[-1].choices[0].finish_reason == "tool_calls"
    text = chat(stack["router"].url, max_tokens=8).json()["choices"][0]  # no call written: text
    assert text["finish_reason"] == "length" and text["message"]["content"] and "tool_calls" not in text["message"]


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_date"}}}, "tool_choice.function.name"),
    ({"tool_choice": "none", "messages": [{"role": "tool", "content": "x", "tool_calls": []}]},
     "messages.0.tool_calls"),
    ({"tool_choice": "none", "messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
     "messages.0.tool_call_id"),
    ({"tool_choice": "none", "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
     "messages.0.tool_calls.0"),
])
def test_requests_that_cannot_be_honoured_are_400s_naming_the_field(stack, body, param):
    r = chat(stack["router"].url, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_auto_keeps_special_tokens_in_the_text_for_the_parser():
    """A model's own call markers may be special tokens: an auto request keeps them in its text (vLLM's
    hermes parser does the same); a named or required one has no markers to read."""
    from router.gateway.openai_types import ChatBody

    body = ChatBody(model="m", messages=ASK, tools=TOOLS)
    defaults = SamplingParams()
    assert body.to_request("r", [1], defaults, HERMES).skip_special_tokens is False
    assert body.to_request("r", [1], defaults, tool_calling(TOOLS, "required", None)).skip_special_tokens is True
    assert ChatBody(model="m", messages=ASK).to_request("r", [1], defaults).skip_special_tokens is True
