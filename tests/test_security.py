"""Security on real servers over loopback: mutual TLS between the router and both model services,
TLS on the public doors, API keys on HTTP and gRPC, certificate rotation while serving. Every
certificate is made at test time (tests/certs.py): one CA for Tandem, one foreign CA."""

from __future__ import annotations

import logging
import socket
import ssl
import threading

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.tls import Certificates, ClientTLS, TLSFiles
from engine.transport import Transport
from router.auth import ApiKeys
from router.config import RouterConfig
from router.core import ServiceUnavailable
from router.security import RouterSecurity
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.certs import CA, serial_of
from tests.stack import REALISTIC_STEP_S, running_stack, start_draft, start_router, start_target

KEY = "tandem-test-key-5b1d0c7e"
WRONG = "tandem-wrong-key-93aa41f2"
CONFIG = RouterConfig(max_num_batched_tokens=64, max_num_seqs=8, draft_timeout_s=2.0, dynamic_k=False, k_max=3)
PROMPTS = [[(5 * i + 11 * j) % 300 + 2 for j in range(n)] for i, n in enumerate((7, 40, 19))]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca, foreign = CA("tandem-test-ca"), CA("foreign-ca")
    files = {name: ca.write(root / name, ca.issue(name)) for name in ("target", "draft", "router", "public")}
    files["client"] = ca.write(root / "client", ca.issue("http-client", server=False))
    files["foreign"] = foreign.write(root / "foreign", foreign.issue("intruder"), ca_pem=ca.pem)
    files["misplaced_trust"] = ca.write(root / "misplaced", ca.issue("router-2"), ca_pem=foreign.pem)
    return {"ca": ca, "foreign_ca": foreign, "root": root, **files}


def certs(files: TLSFiles) -> Certificates:
    return Certificates(files, poll_s=0)  # look at the files on every use: rotation shows at once


@pytest.fixture(scope="module")
def secure(model_pair, pki):
    """Target and draft requiring client certificates; a router with its own, API keys, and TLS
    with client certificates on both public doors."""
    target_dir, draft_dir = model_pair
    target, _ = start_target(target_dir, transport=Transport(certs(pki["target"])), step_delay_s=REALISTIC_STEP_S)
    draft, _ = start_draft(draft_dir, transport=Transport(certs(pki["draft"])))
    security = RouterSecurity(keys=ApiKeys([KEY]), upstream=certs(pki["router"]), public=certs(pki["public"]))
    router = start_router(CONFIG, target.address, draft.address, target_dir, security=security)
    yield {"router": router, "target": target, "draft": draft, "dirs": model_pair}
    router.stop()
    target.stop()
    draft.stop()


def client_context(pki, name: str = "client") -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki[name].ca))
    ctx.load_cert_chain(pki[name].cert, pki[name].key)
    return ctx


def post(router, pki, path: str, key: str | None = KEY, **body) -> httpx.Response:  # noqa: ANN001, ANN003
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    with httpx.Client(verify=client_context(pki), timeout=60) as http:
        return http.post(f"{router.url}{path}", json={"model": "tiny", "temperature": 0.0, "ignore_eos": True,
                                                      "return_token_ids": True, **body}, headers=headers)


def greedy_ids(router, pki, prompt: list[int], n: int = 24) -> list[int]:  # noqa: ANN001
    r = post(router, pki, "/v1/completions", prompt=prompt, max_tokens=n)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def channel(router, pki, name: str = "client") -> grpc.Channel:  # noqa: ANN001
    f = pki[name]
    creds = grpc.ssl_channel_credentials(f.ca.read_bytes(), f.key.read_bytes(), f.cert.read_bytes())
    return grpc.secure_channel(router.grpc_address, creds)


def health_check(address: str, creds: grpc.ChannelCredentials | None) -> int | grpc.StatusCode:
    ch = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
    with ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        except grpc.RpcError as err:
            return err.code()


def creds_of(f: TLSFiles) -> grpc.ChannelCredentials:
    return ClientTLS(Certificates(f)).credentials()


