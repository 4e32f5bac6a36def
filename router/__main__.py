"""python -m router --target HOST:PORT [--draft HOST:PORT] --tokenizer DIR ..."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

import jinja2

from common.cli import env_settable
from common.logs import add_log_args, setup_logging
from common.tls import TLSError
from common.tracing import add_tracing_args, tracing_from_args
from router.adapters import IncompatibleTarget
from router.chat import compile_template
from router.config import REASONING_PARSERS, SCHEDULING_POLICIES, TOOL_PARSERS, RouterConfig
from router.core import ServiceUnavailable
from router.drafting import IncompatibleDraft
from router.lanes import IncompatibleLimits
from router.security import add_security_args, security_from_args
from router.server import Endpoints, main_sync


def build_parser(prog: str = "python -m router") -> argparse.ArgumentParser:
    d = RouterConfig()
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Tandem router: schedules chunked prefill + speculative decoding over a target and an "
                    "optional draft service, and serves OpenAI-compatible HTTP and gRPC Generate.")
    p.add_argument("--target", required=True,
                   help="target replicas: HOST:PORT[,HOST:PORT...], dns:NAME:PORT (every address of a headless "
                        "Service) or k8s:NAMESPACE/SERVICE:PORT (EndpointSlices watched through the Kubernetes API)")
    p.add_argument("--draft", default=None,
                   help="draft replicas, same forms as --target (omit: target-only, k = 0)")
    p.add_argument("--tokenizer", required=True,
                   help="directory with tokenizer.json, the chat template and generation_config.json (its sampling "
                        "defaults apply to requests that leave them out): usually the target model directory")
    p.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                   help="model name clients use (default: the tokenizer directory's name); several: the model "
                        "answers to each, the first is the one /v1/models lists first (vLLM's flag)")
    p.add_argument("--chat-template", default="", metavar="FILE",
                   help="a Jinja chat template rendering chats instead of the model's own (vLLM's flag; as "
                        "transformers' apply_chat_template renders it, with the tokenizer's special tokens)")
    p.add_argument("--host", default="127.0.0.1", help="address for HTTP and gRPC (0.0.0.0 in a container)")
    p.add_argument("--port", "--http-port", type=int, default=8000, help="HTTP port (OpenAI-compatible API)")
    p.add_argument("--grpc-port", type=int, default=50051, help="public gRPC port (tandem.v1.Generate)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget of one target step (a decode costs 1 + k, prompt chunks fill the rest)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences running at once")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="longest sequence served (0: what the target and both KV caches allow)")
    p.add_argument("--max-waiting", type=int, default=d.max_waiting, help="queue length before 429")
    p.add_argument("--max-stored-responses", type=int, default=d.max_stored_responses,
                   help="Responses API answers kept in this router's memory for previous_response_id and "
                        "GET /v1/responses/{id} (the least recently stored go first); 0 keeps none")
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default=d.scheduling_policy,
                   help="fcfs: first come, first served (the newest running request is preempted when KV runs "
                        "out); priority: each request's `priority` (lower first, as vLLM's; ties by arrival) orders "
                        "the queue and prompt chunks, a waiting request preempts a running one of lower priority "
                        "when there is no room, and the lowest is preempted first")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="largest HTTP request body; a larger one gets 413 as soon as the limit is crossed")
    p.add_argument("--num-speculative-tokens", "--k-max", type=int, default=d.k_max,
                   help="largest speculation length k per sequence per step (0: no speculation)")
    p.add_argument("--no-dynamic-k", action="store_true",
                   help="always speculate --num-speculative-tokens (default: k per sequence from its acceptance "
                        "and the measured step costs)")
    p.add_argument("--no-pipeline", action="store_true", help="draft then target in sequence")
    p.add_argument("--no-chain-steps", action="store_true",
                   help="wait for each step's answer before sending the next (default, pipelined: a decode-only "
                        "step is sent while the one before it runs, with the draft's proposals keyed by that "
                        "step's outcome, so the target does not wait a round trip for the router)")
    p.add_argument("--no-chunked-prefill", action="store_true", help="whole prompts first (stalls decodes)")
    p.add_argument("--no-prompt-lookup", action="store_true",
                   help="never speculate with prompt lookup (by default a sequence the draft has no proposal for, "
                        "or every sequence when there is no draft, proposes what followed its last 2-4 tokens "
                        "earlier in its own history: vLLM's ngram speculation); a request's own `prediction` "
                        "(OpenAI's Predicted Outputs) is still proposed: its client asked for it")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="compute every prompt in full (default: sequences start from the KV blocks of their longest "
                        "prefix cached by each service, e.g. the earlier turns of a conversation)")
    p.add_argument("--tool-call-parser", choices=TOOL_PARSERS, default=None,
                   help="the served model's own tool-call format, which chat's tool_choice \"auto\" (OpenAI's default "
                        "when tools are given) needs: hermes = text, then <tool_call>{\"name\": ..., \"arguments\": "
                        "{...}}</tool_call> blocks (Qwen2.5, Hermes 2/3). Without it \"auto\" is a 400; a named "
                        "function and \"required\" need no parser (the output is constrained to the call)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="a reasoning model's thinking goes to chat's message.reasoning_content, apart from its "
                        "answer: deepseek_r1 = the output starts inside a <think> block its template opened, up to "
                        "</think> (DeepSeek-R1 and its distills); qwen3 = a block only where the output opens one "
                        "with <think> (Qwen3)")
    p.add_argument("--target-timeout", type=float, default=d.target_timeout_s, help="deadline of one Step (s)")
    p.add_argument("--draft-timeout", type=float, default=d.draft_timeout_s,
                   help="deadline of one draft call (s); past it the affected sequences run with k = 0")
    p.add_argument("--target-grace", type=float, default=d.target_grace_s,
                   help="how long requests wait for an unreachable target before 503 (s)")
    p.add_argument("--lease-ttl", type=float, default=d.lease_ttl_s,
                   help="ownership lease on each model replica (s): renewed every third of it; a router that dies "
                        "lets others take its replicas, and the replicas free its KV, after this long")
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout_s,
                   help="on SIGTERM (a rolling update, a scale-down), how long the requests in flight may finish "
                        "while new ones are refused (503 / UNAVAILABLE, /ready 503) before the rest are aborted (s); "
                        "0 aborts them at once. SIGINT (Ctrl-C), or a second signal, stops at once. Kubernetes: "
                        "terminationGracePeriodSeconds >= preStop sleep + this + a few seconds")
    p.add_argument("--startup-wait", type=float, default=300.0, help="how long to wait for the target at start (s)")
    p.add_argument("--log-level", default="INFO")
    add_log_args(p)
    add_tracing_args(p)
    add_security_args(p)
    return env_settable(p)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes,
        scheduling_policy=args.scheduling_policy, max_stored_responses=args.max_stored_responses,
        k_max=args.num_speculative_tokens,
        dynamic_k=not args.no_dynamic_k, pipeline=not args.no_pipeline, chunked_prefill=not args.no_chunked_prefill,
        chain_steps=not args.no_chain_steps,
        prompt_lookup=not args.no_prompt_lookup,
        prefix_caching=not args.no_prefix_caching,
        target_timeout_s=args.target_timeout, draft_timeout_s=args.draft_timeout, target_grace_s=args.target_grace,
        lease_ttl_s=args.lease_ttl, shutdown_timeout_s=args.shutdown_timeout, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser, chat_template=args.chat_template)


def main(argv: list[str] | None = None, prog: str = "python -m router") -> int:
    args = build_parser(prog).parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        config = config_from_args(args)
        security = security_from_args(args)
    except (ValueError, TLSError) as err:
        print(f"invalid configuration: {err}", file=sys.stderr)
        return 2
    if not (Path(args.tokenizer) / "tokenizer.json").is_file():
        print(f"--tokenizer {args.tokenizer}: no tokenizer.json there", file=sys.stderr)
        return 2
    if args.chat_template:
        try:
            compile_template(Path(args.chat_template).read_text())
        except (OSError, UnicodeDecodeError, jinja2.TemplateError) as err:
            print(f"--chat-template {args.chat_template}: {err}", file=sys.stderr)
            return 2
    endpoints = Endpoints(target=args.target, draft=args.draft, tokenizer_dir=args.tokenizer,
                          model_name=(args.served_model_name or [Path(args.tokenizer).resolve().name])[0],
                          host=args.host, http_port=args.port, grpc_port=args.grpc_port,
                          model_aliases=tuple(args.served_model_name[1:]))
    tracing = tracing_from_args(args, "tandem-router")
    if tracing is not None:
        config = dataclasses.replace(config, tracing=tracing)
    try:
        main_sync(config, endpoints, args.startup_wait, security)
    except (IncompatibleDraft, IncompatibleTarget, IncompatibleLimits, ServiceUnavailable) as err:
        logging.getLogger("router").error("%s", err)
        return 1
    finally:
        if tracing is not None:
            tracing.shutdown()  # export what is still buffered
    return 0


if __name__ == "__main__":
    sys.exit(main())
