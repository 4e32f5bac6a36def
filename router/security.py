"""The router's security settings: API keys and per-key limits on the public doors (router.auth),
TLS to the model services, TLS on the public doors (common.tls), which web pages may call the HTTP
door from a browser (CORS). Flags defined once, here."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from common.cli import Secret
from common.tls import Certificates, ClientTLS, TLSError, add_tls_args, files_from_args
from router.auth import ApiKeys, Guard, Limits
from router.config import RouterConfig


@dataclass(frozen=True)
class CORS:
    """Pages from these origins may call the HTTP door from a browser (which asks first: a preflight
    OPTIONS, answered before any API key is checked, since a browser sends none with it)."""

    origins: tuple[str, ...]  # "https://app.example.com"; "*": any page
    methods: tuple[str, ...] = ("GET", "POST", "DELETE", "OPTIONS")
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False  # cookies and HTTP authentication (not needed for an Authorization header)

    def __post_init__(self) -> None:
        if self.credentials and "*" in self.origins:
            raise ValueError("--allow-credentials with --allowed-origins '*' would let any page act with a "
                             "visitor's credentials: name the origins")


@dataclass(frozen=True)
class RouterSecurity:
    keys: ApiKeys | None = None  # None: no key needed
    limits: Limits = Limits()
    metrics_require_key: bool = False
    upstream: Certificates | None = None  # the router's side of TLS to target and draft; None: plaintext
    target_server_name: str = ""  # name to verify in the target's certificate instead of the address
    draft_server_name: str = ""
    public: Certificates | None = None  # TLS on the HTTP and gRPC doors; None: plaintext
    cors: CORS | None = None  # None: no CORS headers, browsers keep other origins' pages out
    salt_per_key: bool = False  # each key its own prefix cache (requests carry its digest as their tenant)

    def __post_init__(self) -> None:
        if self.salt_per_key and self.keys is None:
            raise ValueError("--cache-salt-per-key keeps each API key's prefix cache apart: it needs keys "
                             "(--api-key or --api-key-file)")

    def guard(self) -> Guard | None:
        if self.keys is None and not self.limits.any:
            return None
        return Guard(self.keys, self.limits, salt_per_key=self.salt_per_key)

    def apply(self, config: RouterConfig) -> RouterConfig:
        """config with the clients' TLS settings."""
        if self.upstream is None:
            return config
        return dataclasses.replace(config, target_tls=ClientTLS(self.upstream, self.target_server_name),
                                   draft_tls=ClientTLS(self.upstream, self.draft_server_name))

    def describe(self) -> str:
        """For the start-up log: what is on, never a key."""
        keys = f"{len(self.keys)} API keys" if self.keys is not None else "no API key"
        keys += " (a prefix cache per key)" if self.salt_per_key else ""
        lim = self.limits
        limits = ", ".join(part for part in (
            f"{lim.rate_rps:g} req/s (burst {lim.burst or max(1.0, lim.rate_rps):g})" if lim.rate_rps else "",
            f"{lim.max_concurrent} concurrent" if lim.max_concurrent else "") if part) or "none"
        upstream = "plaintext" if self.upstream is None else "mutual TLS" if self.upstream.pem.cert else "TLS"
        public = "plaintext" if self.public is None else "mutual TLS" if self.public.pem.ca else "TLS"
        cors = ", ".join(self.cors.origins) if self.cors is not None else "none"
        return f"{keys}; per-key limits: {limits}; to the services: {upstream}; public doors: {public}; " \
               f"browser origins (CORS): {cors}"