# ---- mutual TLS between router and services ------------------------------------------------------
def test_greedy_over_mutual_tls_equals_plaintext(secure, pki, model_pair):
    with running_stack(model_pair, CONFIG) as plain:
        with httpx.Client(timeout=60) as http:
            want = [http.post(f"{plain['router'].url}/v1/completions", json={
                "model": "tiny", "prompt": p, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True}).json()["choices"][0]["token_ids"] for p in PROMPTS]
    assert [greedy_ids(secure["router"], pki, p) for p in PROMPTS] == want
    with httpx.Client(verify=client_context(pki)) as http:  # the draft took part, over its own mTLS link
        ready = http.get(f"{secure['router'].url}/ready").json()
        drafted = [ln for ln in http.get(f"{secure['router'].url}/metrics").text.splitlines()
                   if ln.startswith("tandem:spec_decode_num_draft_tokens_total ")]
    assert ready["draft_available"] is True and float(drafted[0].split()[1]) > 0


@pytest.mark.parametrize("service", ["target", "draft"])
def test_a_tls_service_refuses_plaintext_and_foreign_certificates(secure, pki, service):
    address = secure[service].address
    assert health_check(address, creds_of(pki["router"])) == health_pb2.HealthCheckResponse.SERVING
    assert health_check(address, None) == grpc.StatusCode.UNAVAILABLE  # plaintext
    assert health_check(address, creds_of(pki["foreign"])) == grpc.StatusCode.UNAVAILABLE  # foreign CA's client
    no_cert = grpc.ssl_channel_credentials(pki["ca"].pem)
    assert health_check(address, no_cert) == grpc.StatusCode.UNAVAILABLE  # TLS, but no client certificate


def test_a_tls_service_can_answer_health_alone_in_plaintext_for_probes(pki, model_pair):
    from router.stack import free_port

    health_port = free_port()
    target, _ = start_target(model_pair[0], transport=Transport(certs(pki["target"]), health_port=health_port))
    try:
        assert health_check(f"127.0.0.1:{health_port}", None) == health_pb2.HealthCheckResponse.SERVING
        assert health_check(target.address, None) == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as ch:  # health only: no model service there
            with pytest.raises(grpc.RpcError) as missing:
                ch.unary_unary("/tandem.v1.TargetService/GetInfo")(b"", timeout=5)
            assert missing.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        target.stop()


def test_a_router_with_a_foreign_certificate_or_ca_cannot_reach_the_services(secure, pki, model_pair):
    target = secure["target"].address
    for files in (pki["foreign"],  # trusts our CA, but its own certificate comes from the foreign CA
                  pki["misplaced_trust"]):  # its certificate is ours, but it trusts only the foreign CA
        with pytest.raises(ServiceUnavailable, match="no target reachable"):
            start_router(CONFIG, target, None, model_pair[0], wait_s=1.0, security=RouterSecurity(
                upstream=certs(files)))


