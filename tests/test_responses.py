"""OpenAI's Responses API (/v1/responses) through the whole stack, read by the official openai client
(whose types and stream accumulator check every item and event):

- a text answer is the chat answer to the same conversation (instructions as the system message),
  token for token; streamed, the events add up to it; cut by max_output_tokens it is "incomplete"
  (response.incomplete), ended by itself "completed"
- tools: a named or required call comes back as function_call items; a function_call and its
  function_call_output sent back as input continue the conversation; text.format constrains the text
- the history's items become the chat messages they mean
- what Tandem does not do (conversation objects, built-in tools, an unstored background response) is a 400 naming it
  (stored responses and previous_response_id: tests/test_responses_store.py)
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI

from router.config import RouterConfig
from router.core import RequestError
from router.gateway.responses_body import ResponsesBody
from tests.stack import running_stack

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "name": "weather", "description": "Weather in a city", "parameters": CITY}]


def test_input_items_become_the_chat_messages_they_mean():
    body = ResponsesBody(model="m", instructions="Be brief.", input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "a tool"}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city": "Bergen"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "sun"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Rain, then sun."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Thanks"}]}], tools=TOOLS, tool_choice="none")
    chat = body.chat()
    messages = chat.conversation()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "assistant", "user"]
    assert messages[2]["reasoning_content"] == "a tool" and messages[2]["content"] == ""
    assert [c["function"]["arguments"] for c in messages[2]["tool_calls"]] == [{"city": "Oslo"}, {"city": "Bergen"}]
    assert [m.get("tool_call_id") for m in messages[3:5]] == ["c1", "c2"] and messages[4]["content"] == "sun"
    assert chat.tools == [{"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                                            "parameters": CITY}}]


@pytest.mark.parametrize("fields,field", [
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"background": True, "store": False}, "background"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
])
def test_what_tandem_does_not_do_names_its_field(fields, field):
    with pytest.raises(RequestError) as err:
        ResponsesBody(**{"model": "m", "input": "hi", **fields}).chat()
    assert err.value.field == field


@pytest.fixture(scope="module")
def stack(model_pair):
    config = RouterConfig(max_num_batched_tokens=128, max_num_seqs=16, draft_timeout_s=5.0, target_grace_s=2.0)
    with running_stack(model_pair, config) as s:
        s["client"] = OpenAI(base_url=f"{s['router'].url}/v1", api_key="unused", max_retries=0)
        yield s


def test_a_text_answer_is_the_chat_answer_and_streams_to_it(stack):
    client, url = stack["client"], stack["router"].url
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "temperature": 0, "max_tokens": 20, "ignore_eos": True, "return_token_ids": True,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]}).json()
    want = chat["choices"][0]["message"]["content"]
    out = client.responses.create(model="tiny", instructions="Be brief.", input="Hello there", temperature=0,
                                  max_output_tokens=20, extra_body={"ignore_eos": True})
    assert out.output_text == want
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.input_tokens == chat["usage"]["prompt_tokens"] and out.usage.output_tokens == 20
    with client.responses.stream(model="tiny", instructions="Be brief.", input="Hello there", temperature=0,
                                 max_output_tokens=20, extra_body={"ignore_eos": True}) as s:
        events = list(s)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert events[-1].response.output_text == want  # (the client keeps a final response for "completed" only)
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_calls_come_back_as_function_call_items_and_their_outputs_continue(stack):
    client = stack["client"]
    named = client.responses.create(model="tiny", input="Weather in Oslo?", tools=TOOLS, temperature=0,
                                    tool_choice={"type": "function", "name": "weather"})
    [call] = named.output
    assert call.type == "function_call" and call.name == "weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), CITY)
    with client.responses.stream(model="tiny", input="Weather in Oslo?", tools=TOOLS, temperature=0,
                                 tool_choice="required", parallel_tool_calls=False) as s:
        events = list(s)
        final = s.get_final_response()
    [streamed] = final.output
    assert streamed.type == "function_call" and streamed.arguments == call.arguments  # greedy: the same call
    with client.responses.stream(model="tiny", input="Weather in Oslo?", tools=TOOLS, temperature=0,
                                 tool_choice={"type": "function", "name": "weather"}) as s:
        pieces = [e.delta for e in s if e.type == "response.function_call_arguments.delta"]
        [named_streamed] = s.get_final_response().output
    assert len(pieces) > 1 and "".join(pieces) == named_streamed.arguments == call.arguments  # as they come
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    follow = client.responses.create(model="tiny", temperature=0, max_output_tokens=8, tools=TOOLS, tool_choice="none",
                                     input=[{"role": "user", "content": "Weather in Oslo?"},
                                            {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                             "arguments": call.arguments},
                                            {"type": "function_call_output", "call_id": call.call_id,
                                             "output": "rain"}])
    assert follow.status == "incomplete" and follow.output[0].type == "message" and follow.output_text
    shaped = client.responses.create(model="tiny", input="A city, please", temperature=0, text={"format": {
        "type": "json_schema", "name": "city", "schema": CITY}})
    jsonschema.validate(json.loads(shaped.output_text), CITY)
    assert shaped.status == "completed" and named.status == "completed"


def test_refusals_are_openai_errors(stack):
    r = httpx.post(f"{stack['router'].url}/v1/responses", json={"model": "tiny", "input": "hi",
                                                                "previous_response_id": "resp_1"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    r = httpx.post(f"{stack['router'].url}/v1/responses", json={"model": "tiny", "input": "hi", "modalities": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "modalities"


def test_reasoning_then_text_is_two_items_in_openais_event_shapes():
    """A reasoning model's answer (router.gateway.reasoning) streamed as Responses events: each one parses as
    the openai client's event type, the items are a reasoning item then a message."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    from common.sampling import SamplingParams
    from router.core import Delta, FinishReason, Request
    from router.gateway.openai_format import ChatFormat
    from router.gateway.reasoning import Reasoning
    from router.gateway.responses_format import ResponsesFormat

    req = Request(request_id="r", prompt_ids=[1, 2], sampling=SamplingParams(), max_tokens=50)
    body = ResponsesBody(model="m", input="Why?")
    pieces = ["The sky", " scatters blue</th", "ink>\n\nRayleigh", " scattering."]
    deltas = [Delta([i], p, completion_tokens=i + 1, prompt_tokens=2) for i, p in enumerate(pieces)]
    deltas[-1].finish_reason = FinishReason.STOP
    fmt = ResponsesFormat(ChatFormat(lambda ids: "", "m", req, False, reasoning=Reasoning.named("deepseek_r1")),
                          body, "m")
    raw = fmt.opening() + [e for d in deltas for e in fmt.events(d)] + fmt.closing(deltas, False)
    adapter = TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_python(json.loads(e.split("data: ", 1)[1])) for e in raw]
    assert [e.type for e in events if e.type.endswith(".added")] == [
        "response.output_item.added", "response.content_part.added"] * 2
    final = Response.model_validate(events[-1].response.model_dump())
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "The sky scatters blue"
    assert final.output_text == "\n\nRayleigh scattering."
    whole = ResponsesFormat(ChatFormat(lambda ids: "", "m", req, False, reasoning=Reasoning.named("deepseek_r1")),
                            body, "m").whole(deltas)
    assert [i["type"] for i in whole["output"]] == ["reasoning", "message"] and whole["usage"]["output_tokens"] == 4


