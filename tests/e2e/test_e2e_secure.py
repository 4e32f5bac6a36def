"""The e2e pass with security on (conftest `secure_stack`): three processes, mutual TLS between
the router and both services, HTTPS and gRPC over TLS on the doors, an API key from a file.
Driven by the same clients as test_e2e.py; rotation is done the way an operator would: new files,
then SIGHUP."""

from __future__ import annotations

import signal
import socket
import ssl
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from openai import AuthenticationError, OpenAI

from router.stack import _grpc_serving
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.certs import serial_of
from tests.e2e.conftest import auth_metadata, grpc_channel, http_client
from tests.e2e.test_e2e import PROMPTS
from tests.e2e.test_e2e import test_chat_streaming_and_not as chat_matches_transformers
from tests.e2e.test_e2e import test_completions_greedy_equal_transformers as completions_match_transformers
from tests.e2e.test_e2e import test_grpc_generate_streaming_and_unary as grpc_matches_transformers


@pytest.fixture(scope="module")
def client(secure_stack) -> OpenAI:
    return OpenAI(base_url=f"{secure_stack.url}/v1", api_key=secure_stack.api_key, timeout=120, max_retries=0,
                  http_client=http_client(secure_stack))


@pytest.fixture(scope="module")
def model(secure_stack) -> str:
    return secure_stack.model_name


def test_greedy_over_tls_with_a_key_equals_transformers(secure_stack, client, model, ref):
    completions_match_transformers(client, model, ref)
    chat_matches_transformers(client, model, ref)
    grpc_matches_transformers(secure_stack, ref)


def test_the_draft_speculates_over_its_mutual_tls_link(secure_stack, client, model):
    with http_client(secure_stack) as http:
        deadline = time.monotonic() + 60  # the draft may come up after the router (it is optional)
        while not http.get(f"{secure_stack.url}/ready").json()["draft_available"] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert http.get(f"{secure_stack.url}/ready").json()["draft_available"] is True
        client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=96, temperature=0,
                                  extra_body={"ignore_eos": True})
        drafted = [ln for ln in http.get(f"{secure_stack.url}/metrics").text.splitlines()
                   if ln.startswith("tandem:spec_decode_num_draft_tokens_total ")]
    assert float(drafted[0].split()[1]) > 0


def test_no_key_or_a_wrong_key_is_refused_probes_stay_open(secure_stack, model):
    stranger = OpenAI(base_url=f"{secure_stack.url}/v1", api_key="not-the-key", max_retries=0,
                      http_client=http_client(secure_stack))
    with pytest.raises(AuthenticationError):
        stranger.completions.create(model=model, prompt="x", max_tokens=2)
    with httpx.Client(verify=secure_stack.ssl_context(), timeout=30) as anonymous:
        r = anonymous.post(f"{secure_stack.url}/v1/completions", json={"model": model, "prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        for path in ("/health", "/ready", "/metrics"):
            assert anonymous.get(f"{secure_stack.url}{path}").status_code == 200, path
    with grpc_channel(secure_stack) as ch:
        with pytest.raises(grpc.RpcError) as refused:
            generate_pb2_grpc.GenerateStub(ch).GenerateUnary(generate_pb2.GenerateRequest(prompt="x", max_tokens=2),
                                                             timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_services_refuse_plaintext(secure_stack):
    for port in (secure_stack.target_port, secure_stack.draft_port):
        address = f"{secure_stack.host}:{port}"
        assert _grpc_serving(address, tls=secure_stack.probe_tls)
        assert not _grpc_serving(address)


def served_serial(stack, port: int) -> int:  # noqa: ANN001
    ctx = ssl.create_default_context(cafile=str(stack.probe_tls.ca))
    ctx.load_cert_chain(stack.probe_tls.cert, stack.probe_tls.key)
    with socket.create_connection((stack.host, port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname=stack.host) as tls:
            return serial_of(tls.getpeercert(binary_form=True))


def test_rotation_with_sighup_drops_nothing(secure_stack, client, model, ref):
    """While a long generation streams: new certificates for everybody and a new key file, then
    SIGHUP to all three. The stream finishes exactly; new connections see the new certificates;
    the old key is refused, the new one accepted."""
    s, pki = secure_stack, secure_stack.pki
    ids = ref.encode(PROMPTS[3])
    want = ref.greedy(ids, 150)
    got: dict = {}
    streaming = threading.Event()

    def stream() -> None:
        with grpc_channel(s) as ch:
            out = []
            for msg in generate_pb2_grpc.GenerateStub(ch).Generate(generate_pb2.GenerateRequest(
                    prompt_token_ids=ids, max_tokens=150, ignore_eos=True,
                    sampling=common_pb2.SamplingParams(temperature=0)), metadata=auth_metadata(s), timeout=120):
                out += msg.token_ids
                streaming.set()
            got["ids"] = out

    worker = threading.Thread(target=stream)
    worker.start()
    assert streaming.wait(60)
    new = {name: pki["ca"].issue(f"{name}-2") for name in ("services", "router", "public")}
    for name, leaf in new.items():
        pki["ca"].write(pki["root"] / name, leaf)
    old_key, s.api_key = s.api_key, s.api_key + "-rotated"
    (pki["root"] / "api-keys").write_text(f"{s.api_key}\n")
    for proc in s.procs.values():
        proc.send_signal(signal.SIGHUP)
    worker.join(120)
    assert got["ids"] == want
    assert served_serial(s, s.target_port) == new["services"].serial
    assert served_serial(s, s.draft_port) == new["services"].serial
    assert served_serial(s, s.grpc_port) == new["public"].serial
    deadline = time.monotonic() + 10  # the HTTPS door takes new files on its next look (<= 2 s)
    while served_serial(s, s.http_port) != new["public"].serial and time.monotonic() < deadline:
        time.sleep(0.2)
    assert served_serial(s, s.http_port) == new["public"].serial
    rotated = OpenAI(base_url=f"{s.url}/v1", api_key=s.api_key, max_retries=0, http_client=http_client(s))
    completions_match_transformers(rotated, model, ref)  # the router's new client certificate works too
    stale = OpenAI(base_url=f"{s.url}/v1", api_key=old_key, max_retries=0, http_client=http_client(s))
    with pytest.raises(AuthenticationError):
        stale.completions.create(model=model, prompt="x", max_tokens=2)
    assert all(proc.poll() is None for proc in s.procs.values()), "SIGHUP must not stop a process"


def test_draft_killed_and_restarted_reconnects_over_mutual_tls(secure_stack):
    s = secure_stack
    s.kill("draft", signal.SIGKILL)
    s.start_service("draft")
    s.wait_service("draft", 60)
    deadline = time.monotonic() + 30
    with http_client(s) as http:
        while not http.get(f"{s.url}/ready").json()["draft_available"] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert http.get(f"{s.url}/ready").json()["draft_available"] is True


def test_no_key_is_ever_written_to_a_log(secure_stack):
    """Last: after right, wrong and rotated keys have been used; the router logs at DEBUG."""
    s = secure_stack
    text = "".join(path.read_text(errors="replace") for path in s.pki["logs"].glob("*.log"))
    assert "API keys" in text, "the logs were not captured"
    for key in {s.api_key, s.api_key.removesuffix("-rotated"), "not-the-key"}:
        assert key not in text
