"""X-Request-Id: the id a client (or its proxy) sends names its request in the answer's header and
id, as vLLM takes it; without one (or with one that could forge a log line) the router makes one. Every
response carries it, a refusal by the API-key guard and a streamed answer included."""

from __future__ import annotations

import httpx
import openai
import pytest

from router.auth import ApiKeys
from router.config import RouterConfig
from router.security import RouterSecurity
from tests.stack import start_router, start_target

KEY = "ids-key-3b1e"


@pytest.fixture(scope="module")
def router(model_pair):
    target, _ = start_target(model_pair[0])
    router = start_router(RouterConfig(), target.address, None, model_pair[0],
                          security=RouterSecurity(keys=ApiKeys([KEY])))
    yield router
    router.stop(), target.stop()


def post(router, path: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(f"{router.url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}", **headers},
                      timeout=60)


COMPLETION = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3}


def test_a_request_id_sent_is_the_answers_header_and_the_base_of_its_id(router):
    r = post(router, "/v1/completions", COMPLETION, **{"X-Request-Id": "trace-42.a"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42.a"
    assert r.json()["id"] == "cmpl-trace-42.a"
    chat = post(router, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2}, **{"X-Request-Id": "chat-7"})
    assert chat.headers["x-request-id"] == "chat-7" and chat.json()["id"] == "chatcmpl-chat-7"


def test_without_one_or_with_an_unsafe_one_the_router_makes_one(router):
    plain = post(router, "/v1/completions", COMPLETION)
    made = plain.headers["x-request-id"]
    assert len(made) == 32 and plain.json()["id"] == f"cmpl-{made}"
    for unsafe in ("a b", "x" * 129, "line\tbreak", "a;b", "\"quoted\""):
        r = post(router, "/v1/completions", COMPLETION, **{"X-Request-Id": unsafe})
        assert r.status_code == 200 and r.headers["x-request-id"] != unsafe
        assert r.json()["id"] == f"cmpl-{r.headers['x-request-id']}"
    assert post(router, "/v1/completions", COMPLETION).headers["x-request-id"] != made, "one per request"


def test_refusals_and_streams_carry_it_and_the_openai_client_reads_it(router):
    refused = httpx.post(f"{router.url}/v1/completions", json=COMPLETION, headers={"X-Request-Id": "no-key-1"})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "no-key-1"
    bad = post(router, "/v1/completions", COMPLETION | {"temperature": -1}, **{"X-Request-Id": "bad-1"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "bad-1"
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=KEY)
    with client.completions.with_streaming_response.create(model="tiny", prompt=[5, 6], max_tokens=3, stream=True,
                                                           extra_headers={"X-Request-Id": "stream-9"}) as r:
        assert r.headers["x-request-id"] == "stream-9"
        assert all(chunk.id == "cmpl-stream-9" for chunk in r.parse())
    answer = client.completions.create(model="tiny", prompt=[5, 6], max_tokens=2)
    assert answer._request_id and answer.id == f"cmpl-{answer._request_id}"
