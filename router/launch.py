"""Start the whole stack on one machine: target, draft and router as three processes on loopback.

    tandem serve models/smollm2                     # a pair directory (target/ and draft/): what `make run` runs
    tandem serve TARGET_DIR --draft DRAFT_DIR       # any two model directories sharing a tokenizer
    tandem serve models/smollm2 --no-draft          # no draft service: prompt-lookup speculation only
    tandem serve models/smollm2 --no-draft --router-arg=--no-prompt-lookup   # plain decoding (k = 0)
    (python -m router.launch ... is the same command)

Waits until the router answers /ready, prints how to call it, and on Ctrl-C (or SIGTERM) stops
all three: the router first, then the services, each given time to finish what is in flight.
"""

from __future__ import annotations

import argparse
import http.client
import json
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

from common.cli import env_settable
from common.tls import TLSFiles

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


def resolve_models(model: Path, draft: Path | None, no_draft: bool) -> tuple[Path, Path | None]:
    """(target dir, draft dir or None) from a model directory or a pair directory (target/ + draft/)."""
    if not (model / "config.json").is_file() and (model / "target" / "config.json").is_file():
        draft = draft or model / "draft"
        model = model / "target"
    if not (model / "config.json").is_file():
        raise FileNotFoundError(f"no model in {model} (config.json): run `make models` first, or name a model dir")
    if no_draft:
        return model, None
    if draft is not None and not (draft / "config.json").is_file():
        raise FileNotFoundError(f"no draft model in {draft}: run `make models`, or pass --no-draft")
    return model, draft


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
        steps 20 -> 26 ms at c = 16, the draft idle)."""
        self.start_service("target")
        if self.draft:
            self.wait_service("target", timeout)
            self.start_service("draft")
        self.start_router()
        self.wait_ready(timeout)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        proc.send_signal(sig)
        proc.wait(30)

    def stop(self, timeout: float = 20.0, signalled: bool = False) -> dict[str, int]:
        """SIGTERM in order (router, then services); SIGKILL what is still alive after timeout.
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
                codes[name] = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        return codes


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", type=Path, default=None,
                   help="target model directory, or a pair directory holding target/ and draft/")
    p.add_argument("--models", type=Path, default=None, help=argparse.SUPPRESS)  # the old spelling of `model`
    p.add_argument("--draft", type=Path, default=None, help="draft model directory (default: MODEL/draft of a pair)")
    p.add_argument("--no-draft", action="store_true",
                   help="no draft service (the router still speculates with prompt lookup unless "
                        "--router-arg=--no-prompt-lookup)")
    p.add_argument("--served-model-name", default="",
                   help="model name clients use (default: the pair directory's name, e.g. smollm2, else the "
                        "target directory's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", "--http-port", type=int, default=8000, help="the router's HTTP port")
    p.add_argument("--grpc-port", type=int, default=50051, help="the router's public gRPC port")
    p.add_argument("--target-port", type=int, default=50052)
    p.add_argument("--draft-port", type=int, default=50053)
    p.add_argument("--service-arg", action="append", default=[], help="extra flag for both services (repeat)")
    p.add_argument("--router-arg", action="append", default=[], help="extra flag for the router (repeat)")
    return env_settable(p)


def _warn_if_partial(report: Path) -> None:
    """A pair installed with --allow-partial missed its build gates: say which, every start."""
    try:
        data = json.loads(report.read_text())
    except (OSError, ValueError):
        return
    if data.get("partial"):
        missed = "; ".join(g["text"] for g in data.get("gates", []) if not g.get("ok"))
        print(f"warning: this pair was installed below its quality gates ({missed}). The router measures each "
              "sequence's acceptance and speculates (draft or prompt lookup) only where it pays; see docs/models.md",
              file=sys.stderr, flush=True)


def main(argv: list[str] | None = None, prog: str = "python -m router.launch") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    model = args.model or args.models
    if model is None:
        parser.error("name a model directory (e.g. models/smollm2)")
    try:
        target_dir, draft_dir = resolve_models(model, args.draft, args.no_draft)
    except FileNotFoundError as err:
        print(err, file=sys.stderr)
        return 2
    if draft_dir is not None:
        _warn_if_partial(draft_dir.parent / "report.json")
    pair_name = model.resolve().name if target_dir.parent.resolve() == model.resolve() else ""
    stack = Stack(target_dir, draft_dir, served_model_name=args.served_model_name or pair_name, host=args.host,
                  http_port=args.port, grpc_port=args.grpc_port, target_port=args.target_port,
                  draft_port=args.draft_port, service_args=args.service_arg, router_args=args.router_arg)
    signal.signal(signal.SIGTERM, _interrupt)
    interrupted = False
    try:
        print(f"starting target {target_dir}" + (f" and draft {draft_dir}" if draft_dir else "") + " ...", flush=True)
        stack.start()
        _print_usage(stack)
        while all(proc.poll() is None for proc in stack.procs.values()):
            time.sleep(0.5)
        time.sleep(0.5)  # a terminal's Ctrl-C reaches the children too; let ours arrive
        dead = {n: proc.returncode for n, proc in stack.procs.items() if proc.poll() is not None}
        print(f"{', '.join(f'{n} (exit {c})' for n, c in dead.items())} stopped; stopping the stack",
              file=sys.stderr)
        return 0 if all(c in (0, -signal.SIGINT, -signal.SIGTERM) for c in dead.values()) else 1
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        interrupted = True
        return 0
    except (RuntimeError, TimeoutError) as err:
        print(f"failed to start: {err}", file=sys.stderr)
        return 1
    finally:
        codes = stack.stop(signalled=interrupted)
        print("stopped: " + ", ".join(f"{n} (exit {c})" for n, c in codes.items()), flush=True)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the stack like Ctrl-C does


def _print_usage(stack: Stack) -> None:
    name = stack.model_name
    mode = "" if stack.draft else "  [no draft: prompt-lookup speculation only]"
    print(f"""
Tandem is ready: {stack.url}  (gRPC Generate on {stack.host}:{stack.grpc_port}){mode}

  curl {stack.url}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "{name}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

  curl {stack.url}/v1/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "{name}", "prompt": "def fibonacci(n):", "max_tokens": 48, "temperature": 0}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{stack.url}/v1', api_key='none'); \\
print(c.completions.create(model='{name}', prompt='import os\\n', max_tokens=32, temperature=0).choices[0].text)"

  metrics: {stack.url}/metrics        Ctrl-C stops all three.
""", flush=True)


if __name__ == "__main__":
    sys.exit(main())
