"""The stack on one machine: target, draft and router as three processes on loopback, started,
waited for and stopped in order (`tandem serve`, router/launch.py; `make bench`; the e2e tests).
Also the free loopback ports they take."""

from __future__ import annotations

import argparse
import http.client
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from common.tls import TLSFiles
from router.config import FLUSH_S, RouterConfig

OMP_SPIN_COUNT = 10_000  # GOMP_SPINCOUNT of the processes started here (Stack._spawn says why)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports: all n sockets are held bound together, since ports asked for one
    at a time may come back equal (seen: a router given its target's port answered /ready in HTTP/2)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def stack_ports() -> dict[str, int]:
    """Distinct free ports for a Stack's four listeners, as its keyword arguments."""
    return dict(zip(("http_port", "grpc_port", "target_port", "draft_port"), free_ports(4), strict=True))


def _grpc_serving(address: str, timeout: float = 1.0, tls: TLSFiles | None = None) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    options = [("grpc.use_local_subchannel_pool", 1)]  # a fresh poll: no backoff left by the one before
    if tls is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        read = [p.read_bytes() if p else None for p in (tls.ca, tls.key, tls.cert)]
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(*read), options=options)
    with channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def _http_ok(url: str, timeout: float = 1.0, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as r:  # noqa: S310 - loopback only
            return r.status == 200
    except (OSError, http.client.HTTPException):  # HTTPException: something not HTTP/1 answered there
        return False


@dataclass
class Stack:
    target_dir: Path
    draft_dir: Path | None = None
    served_model_name: str = ""
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    target_port: int = 50052
    draft_port: int = 50053
    service_args: list[str] = field(default_factory=list)
    target_args: list[str] = field(default_factory=list)  # for the target only, after service_args
    wrap: dict[str, list[str]] = field(default_factory=dict)  # command prefix per process, e.g. taskset
    router_args: list[str] = field(default_factory=list)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    log_dir: Path | None = None
    # when the services or the router's doors use TLS (flags in service_args / router_args): the
    # certificate the launcher itself presents, and the CA it checks them with
    probe_tls: TLSFiles | None = None
    https: bool = False

    @property
    def draft(self) -> bool:
        return self.draft_dir is not None

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.target_dir.resolve().name

    @property
    def url(self) -> str:
        return f"{'https' if self.https else 'http'}://{self.host}:{self.http_port}"

    def ssl_context(self) -> ssl.SSLContext | None:
        """What a client of the HTTPS door needs (None for plain HTTP)."""
        if not self.https:
            return None
        tls = self.probe_tls
        context = ssl.create_default_context(cafile=str(tls.ca) if tls and tls.ca else None)
        if tls is not None and tls.cert is not None:
            context.load_cert_chain(tls.cert, tls.key)
        return context

    def _spawn(self, name: str, args: list[str]) -> None:
        out = open(self.log_dir / f"{name}.log", "ab") if self.log_dir else None  # noqa: SIM115
        # Both model services share this machine's cores. OpenMP's threads spin between parallel regions
        # (libgomp's default: about 3 ms) and so steal cores from the other service while theirs idles;
        # passive ones (sleeping at once) made each of a forward's ~120 small products wait for a wake-up,
        # SmolLM2's decode on two threads 1.6x slower. 10,000 spins (about 0.1 ms) cover the gaps inside
        # a forward and release the cores soon after it.
        env = {"GOMP_SPINCOUNT": str(OMP_SPIN_COUNT), **os.environ}
        self.procs[name] = subprocess.Popen([*self.wrap.get(name, []), sys.executable, "-m", *args], stdout=out,
                                            stderr=subprocess.STDOUT if out else None, env=env,
                                            cwd=Path(__file__).resolve().parent.parent)
        if out is not None:
            out.close()  # the child has its own copy

    def start_service(self, name: str) -> None:
        port = self.target_port if name == "target" else self.draft_port
        module = "target_service" if name == "target" else "draft_service"
        model = self.target_dir if name == "target" else self.draft_dir
        self._spawn(name, [module, "--model", str(model), "--host", self.host, "--port", str(port),
                           *self.service_args, *(self.target_args if name == "target" else [])])

    def start_router(self) -> None:
        args = ["router", "--target", f"{self.host}:{self.target_port}", "--tokenizer", str(self.target_dir),
                "--served-model-name", self.model_name, "--host", self.host, "--port", str(self.http_port),
                "--grpc-port", str(self.grpc_port), *self.router_args]
        if self.draft:
            args += ["--draft", f"{self.host}:{self.draft_port}"]
        self._spawn("router", args)

    def wait_service(self, name: str, timeout: float = 300.0) -> None:
        port = self.target_port if name == "target" else self.draft_port
        self._wait(name, lambda: _grpc_serving(f"{self.host}:{port}", tls=self.probe_tls), timeout)

    def wait_ready(self, timeout: float = 300.0) -> None:
        context = self.ssl_context()
        self._wait("router", lambda: _http_ok(f"{self.url}/ready", context=context), timeout)

    def _wait(self, name: str, check, timeout: float) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while not check():
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode} while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not ready after {timeout:.0f}s")
            time.sleep(0.2)

    def start(self, timeout: float = 300.0) -> None:
        """The target first, serving before the draft starts: on cores they share, a draft loading beside
        the target's calibration (engine/linear.py) skews what it times, and one stack in a few ran
        its small products a slower way for its whole life (demo pair, shared cores: the target's
        steps 20 -> 26 ms at c = 16, the draft idle). Then the draft, serving before the router starts:
        a router started beside a loading draft logged its refused connection as a warning at every
        `make run` and answered its first requests at k = 0 (SmolLM2: 5 s of the draft's calibration)."""
        self.start_service("target")
        if self.draft:
            self.wait_service("target", timeout)
            self.start_service("draft")
            self._wait_draft(timeout)
        self.start_router()
        self.wait_ready(timeout)

    def _wait_draft(self, timeout: float) -> None:
        """A draft that does not come up does not stop the stack: the router serves at k = 0 without it
        and connects when it answers (DESIGN: the draft is optional)."""
        try:
            self.wait_service("draft", timeout)
        except (RuntimeError, TimeoutError) as err:
            print(f"warning: the draft service is not serving ({err}); the router starts without it, "
                  f"at k = 0, and connects when it is back", file=sys.stderr, flush=True)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        proc.send_signal(sig)
        proc.wait(30)

    @property
    def router_drain_s(self) -> float:
        """How long the router may drain on SIGTERM (its --shutdown-timeout) and write its last streams."""
        flag = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        flag.add_argument("--shutdown-timeout", type=float, default=RouterConfig.shutdown_timeout_s)
        return flag.parse_known_args(self.router_args)[0].shutdown_timeout + FLUSH_S

    def stop(self, timeout: float = 20.0, signalled: bool = False) -> dict[str, int]:
        """SIGTERM in order (router, then services); SIGKILL what is still alive after timeout (the
        router: after its drain too, while the services still serve what it finishes).
        signalled: the children got the terminal's Ctrl-C too; let them finish on their own first."""
        codes = {}
        if signalled:
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and any(p.poll() is None for p in self.procs.values()):
                time.sleep(0.1)
        for name in ("router", "draft", "target"):
            proc = self.procs.get(name)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.terminate()
            try:
                codes[name] = proc.wait(timeout + (self.router_drain_s if name == "router" else 0.0))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        return codes
