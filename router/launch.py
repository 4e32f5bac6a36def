"""Start the whole stack on one machine: target, draft and router as three processes on loopback.

    tandem serve models/smollm2                     # a pair directory (target/ and draft/): what `make run` runs
    tandem serve TARGET_DIR --draft DRAFT_DIR       # any two model directories sharing a tokenizer
    tandem serve models/smollm2 --no-draft          # no draft service: prompt-lookup speculation only
    tandem serve models/smollm2 --no-draft --router-arg=--no-prompt-lookup   # plain decoding (k = 0)
    tandem serve QWEN_PAIR --tool-call-parser hermes --reasoning-parser qwen3  # tool_choice "auto", reasoning_content
    tandem serve models/smollm2 --lora-modules sql=ADAPTER_DIR   # "model": "sql" answers with that LoRA adapter
    (python -m router.launch ... is the same command)

Waits until the router answers /ready, prints how to call it, and on Ctrl-C (or SIGTERM) stops
all three: the router first, then the services, each given time to finish what is in flight.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from common.cli import env_settable
from router.config import REASONING_PARSERS, TOOL_PARSERS
from router.stack import Stack


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
    p.add_argument("--tool-call-parser", choices=TOOL_PARSERS, default=None,
                   help="the model's tool-call format, for chat's tool_choice \"auto\" (the router's flag)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="where a reasoning model's thinking ends, for reasoning_content (the router's flag)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=DIR",
                   help="LoRA adapters (PEFT directories) the target serves, each a model name requests may ask "
                        "for (the target's flag; the draft proposes with the base model)")
    p.add_argument("--chat-template", default="", metavar="FILE",
                   help="a Jinja chat template instead of the model's own (the router's flag)")
    p.add_argument("--enable-runtime-lora", action="store_true",
                   help="LoRA adapters may be loaded and unloaded while serving: POST /v1/load_lora_adapter "
                        "{\"lora_name\", \"lora_path\"} and /v1/unload_lora_adapter (vLLM's; the target's flag)")
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
                  draft_port=args.draft_port, service_args=args.service_arg,
                  target_args=(["--lora-modules", *args.lora_modules] if args.lora_modules else [])
                  + (["--enable-runtime-lora"] if args.enable_runtime_lora else []),
                  router_args=[*_parsers(args), *args.router_arg])
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


def _parsers(args: argparse.Namespace) -> list[str]:
    """The router's own flags tandem serve takes (a file by its absolute path: the router may start elsewhere)."""
    values = {"tool_call_parser": args.tool_call_parser, "reasoning_parser": args.reasoning_parser,
              "chat_template": str(Path(args.chat_template).resolve()) if args.chat_template else None}
    return [f"--{flag.replace('_', '-')}={value}" for flag, value in values.items() if value]


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

  curl {stack.url}/v1/responses -H 'Content-Type: application/json' \\
       -d '{{"model": "{name}", "input": "Write a haiku about Paris", "max_output_tokens": 48}}'

  curl {stack.url}/v1/messages -H 'Content-Type: application/json' \
       -d '{{"model": "{name}", "max_tokens": 48, "messages": [{{"role": "user", "content": "Name three rivers"}}]}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{stack.url}/v1', api_key='none'); \\
print(c.completions.create(model='{name}', prompt='import os\\n', max_tokens=32, temperature=0).choices[0].text)"

  metrics: {stack.url}/metrics        Ctrl-C stops all three.
""", flush=True)


if __name__ == "__main__":
    sys.exit(main())
