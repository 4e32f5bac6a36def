"""python -m target_service --model DIR [--port 50052] ...: serve TargetService until SIGTERM."""

from __future__ import annotations

import argparse
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import aio
from common.cli import env_settable
from common.logs import setup_logging
from common.tracing import tracing_from_args
from engine.config import ModelConfig
from engine.lora import AdapterError
from engine.parallel import SINGLE, check_shardable
from engine.runner import ModelRunner
from engine.service import add_model_args, checked_engine_config, load_runner, model_thread, serve
from engine.transport import Transport, transport_from_args
from target_service.adapters import DEFAULT_MAX_LORAS
from target_service.server import SERVICE_NAME, create_servicer, register
from target_service.tp_workers import Followers, rank_config

log = logging.getLogger("target_service")


def build_parser(prog: str = "python -m target_service") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Tandem target service: verifies draft tokens and samples with the target model. "
                    "Serves tandem.v1.TargetService, gRPC health and reflection; stops gracefully on SIGTERM.",
        epilog="example: python -m target_service --model models/demo/target --port 50052 --kv-cache-gib 1",
    )
    add_model_args(parser, default_port=50052)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="split the model over N ranks (N GPUs: cuda:0..N-1 with NCCL; on CPU, gloo). "
                             "This process is rank 0 and serves gRPC; it starts ranks 1..N-1 itself. "
                             "Heads, KV heads and intermediate_size must divide by N. --kv-cache-gib is per rank")
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=DIR",
                        help="LoRA adapters (PEFT directories: adapter_config.json, adapter_model.safetensors) that "
                             "requests may name as their model (vLLM's flag). One rank only")
    parser.add_argument("--enable-runtime-lora", action="store_true",
                        help="let the router load and unload LoRA adapters while serving (its /v1/load_lora_adapter "
                             "and /v1/unload_lora_adapter; vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): it names a "
                             "directory on this machine, which this service then reads")
    parser.add_argument("--runtime-lora-root", type=Path, default=None, metavar="DIR",
                        help="with --enable-runtime-lora: load only adapters whose directory lies inside DIR "
                             "(default: any directory this service can read)")
    parser.add_argument("--max-loras", type=int, default=DEFAULT_MAX_LORAS,
                        help="the most LoRA adapters held at once, --lora-modules included (each takes memory "
                             "beside the KV cache)")
    parser.add_argument("--fail-on-token", type=int, default=-1, help=argparse.SUPPRESS)  # fault injection (tests)
    return env_settable(parser)


def main(argv: list[str] | None = None, prog: str = "python -m target_service") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.tensor_parallel_size < 1:
        parser.error("--tensor-parallel-size must be >= 1")
    adapters = _lora_modules(parser, args.lora_modules)
    if args.max_loras < len(adapters):
        parser.error(f"--max-loras {args.max_loras} is fewer than the {len(adapters)} --lora-modules")
    if args.enable_runtime_lora and args.tensor_parallel_size > 1:
        parser.error("--enable-runtime-lora: LoRA adapters are served with one tensor-parallel rank only")
    if adapters and args.tensor_parallel_size > 1:
        parser.error("--lora-modules: LoRA adapters are served with one tensor-parallel rank only")
    transport = transport_from_args(args)  # unusable certificate files fail in seconds, not after the load
    thread = model_thread(args.threads)
    if args.tensor_parallel_size == 1:
        runner = load_runner(args, thread=thread)  # logs the model, KV capacity, backend, dtype and device
        try:
            runner.load_adapters(adapters)
        except AdapterError as err:
            parser.error(f"--lora-modules: {err}")
        return _serve(args, runner, transport, thread)
    try:
        check_shardable(ModelConfig.from_dir(args.model), args.tensor_parallel_size)
    except ValueError as e:
        parser.error(str(e))
    setup_logging(args.log_level, args.log_format)
    config = rank_config(checked_engine_config(args), 0)
    followers = Followers.start(args.tensor_parallel_size, args.model, config, args.threads)
    runner = None
    try:
        runner = load_runner(args, followers.tp, config, thread)
        followers.exit_if_one_dies()
        return _serve(args, runner, transport, thread)
    finally:
        followers.stop(runner)


def _lora_modules(parser: argparse.ArgumentParser, specs: list[str]) -> dict[str, Path]:
    """NAME=DIR pairs: distinct names, existing directories."""
    adapters: dict[str, Path] = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        if not name or not path or name in adapters:
            parser.error(f"--lora-modules: {spec!r} is not NAME=DIR with a name of its own")
        if not Path(path).is_dir():
            parser.error(f"--lora-modules: {path} is no directory")
        adapters[name] = Path(path)
    return adapters


def _serve(args: argparse.Namespace, runner: ModelRunner, transport: Transport, thread: ThreadPoolExecutor) -> int:
    tracing = tracing_from_args(args, "tandem-target")
    servicer = create_servicer(runner, args.model_id, args.max_draft_tokens, tracing, args.fail_on_token, thread,
                               args.enable_runtime_lora, args.max_loras, args.runtime_lora_root)
    tp = runner.tp if runner.tp is not SINGLE else None
    log.info("target %s: max_draft_tokens %d%s", servicer.worker.model_id, args.max_draft_tokens,
             f"; tensor parallel over {tp.size} ranks" if tp else "")
    try:
        aio.run(serve(lambda server: register(server, servicer), SERVICE_NAME, args.host, args.port,
                      args.grace_seconds, transport=transport, on_shutdown=servicer.close_streams))
    finally:
        if tracing is not None:
            tracing.shutdown()  # export what is still buffered
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
