"""Stored responses (OpenAI's Responses API `store`, its default), read by the official openai client:

- a response continued with previous_response_id is the chat answer to the whole conversation (the
  stored turns' input and output, then the new input; the earlier instructions not carried over),
  token for token, streamed or not
- a stored response reads back (retrieve), lists the items it answered (input_items), and is
  forgotten (delete); store false keeps nothing; a turn whose ancestor is gone is a 404 naming it
- the store keeps the most recent --max-stored-responses and none at 0
- a background response is queued at once and read back as its answer when done; cancelled, it stops
  and frees its KV; it is always stored and cannot be continued while it runs; streamed, a client that
  went away follows its events again from where it left
- with API keys, a stored response is its key's: another key finds nothing by any route
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from openai import OpenAI

from router.auth import ApiKeys
from router.config import RouterConfig
from router.gateway.responses_store import ResponseNotFound, ResponseStore
from router.security import RouterSecurity
from tests.stack import running_stack, start_router, start_target, wait_until

SAMPLING = {"temperature": 0, "max_output_tokens": 12, "extra_body": {"ignore_eos": True}}


def _response(rid: str, text: str) -> dict:
    return {"id": rid, "output": [{"type": "message", "role": "assistant", "content": [
        {"type": "output_text", "text": text}]}]}


def test_the_store_chains_turns_and_forgets_the_oldest():
    store = ResponseStore(capacity=3)
    store.put(_response("r1", "a1"), [{"role": "user", "content": "q1"}], None)
    store.put(_response("r2", "a2"), [{"role": "user", "content": "q2"}], "r1")
    assert [i.get("content") for i in store.history("r2")][::2] == ["q1", "q2"]
    assert [i["content"] for i in store.input_items("r2")[:1]] == ["q1"] and len(store.input_items("r2")) == 3
    store.put(_response("r3", "a3"), [], "r2")
    store.put(_response("r4", "a4"), [], "r3")  # r1 goes
    with pytest.raises(ResponseNotFound, match="'r3'.*continues 'r1', which is no longer stored"):
        store.history("r3")
    assert store.get("r4")["id"] == "r4"
    store.delete("r4")
    with pytest.raises(ResponseNotFound):
        store.get("r4")
    nothing = ResponseStore(capacity=0)
    nothing.put(_response("r1", "a1"), [], None)
    with pytest.raises(ResponseNotFound, match="--max-stored-responses 0"):
        nothing.history("r1")


@pytest.fixture(scope="module")
def stack(model_pair):
    config = RouterConfig(max_num_batched_tokens=128, max_num_seqs=16, draft_timeout_s=5.0, target_grace_s=2.0)
    with running_stack(model_pair, config) as s:
        s["client"] = OpenAI(base_url=f"{s['router'].url}/v1", api_key="unused", max_retries=0)
        yield s


def _chat(url: str, messages: list[dict]) -> str:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "temperature": 0, "max_tokens": 12, "ignore_eos": True, "messages": messages})
    return r.json()["choices"][0]["message"]["content"]


def test_a_continued_response_answers_the_whole_conversation(stack):
    client, url = stack["client"], stack["router"].url
    first = client.responses.create(model="tiny", instructions="Be brief.", input="My name is Ada", **SAMPLING)
    assert first.store and first.previous_response_id is None
    second = client.responses.create(model="tiny", input="What is my name?", previous_response_id=first.id,
                                     **SAMPLING)
    turns = [{"role": "user", "content": "My name is Ada"}, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "What is my name?"}]
    assert second.output_text == _chat(url, turns), "the history, not the first turn's instructions"
    assert second.previous_response_id == first.id
    with client.responses.stream(model="tiny", input=[{"role": "user", "content": "And yours?"}],
                                 previous_response_id=second.id, **SAMPLING) as s:
        events = list(s)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    want = _chat(url, [*turns, {"role": "assistant", "content": second.output_text},
                       {"role": "user", "content": "And yours?"}])
    assert "".join(deltas) == want
    streamed = stack["client"].responses.retrieve(events[0].response.id)  # stored when the stream ended
    assert streamed.output_text == want and streamed.previous_response_id == second.id
    listed = client.responses.input_items.list(second.id)
    assert [getattr(i, "role", None) for i in listed.data] == ["user", "assistant", "user"]


def test_stored_responses_read_back_list_and_are_deleted(stack):
    client = stack["client"]
    kept = client.responses.create(model="tiny", input="Hello", **SAMPLING)
    again = client.responses.retrieve(kept.id)
    assert again.id == kept.id and again.output_text == kept.output_text and again.status == kept.status
    follow = client.responses.create(model="tiny", input="More", previous_response_id=kept.id, **SAMPLING)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    r = httpx.post(f"{stack['router'].url}/v1/responses", json={
        "model": "tiny", "input": "Still?", "previous_response_id": follow.id})
    assert r.status_code == 404 and kept.id in r.json()["error"]["message"], r.text
    unkept = client.responses.create(model="tiny", input="Hello", store=False, **SAMPLING)
    assert not unkept.store
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_nothing")


def _settled(client: OpenAI, response_id: str, timeout: float = 60.0):  # noqa: ANN202
    deadline = time.monotonic() + timeout
    while (r := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"still {r.status} after {timeout:.0f}s"
        time.sleep(0.05)
    return r


def test_a_background_response_is_queued_at_once_and_read_back_as_its_answer(stack):
    client = stack["client"]
    queued = client.responses.create(model="tiny", input="Hello there", background=True, **SAMPLING)
    assert queued.background and queued.status == "queued" and queued.output == []
    done = _settled(client, queued.id)
    foreground = client.responses.create(model="tiny", input="Hello there", **SAMPLING)
    assert done.status == foreground.status == "incomplete" and done.output_text == foreground.output_text
    assert done.usage.output_tokens == 12 and done.background and not foreground.background
    follow = client.responses.create(model="tiny", input="More", previous_response_id=queued.id, **SAMPLING)
    assert follow.previous_response_id == queued.id, "a finished background response continues as any other"


def test_a_background_response_cancelled_stops_and_frees_its_kv(stack):
    client, url, engine = stack["client"], stack["router"].url, stack["router"].server.engine
    long = {"temperature": 0, "max_output_tokens": 400, "extra_body": {"ignore_eos": True}}
    running = client.responses.create(model="tiny", input="Tell me everything", background=True, **long)
    assert "\ntandem:background_responses_running 1.0" in httpx.get(f"{url}/metrics").text
    r = httpx.post(f"{url}/v1/responses", json={"model": "tiny", "input": "Next", "previous_response_id": running.id})
    assert r.status_code == 400 and "still in progress" in r.json()["error"]["message"], r.text
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(running.id).status == "cancelled"
    assert client.responses.cancel(running.id).status == "cancelled", "cancelled again: answered as it is"
    assert wait_until(lambda: not engine._seqs, timeout=1), "its sequence aborted at once"
    assert wait_until(lambda: stack["target"].blocks.num_sequences == 0, timeout=10), "its KV freed"
    failing = client.responses.create(model="tiny", input="Tell me more", background=True, **long)
    stack["router"].loop.call_soon_threadsafe(engine.abort_all)  # as a drain that ran out does
    failed = _settled(client, failing.id)
    assert failed.status == "failed" and "shutting down" in failed.error.message
    finished = client.responses.create(model="tiny", input="Hi", **SAMPLING)
    with pytest.raises(openai.BadRequestError, match="only a background response"):
        client.responses.cancel(finished.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nothing")
    r = httpx.post(f"{url}/v1/responses", json={"model": "tiny", "input": "x", "background": True, "store": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "background", r.text
    r = httpx.get(f"{url}/v1/responses/{finished.id}", params={"stream": "true"})
    assert r.status_code == 400 and "GET it without stream" in r.json()["error"]["message"], r.text


def test_a_streamed_background_response_is_followed_again_after_the_client_went_away(stack):
    client = stack["client"]
    want = client.responses.create(model="tiny", input="Count with me", **SAMPLING).output_text
    first, seen = client.responses.create(model="tiny", input="Count with me", background=True, stream=True,
                                          **SAMPLING), []
    for event in first:  # the client reads a few events, then goes away
        seen.append(event)
        if event.type == "response.output_text.delta":
            break
    first.close()
    response_id, last = seen[0].response.id, seen[-1].sequence_number
    again = list(client.responses.retrieve(response_id, stream=True, starting_after=last))
    events = seen + again
    assert [e.sequence_number for e in events] == list(range(len(events))), "none lost, none twice"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert events[-1].type == "response.incomplete" and _settled(client, response_id).output_text == want
    replay = list(client.responses.retrieve(response_id, stream=True))
    assert [e.sequence_number for e in replay] == list(range(len(events))), "finished: followed from the start"


# ---- with API keys, a stored response is its key's --------------------------------------------------
ALICE, BOB = "alice-store-key-1", "bob-store-key-2"


def test_another_keys_stored_response_is_not_found_by_any_route(model_pair):
    target, _ = start_target(model_pair[0])
    router = start_router(RouterConfig(), target.address, None, model_pair[0],
                          security=RouterSecurity(keys=ApiKeys([ALICE, BOB])))
    try:
        alice, bob = (OpenAI(base_url=f"{router.url}/v1", api_key=k, max_retries=0) for k in (ALICE, BOB))
        first = alice.responses.create(model="tiny", input="hello", **SAMPLING)
        running = alice.responses.create(model="tiny", input="more", background=True, temperature=0,
                                         max_output_tokens=400, extra_body={"ignore_eos": True})
        calls = (lambda r: bob.responses.retrieve(r), lambda r: bob.responses.input_items.list(r),
                 lambda r: bob.responses.delete(r), lambda r: bob.responses.cancel(r),
                 lambda r: bob.responses.create(model="tiny", input="go on", previous_response_id=r, **SAMPLING))
        for rid in (first.id, running.id):
            for call in calls:
                with pytest.raises(openai.NotFoundError, match="no stored response"):
                    call(rid)
        with pytest.raises(openai.BadRequestError):  # not another's: a streamed follow of a non-streamed one
            alice.responses.retrieve(first.id, stream=True)
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(first.id, stream=True)
        assert alice.responses.retrieve(first.id).output_text == first.output_text, "its own key reads it"
        assert alice.responses.cancel(running.id).status == "cancelled"
        assert alice.responses.create(model="tiny", input="go on", previous_response_id=first.id, **SAMPLING).id
        alice.responses.delete(first.id)
    finally:
        router.stop(), target.stop()