# ---- API keys ------------------------------------------------------------------------------------
def test_http_key_required_wrong_and_right(secure, pki):
    router = secure["router"]
    for key, message in ((None, "missing API key"), (WRONG, "invalid API key")):
        r = post(router, pki, "/v1/completions", key=key, prompt=[5, 6], max_tokens=2)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "invalid_request_error" and message in r.json()["error"]["message"]
        assert KEY not in r.text and WRONG not in r.text
    with httpx.Client(verify=client_context(pki)) as http:
        assert http.get(f"{router.url}/v1/models").status_code == 401
        assert http.get(f"{router.url}/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
        assert http.get(f"{router.url}/v1/nothing-here", headers={"Authorization": "Basic x"}).status_code == 401
        for open_path in ("/health", "/ready", "/metrics"):
            assert http.get(f"{router.url}{open_path}").status_code == 200, open_path
    assert len(greedy_ids(router, pki, PROMPTS[0], 4)) == 4


def test_openai_client_with_its_api_key(secure, pki):
    from openai import AuthenticationError, OpenAI

    http = httpx.Client(verify=client_context(pki))
    right = OpenAI(base_url=f"{secure['router'].url}/v1", api_key=KEY, http_client=http, max_retries=0)
    out = right.completions.create(model="tiny", prompt="def f(x):", max_tokens=5, temperature=0)
    assert out.usage.completion_tokens >= 1
    wrong = OpenAI(base_url=f"{secure['router'].url}/v1", api_key=WRONG, http_client=http, max_retries=0)
    with pytest.raises(AuthenticationError):
        wrong.completions.create(model="tiny", prompt="x", max_tokens=2)


def test_anthropic_client_with_its_api_key(secure, pki):
    """Anthropic's clients send the key as x-api-key; a refusal comes in Anthropic's error shape."""
    import httpx2  # the anthropic client's own HTTP stack
    from anthropic import Anthropic, AuthenticationError

    http = httpx2.Client(verify=client_context(pki))
    right = Anthropic(base_url=secure["router"].url, api_key=KEY, http_client=http, max_retries=0)
    out = right.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert out.usage.output_tokens >= 1
    wrong = Anthropic(base_url=secure["router"].url, api_key=WRONG, http_client=http, max_retries=0)
    with pytest.raises(AuthenticationError) as err:
        wrong.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "authentication_error"
    assert WRONG not in str(err.value.body)


def test_grpc_key_required_wrong_and_right_health_open(secure, pki):
    req = generate_pb2.GenerateRequest(prompt_token_ids=PROMPTS[0], max_tokens=6, ignore_eos=True,
                                       sampling=common_pb2.SamplingParams(temperature=0))
    with channel(secure["router"], pki) as ch:
        stub = generate_pb2_grpc.GenerateStub(ch)
        for metadata in ((), (("authorization", f"Bearer {WRONG}"),), (("authorization", KEY),)):
            for call in (lambda m: list(stub.Generate(req, metadata=m, timeout=30)),
                         lambda m: stub.GenerateUnary(req, metadata=m, timeout=30)):
                with pytest.raises(grpc.RpcError) as refused:
                    call(metadata)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert KEY not in refused.value.details() and WRONG not in refused.value.details()
        auth = (("authorization", f"Bearer {KEY}"),)
        streamed = [t for m in stub.Generate(req, metadata=auth, timeout=30) for t in m.token_ids]
        assert streamed == list(stub.GenerateUnary(req, metadata=auth, timeout=30).token_ids)
        assert streamed == greedy_ids(secure["router"], pki, PROMPTS[0], 6)
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_public_doors_require_a_client_certificate_from_the_ca(secure, pki):
    router = secure["router"]
    no_cert = ssl.create_default_context(cafile=str(pki["client"].ca))
    with pytest.raises(httpx.HTTPError), httpx.Client(verify=no_cert) as http:
        http.get(f"{router.url}/health")
    with pytest.raises(httpx.TransportError), httpx.Client() as http:
        http.get(router.url.replace("https", "http") + "/health")  # plaintext to a TLS door
    with channel(router, pki, "foreign") as ch:
        with pytest.raises(grpc.RpcError) as refused:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def test_keys_never_appear_in_logs(secure, pki, model_pair, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    router = start_router(CONFIG, secure["target"].address, None, model_pair[0], security=RouterSecurity(
        keys=ApiKeys([KEY, "second-key-0f9e"]), upstream=certs(pki["router"]), public=certs(pki["public"])))
    try:
        for key in (KEY, WRONG, None):
            post(router, pki, "/v1/completions", key=key, prompt=[3, 4], max_tokens=2)
            post(router, pki, "/v1/completions", key=key, prompt="x" * 10, max_tokens=-1)  # a 400 logs nothing
        with channel(router, pki) as ch:
            for key in (KEY, WRONG):
                stub = generate_pb2_grpc.GenerateStub(ch)
                try:
                    stub.GenerateUnary(generate_pb2.GenerateRequest(prompt="x", max_tokens=2),
                                       metadata=(("authorization", f"Bearer {key}"),), timeout=30)
                except grpc.RpcError:
                    pass
    finally:
        router.stop()
    out, err = capfd.readouterr()
    assert "2 API keys" in caplog.text  # the start-up line says keys are on, and nothing more
    for secret in (KEY, WRONG, "second-key-0f9e"):
        assert secret not in caplog.text and secret not in out and secret not in err


# ---- rotation ------------------------------------------------------------------------------------
def served_serial(address: str, pki) -> int:  # noqa: ANN001
    """The serial of the certificate a TLS server presents to a new connection."""
    host, port = address.rsplit(":", 1)
    ctx = client_context(pki, "router")
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname=host) as tls:
            return serial_of(tls.getpeercert(binary_form=True))


def test_rotation_under_load_drops_nothing(secure, pki, model_pair):
    """New certificates for target, draft, the router's client side and the public door, written
    while a long generation streams: it finishes exactly; new connections get the new files."""
    router, ca = secure["router"], pki["ca"]
    prompt = PROMPTS[1]
    want = greedy_ids(router, pki, prompt, 120)
    result: dict = {}
    streaming = threading.Event()

    def generate() -> None:
        with channel(router, pki) as ch:
            stub = generate_pb2_grpc.GenerateStub(ch)
            ids = []
            for msg in stub.Generate(generate_pb2.GenerateRequest(
                    prompt_token_ids=prompt, max_tokens=120, ignore_eos=True,
                    sampling=common_pb2.SamplingParams(temperature=0)),
                    metadata=(("authorization", f"Bearer {KEY}"),), timeout=120):
                ids += msg.token_ids
                streaming.set()
            result["ids"] = ids

    worker = threading.Thread(target=generate)
    worker.start()
    assert streaming.wait(60)
    new = {name: ca.issue(f"{name}-rotated") for name in ("target", "draft", "router", "public")}
    for name, leaf in new.items():
        ca.write(pki["root"] / name, leaf)
    worker.join(120)
    assert result["ids"] == want
    assert served_serial(secure["target"].address, pki) == new["target"].serial
    assert served_serial(secure["draft"].address, pki) == new["draft"].serial
    assert served_serial(router.grpc_address, pki) == new["public"].serial
    assert greedy_ids(router, pki, prompt, 120) == want  # the router's new client certificate works too
    lane = next(iter(router.server.engine.lanes.values()))
    assert lane.target._generation >= 1, "the router kept its old channel"
    assert wait_for_https_serial(router, pki, new["public"].serial)


def wait_for_https_serial(router, pki, serial: int, timeout: float = 5.0) -> bool:  # noqa: ANN001
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if served_serial(router.url.removeprefix("https://"), pki) == serial:
            return True
        time.sleep(0.1)
    return False


def test_a_half_written_rotation_keeps_the_current_certificate(secure, pki, caplog):
    """A key that does not match its certificate (the files caught mid-update) is not taken."""
    target, ca = secure["target"], pki["ca"]
    before = served_serial(target.address, pki)
    mismatched = ca.issue("target-half")
    (pki["root"] / "target" / "tls.crt").write_bytes(mismatched.cert_pem)  # the key is still the old one
    assert served_serial(target.address, pki) == before
    assert "keeping the current ones" in caplog.text
    ca.write(pki["root"] / "target", mismatched)  # the key arrives: now it is taken
    assert served_serial(target.address, pki) == mismatched.serial


@pytest.mark.parametrize("service", ["target_service", "draft_service"])
def test_a_service_with_unusable_tls_files_refuses_to_start_before_loading_its_model(service, pki, tmp_path):
    import subprocess
    import sys

    wrong_key = [f"--tls-cert={pki['target'].cert}", f"--tls-key={pki['draft'].key}"]  # not this certificate's key
    for flags in (wrong_key, [f"--tls-ca={pki['target'].ca}"]):
        out = subprocess.run([sys.executable, "-m", service, "--model", str(tmp_path / "no-model"), *flags],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and "TLS:" in out.stderr, out.stderr[-2000:]
        assert "config.json" not in out.stderr  # it never got to the model
