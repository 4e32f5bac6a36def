"""`tandem batch`: a file of requests in OpenAI's Batch format run through a real router, each answer
an output line as OpenAI writes them; a bad file refused before anything is sent, refusals for now
(429) retried, an interrupted run resumed without running anything twice."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from router.auth import ApiKeys, Limits
from router.batch import BatchFileError, BatchRequest, Client, main, read_requests, run
from router.config import RouterConfig
from router.security import RouterSecurity
from router.stack import free_port
from tests.conftest import hf_greedy
from tests.stack import running_stack, start_router, start_target

PROMPT = [7, 19, 33, 8, 90, 41, 12, 7, 66, 5, 3]


def line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def requests_file(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def answers(path: Path) -> dict[str, dict]:
    records = [json.loads(x) for x in path.read_text().splitlines()]
    by_id = {r["custom_id"]: r for r in records}
    assert len(by_id) == len(records), "each request answered once"
    return by_id


GOOD = [
    line("cmpl", "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                     "ignore_eos": True, "return_token_ids": True}),
    line("no-model", "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                                         "return_token_ids": True}),
    line("chat", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 4}),
    line("resp", "/v1/responses", {"model": "tiny", "input": "hello", "max_output_tokens": 4}),
    line("msg", "/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}),
    line("bad", "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": -1}),
]


# ---- the input file ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, message", [
    ("{not json", "not JSON"),
    (line("", "/v1/completions", {}), "custom_id must be"),
    (line("a", "/v1/embeddings", {}), "url must be one of"),
    (json.dumps({"custom_id": "b", "method": "GET", "url": "/v1/completions", "body": {}}), "method must be"),
    (line("c", "/v1/completions", {"prompt": "x", "stream": True}), "no stream"),
    (line("ok", "/v1/completions", {"prompt": "x"}), "used twice"),
])
def test_a_line_that_cannot_run_is_named_before_anything_is_sent(bad, message):
    lines = io.StringIO(line("ok", "/v1/completions", {"prompt": "x"}) + "\n\n" + bad + "\n")
    with pytest.raises(BatchFileError, match=message) as err:
        read_requests(Path("in.jsonl"), lines)
    assert str(err.value).startswith("in.jsonl:3: ")


def test_a_file_without_requests_is_refused():
    with pytest.raises(BatchFileError, match="no requests"):
        read_requests(Path("in.jsonl"), io.StringIO("\n"))


# ---- through a router ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def router(model_pair):
    with running_stack(model_pair, RouterConfig(max_num_batched_tokens=64, max_num_seqs=8)) as stack:
        yield stack["router"]


def test_every_request_gets_its_answer_line_as_openai_writes_them(router, model_pair, tmp_path):
    out = tmp_path / "out.jsonl"
    assert main(["--url", router.url, "-i", str(requests_file(tmp_path, GOOD)), "-o", str(out)]) == 0
    got = answers(out)
    assert set(got) == {"cmpl", "no-model", "chat", "resp", "msg", "bad"}
    for custom_id, record in got.items():
        assert record["id"].startswith("batch_req_") and record["error"] is None, custom_id
    want = hf_greedy(model_pair[0], PROMPT, 8)
    for custom_id in ("cmpl", "no-model"):  # the router's model filled in where the body names none
        response = got[custom_id]["response"]
        assert response["status_code"] == 200 and response["request_id"] == got[custom_id]["id"]
        assert response["body"]["id"] == f"cmpl-{got[custom_id]['id']}", "the router logs it by the line's id"
        assert response["body"]["choices"][0]["token_ids"] == want
    assert got["chat"]["response"]["body"]["object"] == "chat.completion"
    assert got["resp"]["response"]["body"]["object"] == "response"
    assert got["msg"]["response"]["body"]["type"] == "message"
    bad = got["bad"]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "temperature", "a 400 is a result"


def test_an_interrupted_run_resumes_with_the_requests_it_lacks(router, tmp_path):
    source = requests_file(tmp_path, GOOD)
    out = tmp_path / "out.jsonl"
    assert main(["--url", router.url, "-i", str(source), "-o", str(out)]) == 0
    first = out.read_text().splitlines()
    out.write_text("\n".join(first[:2]) + "\n" + first[2][:40])  # two answers, then a line cut short
    kept = {json.loads(x)["custom_id"]: x for x in first[:2]}
    assert main(["--url", router.url, "-i", str(source), "-o", str(out)]) == 2, "answers are never overwritten"
    assert main(["--url", router.url, "-i", str(source), "-o", str(out), "--resume"]) == 0
    got = answers(out)
    assert set(got) == {"cmpl", "no-model", "chat", "resp", "msg", "bad"}
    assert all(json.dumps(got[i]) == json.dumps(json.loads(kept[i])) for i in kept), "the earlier answers kept"
    assert main(["--url", router.url, "-i", str(source), "-o", str(out), "--resume"]) == 0
    assert len(out.read_text().splitlines()) == 6, "nothing left to run"


def test_refusals_for_now_are_retried_after_retry_after(model_pair, tmp_path):
    target, _ = start_target(model_pair[0])
    one_at_a_time = RouterSecurity(limits=Limits(max_concurrent=1))
    limited = start_router(RouterConfig(), target.address, None, model_pair[0], security=one_at_a_time)
    try:
        lines = [line(f"r{i}", "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True})
                 for i in range(4)]
        out = tmp_path / "out.jsonl"
        assert main(["--url", limited.url, "-i", str(requests_file(tmp_path, lines)), "-o", str(out),
                     "--concurrency", "4"]) == 0
        assert [r["response"]["status_code"] for r in answers(out).values()] == [200] * 4
        out.unlink()
        assert main(["--url", limited.url, "-i", str(requests_file(tmp_path, lines)), "-o", str(out),
                     "--concurrency", "4", "--max-retries", "0"]) == 0
        assert 429 in [r["response"]["status_code"] for r in answers(out).values()], "without retries: refused"
    finally:
        limited.stop(), target.stop()


def test_the_key_comes_from_the_flag_or_the_routers_own_variable(model_pair, tmp_path, monkeypatch):
    target, _ = start_target(model_pair[0])
    keyed = start_router(RouterConfig(), target.address, None, model_pair[0],
                         security=RouterSecurity(keys=ApiKeys(["batch-key-1", "batch-key-2"])))
    try:
        source, out = requests_file(tmp_path, GOOD[:1]), tmp_path / "out.jsonl"
        assert main(["--url", keyed.url, "-i", str(source), "-o", str(out)]) == 1, "no key: /v1/models refused"
        monkeypatch.setenv("TANDEM_API_KEY", "batch-key-2,batch-key-1")  # as the router reads it: a list
        assert main(["--url", keyed.url, "-i", str(source), "-o", str(out)]) == 0
        assert answers(out)["cmpl"]["response"]["status_code"] == 200
        out.unlink()
        monkeypatch.delenv("TANDEM_API_KEY")
        assert main(["--url", keyed.url, "-i", str(source), "-o", str(out), "--api-key", "batch-key-1"]) == 0
    finally:
        keyed.stop(), target.stop()


def test_a_request_that_never_gets_an_answer_says_why():
    out = io.StringIO()
    client = Client(f"http://127.0.0.1:{free_port()}", None, timeout_s=5, max_retries=1)
    counts = run(client, [BatchRequest("lost", "/v1/completions", {"prompt": "x"})], out, 2, "tiny", progress=False)
    [record] = [json.loads(x) for x in out.getvalue().splitlines()]
    assert record["response"] is None and record["error"]["code"] == "connection_error"
    assert counts["unanswered"] == 1


def test_tandem_batch_starts_a_stack_for_the_run(model_pair, tmp_path):
    out = tmp_path / "out.jsonl"
    done = subprocess.run([sys.executable, "-m", "common.cli", "batch", str(model_pair[0].parent), "-i",
                           str(requests_file(tmp_path, GOOD[:1])), "-o", str(out), "--served-model-name", "tiny"],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr
    assert answers(out)["cmpl"]["response"]["body"]["choices"][0]["token_ids"] == hf_greedy(model_pair[0], PROMPT, 8)
    assert "1 answered" in done.stderr