def add_security_args(parser: argparse.ArgumentParser) -> None:
    keys = parser.add_argument_group(
        "API keys and limits", "With keys set, /v1/* and gRPC Generate need `Authorization: Bearer KEY` "
        "(401 / UNAUTHENTICATED otherwise); /health and /ready stay open. Limits apply per key (without "
        "keys: to all callers together) and answer 429 with Retry-After.")
    keys.add_argument("--api-key", action="append", type=Secret, default=None,
                      help="accept this key (repeat for several; the environment variable takes a comma-separated "
                           "list). Prefer --api-key-file: a command line is visible to every local user")
    keys.add_argument("--api-key-file", type=Path, default=None,
                      help="accept the keys in this file, one per line (# comments); re-read when it changes")
    keys.add_argument("--metrics-require-key", action="store_true", help="/metrics needs a key too")
    keys.add_argument("--cache-salt-per-key", action="store_true",
                      help="keep each key's prefix cache apart: requests of one key share cached prompt blocks, "
                           "requests of different keys never do, so no client can time another's prompts (its "
                           "time to first token would tell a cached prompt); a request's own cache_salt divides "
                           "its key's cache further. Costs the hits keys would share (a common system prompt is "
                           "computed once per key). Default: one cache for all, as vLLM")
    keys.add_argument("--rate-limit-rps", type=float, default=0.0,
                      help="requests per second per key, a token bucket (0: no limit)")
    keys.add_argument("--rate-limit-burst", type=int, default=0,
                      help="token bucket size: requests a key may send at once (0: max(1, --rate-limit-rps))")
    keys.add_argument("--max-concurrent-streams-per-key", type=int, default=0,
                      help="requests in flight per key, a stream counting until it ends (0: no limit)")
    upstream = add_tls_args(parser, title="TLS to the model services",
                            description="--tls-ca verifies the services' certificates; --tls-cert and --tls-key "
                                        "are the router's client certificate for services that require one "
                                        "(mutual TLS). Re-read when they change and on SIGHUP.")
    upstream.add_argument("--target-tls-server-name", default="",
                          help="name to verify in the target's certificate (default: the host of each address); "
                               "needed when discovery yields pod IPs, e.g. target.tandem.svc")
    upstream.add_argument("--draft-tls-server-name", default="", help="the same for the draft's certificate")
    browsers = parser.add_argument_group(
        "Browsers (CORS)", "By default no CORS headers are sent, so a browser keeps pages from other origins "
        "from reading the answers. vLLM's flags; each takes values or a JSON list.")
    browsers.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                          help="origins whose pages may call the HTTP door, e.g. https://chat.example.com ('*': "
                               "any; API keys still apply)")
    browsers.add_argument("--allowed-methods", nargs="+", default=list(CORS.methods), metavar="METHOD",
                          help="methods they may use")
    browsers.add_argument("--allowed-headers", nargs="+", default=list(CORS.headers), metavar="HEADER",
                          help="request headers they may send")
    browsers.add_argument("--allow-credentials", action="store_true",
                          help="let them send cookies and HTTP authentication too (not with '*')")
    add_tls_args(parser, prefix="public-", title="TLS on the public doors (HTTP and gRPC)",
                 description="HTTPS and gRPC over TLS with this certificate; with --public-tls-ca, clients "
                             "must present a certificate from that CA. Probes then need HTTPS too.")


def security_from_args(args: argparse.Namespace) -> RouterSecurity:
    """ValueError or TLSError with a message naming the flag (never a key)."""
    inline = list(args.api_key or [])
    keys = ApiKeys(inline, args.api_key_file) if inline or args.api_key_file else None
    limits = Limits(args.rate_limit_rps, args.rate_limit_burst, args.max_concurrent_streams_per_key)
    upstream_files = files_from_args(args)
    public_files = files_from_args(args, "public-")
    if public_files is not None and public_files.cert is None:
        raise TLSError("--public-tls-ca needs --public-tls-cert and --public-tls-key")
    if (args.target_tls_server_name or args.draft_tls_server_name) and upstream_files is None:
        raise ValueError("--target-tls-server-name / --draft-tls-server-name need TLS to the services (--tls-ca)")
    origins = _values(args.allowed_origins)
    cors = CORS(origins, _values(args.allowed_methods), _values(args.allowed_headers),
                args.allow_credentials) if origins else None
    return RouterSecurity(
        keys=keys, limits=limits, metrics_require_key=args.metrics_require_key, cors=cors,
        salt_per_key=args.cache_salt_per_key,
        upstream=Certificates(upstream_files) if upstream_files else None,
        target_server_name=args.target_tls_server_name, draft_server_name=args.draft_tls_server_name,
        public=Certificates(public_files) if public_files else None)


def _values(given: list[str]) -> tuple[str, ...]:
    """Values as given, or in JSON lists (vLLM's form: --allowed-origins '["https://a.example"]')."""
    out: list[str] = []
    for value in given:
        if value.startswith("["):
            try:
                items = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"not a JSON list: {value!r} ({err})") from None
            if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
                raise ValueError(f"not a JSON list of strings: {value!r}")
            out += items
        else:
            out.append(value)
    return tuple(out)
