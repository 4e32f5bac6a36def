"""python -m draft_service --model DIR [--port 50053]: serve a draft model until SIGTERM."""

from __future__ import annotations

import argparse

from common import aio
from common.cli import env_settable
from common.tracing import tracing_from_args
from draft_service.proposer import SPARSE_Q_MASS, SPARSE_TOP_N
from draft_service.server import SERVICE_NAME, create_servicer, register
from engine.service import add_model_args, load_runner, model_thread, serve
from engine.transport import transport_from_args

DEFAULT_PORT = 50053


def build_parser(prog: str = "python -m draft_service") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Tandem draft service: serves a small draft model over gRPC (tandem.v1.DraftService). "
                    "Sync mirrors prompt chunks into its paged KV cache; Propose drafts k tokens for many "
                    "sequences in batched rounds, with the sparse distribution each was sampled from. "
                    "Implements grpc.health.v1 and reflection; stops gracefully on SIGTERM.",
    )
    add_model_args(parser, DEFAULT_PORT)
    parser.add_argument("--sparse-top-n", type=int, default=SPARSE_TOP_N,
                        help="most draft probabilities shipped per token when sampling (temperature > 0): the draft "
                             "samples from its top tokens, renormalised, so the shipped q is exactly what it sampled "
                             "from. The cut costs acceptance what it drops: measured on SmolLM2 as its own draft at "
                             "temperature 1, top-32 keeps 0.87-0.94 of the mass, top-1024 0.98-0.99")
    parser.add_argument("--sparse-q-mass", type=float, default=SPARSE_Q_MASS,
                        help="...and no more tokens than it takes to reach this much probability: peaked "
                             "distributions ship a handful of entries (median 4-13 at temperature 0.7 on SmolLM2), "
                             "wide ones up to --sparse-top-n")
    return env_settable(parser)


def main(argv: list[str] | None = None, prog: str = "python -m draft_service") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.sparse_top_n < 1 or not 0.0 < args.sparse_q_mass <= 1.0:
        parser.error("--sparse-top-n must be >= 1 and --sparse-q-mass in (0, 1]")
    if args.max_draft_tokens < 0:
        parser.error("--max-draft-tokens must be >= 0")
    transport = transport_from_args(args)  # unusable certificate files fail in seconds, not after the load
    thread = model_thread(args.threads)
    runner = load_runner(args, thread=thread)
    tracing = tracing_from_args(args, "tandem-draft")
    servicer = create_servicer(runner, args.model_id, args.max_draft_tokens, args.sparse_top_n, args.sparse_q_mass,
                               tracing, thread)
    try:
        aio.run(serve(lambda server: register(server, servicer), SERVICE_NAME, args.host, args.port,
                      args.grace_seconds, transport=transport, on_shutdown=servicer.close_streams))
    finally:
        if tracing is not None:
            tracing.shutdown()  # export what is still buffered
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