def test_top_logprobs_are_the_chat_answers(stack):
    client, url = stack["client"], stack["router"].url
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "temperature": 0, "max_tokens": 6, "logprobs": True, "top_logprobs": 2,
        "messages": [{"role": "user", "content": "Hi"}]}).json()["choices"][0]["logprobs"]["content"]
    out = client.responses.create(model="tiny", input="Hi", temperature=0, max_output_tokens=6, top_logprobs=2)
    got = out.output[0].content[0].logprobs
    # the same tokens; their logprobs equal up to fp32 rounding (this request attaches the prompt blocks the
    # chat request cached, so its tail is computed in products of another shape)
    assert [(t.token, [a.token for a in t.top_logprobs]) for t in got] == \
        [(c["token"], [a["token"] for a in c["top_logprobs"]]) for c in chat]
    assert [lp for t in got for lp in (t.logprob, *(a.logprob for a in t.top_logprobs))] == pytest.approx(
        [lp for c in chat for lp in (c["logprob"], *(a["logprob"] for a in c["top_logprobs"]))], abs=1e-4)
    assert all(bytes(t.bytes).decode() == t.token for t in got)
    with client.responses.stream(model="tiny", input="Hi", temperature=0, max_output_tokens=6, top_logprobs=2) as s:
        events = list(s)
    streamed = [lp.logprob for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert streamed == pytest.approx([c["logprob"] for c in chat], abs=1e-4)
    assert [lp.logprob for lp in events[-1].response.output[0].content[0].logprobs] == streamed
