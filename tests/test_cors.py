"""CORS on the HTTP door (router.security.CORS): off by default; with --allowed-origins a browser's
preflight is answered before any API key is asked for, the answers (refusals included) carry the
allowing headers for the origins named and for no other; flags as vLLM spells them."""

from __future__ import annotations

import httpx
import pytest

from router.__main__ import build_parser
from router.auth import ApiKeys
from router.config import RouterConfig
from router.security import CORS, RouterSecurity, security_from_args
from tests.stack import start_router, start_target

KEY, PAGE, ELSEWHERE = "key-cors-5e1b", "https://chat.example.com", "https://evil.example.net"
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


def _args(*flags: str) -> RouterSecurity:
    return security_from_args(build_parser("router").parse_args(["--target", "t:1", "--tokenizer", "x", *flags]))


def test_flags_take_values_or_vllm_s_json_lists_and_refuse_credentials_for_any_origin():
    assert _args().cors is None, "off unless asked"
    assert _args("--allowed-origins", PAGE, "https://b.example").cors.origins == (PAGE, "https://b.example")
    assert _args("--allowed-origins", f'["{PAGE}"]').cors == CORS((PAGE,))
    with pytest.raises(ValueError, match="JSON list"):
        _args("--allowed-origins", "[not json")
    with pytest.raises(ValueError, match="credentials"):
        _args("--allowed-origins", "*", "--allow-credentials")


def test_a_page_from_an_allowed_origin_may_call_the_router_with_its_key_and_others_may_not(model_pair):
    target, _ = start_target(model_pair[0])
    security = RouterSecurity(keys=ApiKeys([KEY]), cors=CORS((PAGE,)))
    router = start_router(RouterConfig(), target.address, None, model_pair[0], security=security)
    plain = start_router(RouterConfig(router_id=router.server.config.router_id), target.address, None, model_pair[0])
    url = f"{router.url}/v1/completions"
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3}
    try:
        with httpx.Client(timeout=60) as http:
            preflight = http.options(url, headers={"Origin": PAGE, **PREFLIGHT})
            answer = http.post(url, json=body, headers={"Origin": PAGE, "Authorization": f"Bearer {KEY}"})
            refused = http.post(url, json=body, headers={"Origin": PAGE})
            foreign = http.options(url, headers={"Origin": ELSEWHERE, **PREFLIGHT})
            foreign_answer = http.post(url, json=body, headers={"Origin": ELSEWHERE, "Authorization": f"Bearer {KEY}"})
            off = http.options(f"{plain.url}/v1/completions", headers={"Origin": PAGE, **PREFLIGHT})
    finally:
        router.stop(), plain.stop(), target.stop()
    assert preflight.status_code == 200, "a preflight carries no key: it is answered, not refused"
    assert preflight.headers["access-control-allow-origin"] == PAGE
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == PAGE
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == PAGE, \
        "the page can read why it was refused"
    assert "access-control-allow-origin" not in foreign.headers and foreign.status_code == 400
    assert foreign_answer.status_code == 200 and "access-control-allow-origin" not in foreign_answer.headers, \
        "served (a key was given), but a browser keeps the page from reading it"
    assert "access-control-allow-origin" not in off.headers, "no --allowed-origins: no CORS"
