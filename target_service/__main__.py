"""python -m target_service --model DIR [--port 50052] ...: serve TargetService until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging

from common.cli import env_settable
from engine.service import add_model_args, load_runner, serve
from target_service.server import SERVICE_NAME, create_servicer, register

log = logging.getLogger("target_service")


def build_parser(prog: str = "python -m target_service") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Tandem target service: verifies draft tokens and samples with the target model. "
                    "Serves tandem.v1.TargetService, gRPC health and reflection; stops gracefully on SIGTERM.",
        epilog="example: python -m target_service --model models/demo/target --port 50052 --kv-cache-gib 1",
    )
    add_model_args(parser, default_port=50052)
    return env_settable(parser)


def main(argv: list[str] | None = None, prog: str = "python -m target_service") -> int:
    args = build_parser(prog).parse_args(argv)
    runner = load_runner(args)  # logs the model, KV capacity, backend, dtype and device
    servicer = create_servicer(runner, args.model_id, args.max_draft_tokens)
    log.info("target %s: max_draft_tokens %d", servicer.worker.model_id, args.max_draft_tokens)
    asyncio.run(serve(lambda server: register(server, servicer), SERVICE_NAME, args.host, args.port,
                      args.grace_seconds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
