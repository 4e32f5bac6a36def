"""Anthropic's Messages API (/v1/messages) through the whole stack, read by the official anthropic client
(whose types and stream accumulator check every block and event):

- a text answer is the chat answer to the same conversation (system as the system message), token for
  token; streamed, the events add up to it; stop_reason says what ended it (max_tokens, the stop
  sequence that matched, end of turn), usage splits the prompt into computed and prefix-cached tokens
- tools: a forced or "any" call comes back as a tool_use block whose input follows the tool's
  input_schema (stop_reason tool_use), streamed as input_json_delta; its tool_result continues the
  conversation; a final assistant message is a prefill the answer writes on from
- the content blocks become the chat messages they mean; what Tandem does not do is a 400 naming it,
  in Anthropic's error shape
- /v1/messages/count_tokens counts what /v1/messages would encode
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from anthropic import Anthropic, BadRequestError, NotFoundError

from router.config import RouterConfig
from router.core import RequestError
from router.gateway.messages_body import MessagesBody
from tests.stack import running_stack

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"name": "weather", "description": "Weather in a city", "input_schema": CITY}]
HELLO = [{"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0}  # (the anthropic client 2.x has no temperature argument)


def test_content_blocks_become_the_chat_messages_they_mean():
    body = MessagesBody(model="m", max_tokens=5, system=[{"type": "text", "text": "Be brief."}], tools=TOOLS,
                        tool_choice={"type": "none"}, messages=[
        {"role": "user", "content": "Weather in Oslo and Bergen?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "two calls", "signature": "x"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}},
            {"type": "tool_use", "id": "t2", "name": "weather", "input": {"city": "Bergen"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "rain"},
            {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "sun"}],
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Thanks"}]}])
    chat = body.chat()
    messages = chat.conversation()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert messages[0]["content"] == "Be brief."
    assert messages[2]["reasoning_content"] == "two calls" and messages[2]["content"] == "Checking."
    assert [c["function"]["arguments"] for c in messages[2]["tool_calls"]] == [{"city": "Oslo"}, {"city": "Bergen"}]
    assert [(m["tool_call_id"], m["content"]) for m in messages[3:5]] == [("t1", "rain"), ("t2", "sun")]
    assert messages[5]["content"] == "Thanks"
    assert chat.tools == [{"type": "function", "function": {"name": "weather", "parameters": CITY,
                                                            "description": "Weather in a city"}}]
    assert chat.tool_choice == "none" and chat.max_tokens == 5
    forced = MessagesBody(model="m", max_tokens=5, messages=HELLO, tools=TOOLS,
                          tool_choice={"type": "tool", "name": "weather", "disable_parallel_tool_use": True}).chat()
    assert forced.tool_choice == {"type": "function", "function": {"name": "weather"}}
    assert forced.parallel_tool_calls is False
    assert MessagesBody(model="m", max_tokens=5, messages=HELLO, tools=TOOLS,
                        tool_choice={"type": "any"}).chat().tool_choice == "required"
    prefill = MessagesBody(model="m", max_tokens=5, messages=[*HELLO, {"role": "assistant", "content": "{"}]).chat()
    assert prefill.continue_final_message and not prefill.add_generation_prompt


@pytest.mark.parametrize("fields,field", [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"output_config": {"format": {"type": "xml"}}}, "output_config.format.type"),
    ({"tools": TOOLS}, "tool_choice"),  # "auto" without the router's --tool-call-parser
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages.0.content.0.tool_use_id"),
])
def test_what_tandem_does_not_do_names_its_field(fields, field):
    with pytest.raises(RequestError) as err:  # as the router reads it: the chat request, its tool choice checked
        MessagesBody(**{"model": "m", "max_tokens": 5, "messages": HELLO, **fields}).chat().tool_calling(None)
    assert err.value.field == field
    if field == "tool_choice":
        assert '{"type": "any"}' in str(err.value), "the alternatives in this API's own terms"
        assert MessagesBody(model="m", max_tokens=5, messages=HELLO, tools=TOOLS).chat().tool_calling("hermes")


@pytest.fixture(scope="module")
def stack(model_pair):
    config = RouterConfig(max_num_batched_tokens=128, max_num_seqs=16, draft_timeout_s=5.0, target_grace_s=2.0)
    with running_stack(model_pair, config) as s:
        s["client"] = Anthropic(base_url=s["router"].url, api_key="unused", max_retries=0)
        yield s


def chat(url: str, **body) -> dict:  # noqa: ANN003
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={"model": "tiny", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_text_answer_is_the_chat_answer_and_streams_to_it(stack):
    client, url = stack["client"], stack["router"].url
    want = chat(url, max_tokens=20, ignore_eos=True, messages=[{"role": "system", "content": "Be brief."}, *HELLO])
    text = want["choices"][0]["message"]["content"]
    out = client.messages.create(model="tiny", system="Be brief.", messages=HELLO, max_tokens=20,
                                 extra_body={**GREEDY, "ignore_eos": True})
    assert [b.type for b in out.content] == ["text"] and out.content[0].text == text
    assert out.stop_reason == "max_tokens" and out.stop_sequence is None and out.usage.output_tokens == 20
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == want["usage"]["prompt_tokens"]
    assert out.id.startswith("msg_") and out.role == "assistant" and out.model == "tiny"
    with client.messages.stream(model="tiny", system="Be brief.", messages=HELLO, max_tokens=20,
                                 extra_body={**GREEDY, "ignore_eos": True}) as s:
        events = list(s)
        final = s.get_final_message()
    kinds = [e.type for e in events if e.type not in ("text",)]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text
    assert final.content[0].text == text and final.stop_reason == "max_tokens" and final.usage.output_tokens == 20
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == want["usage"]["prompt_tokens"]


def test_stop_reason_names_the_stop_sequence_that_matched(stack):
    client, url = stack["client"], stack["router"].url
    text = chat(url, max_tokens=30, ignore_eos=True, messages=HELLO)["choices"][0]["message"]["content"]
    stop = text[len(text) // 2:][:3]
    assert stop.strip(), text
    out = client.messages.create(model="tiny", messages=HELLO, max_tokens=30, extra_body=GREEDY, stop_sequences=[stop])
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert out.content[0].text == text[:text.index(stop)]
    with client.messages.stream(model="tiny", messages=HELLO, max_tokens=30, extra_body=GREEDY,
                                stop_sequences=["\u2603never", stop]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    # the same on the OpenAI doors: vLLM's stop_reason
    cut = chat(url, max_tokens=30, ignore_eos=True, messages=HELLO, stop=[stop])["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop


def test_a_tool_use_block_follows_the_schema_and_its_result_continues(stack):
    client = stack["client"]
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    forced = client.messages.create(model="tiny", messages=ask, tools=TOOLS, max_tokens=60, extra_body=GREEDY,
                                    tool_choice={"type": "tool", "name": "weather"})
    [use] = forced.content
    assert use.type == "tool_use" and use.name == "weather" and forced.stop_reason == "tool_use"
    jsonschema.validate(use.input, CITY)
    with client.messages.stream(model="tiny", messages=ask, tools=TOOLS, max_tokens=60, extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "weather"}) as s:
        pieces = [e.delta.partial_json for e in s if e.type == "content_block_delta"]
        streamed = s.get_final_message()
    assert len(pieces) > 1 and json.loads("".join(pieces)) == use.input  # the arguments as they come
    assert streamed.content[0].input == use.input and streamed.stop_reason == "tool_use"
    with client.messages.stream(model="tiny", messages=ask, tools=TOOLS, max_tokens=60, extra_body=GREEDY,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}) as s:
        anyone = s.get_final_message()
    assert [b.type for b in anyone.content] == ["tool_use"] and anyone.stop_reason == "tool_use"
    jsonschema.validate(anyone.content[0].input, CITY)
    follow = client.messages.create(model="tiny", max_tokens=6, extra_body=GREEDY, tools=TOOLS,
                                    tool_choice={"type": "none"}, messages=[
        *ask, {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "rain"}]}])
    assert follow.content[0].type == "text" and follow.content[0].text and follow.stop_reason == "max_tokens"
    shaped = client.messages.create(model="tiny", messages=[{"role": "user", "content": "A city"}], max_tokens=60,
                                    extra_body=GREEDY,
                                    output_config={"format": {"type": "json_schema", "schema": CITY}})
    jsonschema.validate(json.loads(shaped.content[0].text), CITY)


def test_a_final_assistant_message_is_a_prefill(stack):
    client, url = stack["client"], stack["router"].url
    whole = chat(url, max_tokens=12, ignore_eos=True, messages=HELLO)["choices"][0]["message"]["content"]
    head = whole[:5]
    out = client.messages.create(model="tiny", max_tokens=6, extra_body={**GREEDY, "ignore_eos": True},
                                 messages=[*HELLO, {"role": "assistant", "content": head}])
    want = chat(url, max_tokens=6, ignore_eos=True, add_generation_prompt=False, continue_final_message=True,
                messages=[*HELLO, {"role": "assistant", "content": head}])["choices"][0]["message"]["content"]
    assert out.content[0].text == want


def test_refusals_are_anthropic_errors(stack):
    client, url = stack["client"], stack["router"].url
    with pytest.raises(NotFoundError) as err:
        client.messages.create(model="gpt-9", max_tokens=3, messages=HELLO)
    assert err.value.body["error"]["type"] == "not_found_error" and "gpt-9" in err.value.body["error"]["message"]
    with pytest.raises(BadRequestError) as err:
        client.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x"}}]}])
    assert err.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                         "message": err.value.body["error"]["message"]}}
    assert "messages.0.content.0.type" in err.value.body["error"]["message"]
    r = httpx.post(f"{url}/v1/messages", json={"model": "tiny", "max_tokens": 3, "messages": HELLO, "container": "c"})
    assert r.status_code == 400 and "container" in r.json()["error"]["message"]


def test_count_tokens_counts_what_messages_would_encode(stack):
    client, url = stack["client"], stack["router"].url
    counted = client.messages.count_tokens(model="tiny", system="Be brief.", messages=HELLO)
    want = chat(url, max_tokens=1, messages=[{"role": "system", "content": "Be brief."}, *HELLO])
    assert counted.input_tokens == want["usage"]["prompt_tokens"]


def test_thinking_then_text_is_two_blocks_in_anthropics_event_shapes():
    """A reasoning model's answer (router.gateway.reasoning) streamed as Messages events: each one parses as
    the anthropic client's event type and its accumulator builds a thinking block then a text block."""
    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import Message, RawMessageStreamEvent
    from pydantic import TypeAdapter

    from common.sampling import SamplingParams
    from router.core import Delta, FinishReason, Request
    from router.gateway.messages_format import MessagesFormat
    from router.gateway.openai_format import ChatFormat
    from router.gateway.reasoning import Reasoning

    req = Request(request_id="r", prompt_ids=[1, 2], sampling=SamplingParams(), max_tokens=50)
    body = MessagesBody(model="m", max_tokens=50, messages=[{"role": "user", "content": "Why?"}])
    pieces = ["The sky", " scatters blue</th", "ink>\n\nRayleigh", " scattering."]
    deltas = [Delta([i], p, completion_tokens=i + 1, prompt_tokens=2) for i, p in enumerate(pieces)]
    deltas[-1].finish_reason = FinishReason.STOP

    def fmt() -> MessagesFormat:
        return MessagesFormat(ChatFormat(lambda ids: "", "m", req, False, reasoning=Reasoning.named("deepseek_r1")),
                              body, "m")

    streamed = fmt()
    raw = streamed.opening() + [e for d in deltas for e in streamed.events(d)] + streamed.closing(deltas, False)
    adapter = TypeAdapter(RawMessageStreamEvent)
    events = [adapter.validate_python(json.loads(e.split("data: ", 1)[1])) for e in raw]
    assert [e.split("\n", 1)[0] for e in raw] == [f"event: {e.type}" for e in events]
    snapshot, bufs = None, {}
    for e in events:
        snapshot = accumulate_event(event=e, current_snapshot=snapshot, json_bufs=bufs)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in snapshot.content] == [
        ("thinking", "The sky scatters blue"), ("text", "\n\nRayleigh scattering.")]
    assert snapshot.stop_reason == "end_turn" and snapshot.usage.output_tokens == 4
    whole = Message.model_validate(fmt().whole(deltas))
    assert [b.model_dump(exclude_none=True) for b in whole.content] == \
        [b.model_dump(exclude_none=True, exclude={"parsed_output"}) for b in snapshot.content]
    assert (whole.stop_reason, whole.usage) == (snapshot.stop_reason, snapshot.usage)
