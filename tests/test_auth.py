"""API keys and per-key limits (router.auth), their flags (router.security), and the reload of
rotated files (common.reload): unit level, plus the limits on a real router's two doors."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from common.reload import reload_all
from common.tls import Certificates, TLSError
from router.__main__ import build_parser
from router.auth import ApiKeys, Guard, HTTPGuard, Limits
from router.config import RouterConfig
from router.security import security_from_args
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.certs import CA
from tests.stack import start_router, start_target

KEY, OTHER = "key-one-7f3a", "key-two-c41d"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def bearer(key: str) -> str:
    return f"Bearer {key}"


# ---- keys ----------------------------------------------------------------------------------------
def test_keys_are_checked_by_digest_and_the_scheme_is_bearer():
    guard = Guard(ApiKeys([KEY, OTHER]), Limits())
    assert guard.admit(bearer(KEY)).ok and guard.admit(bearer(OTHER)).ok
    assert guard.admit(f"bearer  {KEY} ").ok  # scheme case and surrounding blanks do not matter
    for header, message in ((None, "missing"), ("", "missing"), (bearer("key-one"), "invalid"),
                            (bearer(KEY + "x"), "invalid"), (f"Basic {KEY}", "invalid"), (KEY, "invalid")):
        refused = guard.admit(header)
        assert refused.status == 401 and message in refused.message and KEY not in refused.message


def test_key_file_is_reread_when_it_changes(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"# team A\n{KEY}\n\n")
    keys = ApiKeys(file=path, poll_s=0)
    assert keys.identify(KEY) and not keys.identify(OTHER)
    path.write_text(f"{OTHER}\n")
    assert keys.identify(OTHER) and not keys.identify(KEY)
    path.write_text("")  # emptied by mistake: the current keys stay, the API does not fall open
    assert keys.identify(OTHER)


def test_an_empty_or_missing_key_file_refuses_to_start(tmp_path):
    (tmp_path / "empty").write_text("# nothing\n")
    for path in (tmp_path / "empty", tmp_path / "absent"):
        with pytest.raises(ValueError, match="api-key-file"):
            ApiKeys(file=path)


def test_keys_are_masked_in_help_and_come_from_the_environment(tmp_path):
    env = {"TANDEM_API_KEY": f"{KEY},{OTHER}"}
    out = subprocess.run([sys.executable, "-m", "router", "--help"], capture_output=True, text=True,
                         env={**os.environ, **env})
    assert out.returncode == 0 and "TANDEM_API_KEY" in out.stdout
    assert KEY not in out.stdout and "***" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "router", "--api-key", KEY, "--no-such-flag"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and KEY not in bad.stderr
    from common.cli import env_settable

    args = env_settable(build_parser(), env).parse_args(["--target", "t:1", "--tokenizer", "tok"])
    assert args.api_key == [KEY, OTHER] and repr(args.api_key) == "['***', '***']"
    security = security_from_args(args)
    assert len(security.keys) == 2 and security.guard().admit(bearer(OTHER)).ok
    assert KEY not in security.describe()


def test_tls_flags_are_checked_before_serving(tmp_path):
    parse = build_parser().parse_args
    base = ["--target", "t:1", "--tokenizer", "tok"]
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        security_from_args(parse([*base, "--tls-cert", str(tmp_path / "c")]))
    with pytest.raises(TLSError, match="missing.pem"):
        security_from_args(parse([*base, "--tls-ca", str(tmp_path / "missing.pem")]))
    with pytest.raises(TLSError, match="--public-tls-ca needs"):
        security_from_args(parse([*base, "--public-tls-ca", str(tmp_path / "ca.pem")]))


# ---- limits --------------------------------------------------------------------------------------
def test_token_bucket_per_key_with_retry_after():
    clock = Clock()
    guard = Guard(ApiKeys([KEY, OTHER]), Limits(rate_rps=0.5, burst=2), clock)
    assert guard.admit(bearer(KEY)).ok and guard.admit(bearer(KEY)).ok
    refused = guard.admit(bearer(KEY))
    assert refused.status == 429 and refused.retry_after == 2  # one token per 2 s
    assert guard.admit(bearer(OTHER)).ok  # another key has its own bucket
    clock.now += 2.0
    assert guard.admit(bearer(KEY)).ok and guard.admit(bearer(KEY)).status == 429
    clock.now += 60.0  # refills up to the burst, not beyond
    assert [guard.admit(bearer(KEY)).ok for _ in range(3)] == [True, True, False]


def test_concurrent_requests_per_key_count_until_released():
    guard = Guard(ApiKeys([KEY, OTHER]), Limits(max_concurrent=2))
    first, second = guard.admit(bearer(KEY)), guard.admit(bearer(KEY))
    refused = guard.admit(bearer(KEY))
    assert refused.status == 429 and refused.retry_after >= 1 and "concurrent" in refused.message
    assert guard.admit(bearer(OTHER)).ok
    first.release()
    first.release()  # twice is once
    assert guard.admit(bearer(KEY)).ok and guard.admit(bearer(KEY)).status == 429
    second.release()


def test_without_keys_every_caller_is_one_anonymous_client():
    guard = Guard(None, Limits(rate_rps=1, burst=1), Clock())
    assert guard.admit(None).ok
    assert guard.admit(bearer("anything")).status == 429 and guard.admit(None).status == 429


def test_http_guard_covers_v1_tokenizing_and_optionally_metrics():
    async def ok(_):  # noqa: ANN001, ANN202
        return PlainTextResponse("ok")

    guarded = ("/v1/models", "/tokenize", "/detokenize")  # tokenizing is the codec's work, as a prompt's
    app = Starlette(routes=[Route(p, ok) for p in (*guarded, "/health", "/ready", "/metrics", "/v1x")])
    for metrics, metrics_status in ((False, 200), (True, 401)):
        client = TestClient(HTTPGuard(app, Guard(ApiKeys([KEY]), Limits()), metrics=metrics))
        assert [client.get(p).status_code for p in guarded] == [401] * 3
        assert client.get("/v1/models", headers={"Authorization": bearer(KEY)}).status_code == 200
        assert [client.get(p).status_code for p in ("/health", "/ready", "/v1x")] == [200, 200, 200]
        assert client.get("/metrics").status_code == metrics_status


def test_limits_on_both_doors_of_a_real_router(model_pair):
    """No keys: one anonymous client. Two requests at once at most; 429 / RESOURCE_EXHAUSTED."""
    from router.security import RouterSecurity

    target, _ = start_target(model_pair[0])
    router = start_router(RouterConfig(), target.address, None, model_pair[0],
                          security=RouterSecurity(limits=Limits(max_concurrent=1)))
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{router.url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # the stream runs, and holds the one slot
            refused = http.get(f"{router.url}/v1/models")
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "rate_limit_error"
            with grpc.insecure_channel(router.grpc_address) as ch:
                with pytest.raises(grpc.RpcError) as err:
                    generate_pb2_grpc.GenerateStub(ch).GenerateUnary(generate_pb2.GenerateRequest(
                        prompt_token_ids=[5], max_tokens=2, sampling=common_pb2.SamplingParams(temperature=0)),
                        timeout=10)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert ("retry-after", "1") in tuple(err.value.trailing_metadata())
            assert http.get(f"{router.url}/health").status_code == 200  # probes are never limited
            list(lines)
        with httpx.Client(timeout=60) as http:
            assert http.get(f"{router.url}/v1/models").status_code == 200  # the stream ended: slot free
    finally:
        router.stop()
        target.stop()


# ---- reloading rotated files ---------------------------------------------------------------------
def test_sighup_rereads_files_the_poll_has_not_looked_at_yet(tmp_path):
    ca = CA("reload-ca")
    files = ca.write(tmp_path, ca.issue("one"))
    certs = Certificates(files, poll_s=3600)
    assert certs.refresh() == 0
    second = ca.issue("two")
    ca.write(tmp_path, second)
    assert certs.refresh() == 0  # not due yet
    reload_all()  # what SIGHUP does
    assert certs.refresh() == 1 and certs.pem.cert == second.cert_pem
    reload_all()
    assert certs.refresh() == 1  # re-read, unchanged: same generation


def test_sighup_reaches_a_service_process(tmp_path):
    """A real signal to a process running the reload handler."""
    code = ("import asyncio, os, signal, sys\n"
            "from common.reload import reload_on_sighup, FileSet\n"
            "files = FileSet([sys.argv[1]], poll_s=3600)\n"
            "async def main():\n"
            "    reload_on_sighup(asyncio.get_running_loop()); files.due()\n"
            "    os.kill(os.getpid(), signal.SIGHUP); await asyncio.sleep(0.2)\n"
            "    print('due' if files.due() is not None else 'not due')\n"
            "asyncio.run(main())\n")
    (tmp_path / "f").write_text("x")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "f")], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "due", out.stderr


def test_limits_reject_negative_values():
    with pytest.raises(ValueError):
        Limits(rate_rps=-1)
    assert not Limits().any and Limits(max_concurrent=1).any
