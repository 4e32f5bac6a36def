"""gRPC scaffolding both model services run: CLI flags, the model worker thread, health, reflection
and graceful shutdown (what each RPC handler shares: engine/rpc.py). The services add only their own
RPC logic."""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import functools
import logging
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.logs import add_log_args, setup_logging
from common.protocol import PROTOCOL
from common.reload import reload_on_sighup
from common.tokenizer import eos_token_ids, tokenizer_fingerprint
from common.tracing import add_tracing_args
from engine.config import DTYPES, EngineConfig, ModelConfig, compute_id
from engine.flash_attention import uses_flash
from engine.kv_cache import PagedKVCache
from engine.lease import LeaseKeeper
from engine.parallel import SINGLE, TensorParallel
from engine.rpc_trace import on_model_thread
from engine.runner import InvalidInput, ModelRunner
from engine.transport import Transport, add_transport_args, open_ports
from tandem.v1 import common_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")
FULL_LENGTH_SEQUENCES = 2  # the default KV cache holds this many sequences of max_model_len tokens



def add_model_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face model directory (config.json + *.safetensors)")
    parser.add_argument("--model-id", default="", help="name reported by GetInfo (default: the directory name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in a container)")
    parser.add_argument("--port", type=int, default=default_port, help="gRPC port")
    kv = parser.add_mutually_exclusive_group()
    kv.add_argument("--num-blocks", type=int, default=0, help="KV cache size in blocks")
    kv.add_argument("--kv-cache-gib", type=float, default=0.0,
                    help="KV cache size as a memory budget in GiB (default, when neither is given: room for "
                         f"{FULL_LENGTH_SEQUENCES} sequences of max-model-len tokens, and at least 0.25 GiB)")
    parser.add_argument("--block-size", type=int, default=0,
                        help="tokens per KV block (default 16; 256 with flash-attn)")
    parser.add_argument("--max-batch-tokens", type=int, default=4096, help="most tokens one forward pass accepts")
    parser.add_argument("--max-model-len", type=int, default=0, help="longest sequence (default: the checkpoint's)")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                        help="auto = bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "flash"],
                        help="auto = flash-attn on CUDA with float16/bfloat16 when it imports, else PyTorch SDPA")
    parser.add_argument("--max-draft-tokens", type=int, default=8, help="largest k per sequence per call")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="do not keep final KV blocks by content hash for reuse by later sequences (default: "
                             "kept, and evicted least recently used first when space is needed)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs (by default, on CUDA, decode/verify steps replay graphs captured "
                             "per batch-size bucket at start-up)")
    parser.add_argument("--cuda-graph-max-batch", type=int, default=64,
                        help="sequences in the largest captured decode/verify step; larger steps run eagerly")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--grace-seconds", type=float, default=10.0,
                        help="on SIGTERM, how long the step in flight may take to finish")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING")
    add_log_args(parser)
    add_tracing_args(parser)
    add_transport_args(parser)




def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    probe = EngineConfig(dtype=args.dtype, device=args.device, attention_backend=args.attention_backend)
    device = probe.resolved_device()
    flash = uses_flash(args.attention_backend, device, probe.resolved_dtype())
    block_size = args.block_size or (256 if flash else 16)  # flash-attn's paged kernels need 256-token pages
    num_blocks = args.num_blocks
    if not num_blocks:
        mc = ModelConfig.from_dir(args.model)
        kv_heads = mc.num_kv_heads // getattr(args, "tensor_parallel_size", 1)  # per rank under TP
        per_block = PagedKVCache.bytes_per_block(mc.num_layers, block_size, kv_heads, mc.head_dim,
                                                 probe.resolved_dtype())
        if args.kv_cache_gib:
            num_blocks = max(1, int(args.kv_cache_gib * 2**30 // per_block))
        else:  # what /v1/models advertises must fit: whole-context sequences, not a fixed budget
            max_len = args.max_model_len or mc.max_position_embeddings
            whole = FULL_LENGTH_SEQUENCES * -(-(max_len + args.max_draft_tokens + 1) // block_size)
            num_blocks = max(whole, int(0.25 * 2**30 // per_block))
    return EngineConfig(num_blocks=num_blocks, block_size=block_size, dtype=args.dtype, device=args.device,
                        max_model_len=args.max_model_len, max_batch_tokens=args.max_batch_tokens,
                        attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
                        cuda_graph_max_batch=args.cuda_graph_max_batch,
                        cuda_graph_max_query=max(1, args.max_draft_tokens + 1),
                        prefix_caching=not getattr(args, "no_prefix_caching", False))


def checked_engine_config(args: argparse.Namespace) -> EngineConfig:
    try:
        return engine_config_from_args(args)
    except ValueError as e:  # a setting the hardware cannot honour: say which, without a traceback
        raise SystemExit(f"error: {e}") from None


def model_thread(threads: int = 0) -> ThreadPoolExecutor:
    """The one thread that does a service's torch work: the load (with its timing of the CPU's products),
    then every model call. One, because torch's CPU ops split over an OpenMP team per calling thread: a
    second team (the event loop's, once it ran a forward or the load) makes libgomp count more threads than
    cores and stop spinning between parallel regions, and a SmolLM2 decode on two threads took 47 ms
    instead of 31 (docs/benchmarks-history.md). threads: torch's CPU threads there (0: its default)."""
    threads = threads or torch.get_num_threads()
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="model", initializer=torch.set_num_threads,
                              initargs=(threads,))


def load_runner(args: argparse.Namespace, tp: TensorParallel = SINGLE,
                config: EngineConfig | None = None, thread: ThreadPoolExecutor | None = None) -> ModelRunner:
    """thread: the model thread to load on (model_thread(); ModelWorker then runs every call there)."""
    setup_logging(args.log_level, args.log_format)
    reload_on_sighup()  # already while the model loads; serve() hands it to its event loop
    if args.threads:
        torch.set_num_threads(args.threads)
    config = config or checked_engine_config(args)
    if thread is None:
        runner = ModelRunner.load(args.model, config, tp)
    else:
        runner = thread.submit(contextvars.copy_context().run, ModelRunner.load, args.model, config, tp).result()
    cfg = runner.config
    log.info("KV cache: %d blocks x %d tokens = %d tokens%s; max_model_len %d; backend %s; dtype %s; device %s; %s",
             cfg.num_blocks, cfg.block_size, cfg.num_blocks * cfg.block_size,
             ", prefix caching" if cfg.prefix_caching else "", runner.max_model_len,
             runner.backend.name, runner.dtype, runner.device,
             "CUDA graphs" if runner.graphs is not None else "eager")
    return runner


INLINE_TOKENS = 64  # a step of at most this many tokens may run on the event loop (ModelWorker.run)


def inline_tokens(device: torch.device) -> int:
    """The largest step ModelWorker.run may run on the event loop: on CPU with one torch thread only (with
    more, a second OpenMP team slows every product: model_thread()); a GPU's work is queued asynchronously
    anyway, and CUDA streams are per thread."""
    return INLINE_TOKENS if device.type == "cpu" and torch.get_num_threads() == 1 else 0


class ModelWorker:
    """Runs model work on one dedicated thread, so forwards never overlap and the event loop
    stays free for health checks and new calls while a step computes."""

    def __init__(self, runner: ModelRunner, model_id: str, max_draft_tokens: int,
                 thread: ThreadPoolExecutor | None = None) -> None:
        self.runner = runner
        self.model_id = model_id or Path(str(runner.model_dir)).name
        self.max_draft_tokens = max_draft_tokens
        self.fingerprint = tokenizer_fingerprint(runner.model_dir) if runner.model_dir else ""
        self.eos_ids = eos_token_ids(runner.model_dir) if runner.model_dir else []
        self.compute_id = compute_id(runner.device)
        self._thread = thread or model_thread()  # the one the model loaded on, where it has one
        self.in_flight = 0
        self.inline_tokens = inline_tokens(runner.device)
        self.lease = LeaseKeeper(self._free_all)
        self.on_release: list[Callable[[list[int]], None]] = []  # state kept beside the KV (engine/logits.py)

    async def run(self, fn: Callable[..., T], *args: Any, tokens: int | None = None) -> T:
        """fn(*args) on the model thread. tokens: the size of a step; one of at most inline_tokens (CPU,
        one torch thread) runs on the event loop itself when nothing else is queued for the model thread (so still one
        model call at a time): two thread hand-offs fewer per step, the loop held no longer than a
        decode step."""
        self.in_flight += 1
        try:  # in a copy of the caller's context: its log fields and trace span reach the thread
            call = on_model_thread(functools.partial(fn, *args))
            if tokens is not None and tokens <= self.inline_tokens and self.in_flight == 1:
                return call()
            return await asyncio.get_running_loop().run_in_executor(self._thread, contextvars.copy_context().run, call)
        finally:
            self.in_flight -= 1

    def info(self) -> common_pb2.ModelInfo:
        r = self.runner
        return common_pb2.ModelInfo(
            protocol=PROTOCOL, model_id=self.model_id, vocab_size=r.model_config.vocab_size,
            tokenizer_fingerprint=self.fingerprint, max_model_len=r.max_model_len,
            num_blocks=r.config.num_blocks, block_size=r.config.block_size, free_blocks=r.blocks.num_free,
            dtype=str(r.dtype).removeprefix("torch."), device=str(r.device), attention_backend=r.backend.name,
            max_draft_tokens=self.max_draft_tokens, max_batch_tokens=r.config.max_batch_tokens,
            eos_token_ids=self.eos_ids, num_sequences=r.blocks.num_sequences, compute_id=self.compute_id,
            prefix_caching=r.blocks.caching, lora_adapters=sorted(r.adapters),
            lora=[r.adapters[name].info() for name in sorted(r.adapters)],
        )

    def release(self, seq_ids: list[int]) -> int:
        self.runner.release(seq_ids)
        for hook in self.on_release:
            hook(seq_ids)
        return self.runner.blocks.num_free

    async def _free_all(self) -> None:
        await self.run(lambda: self.release(list(self.runner.blocks.sequences())))

    async def lease_rpc(self, request: common_pb2.LeaseRequest) -> common_pb2.LeaseResponse:
        try:
            return await self.lease.handle(request)
        except ValueError as e:
            raise InvalidInput("lease", str(e)) from None


async def serve(
    register: Callable[[grpc.aio.Server], None],
    service_full_name: str,
    host: str,
    port: int,
    grace_seconds: float,
    stop: asyncio.Event | None = None,
    on_started: Callable[[int], None] | None = None,
    transport: Transport | None = None,
    on_shutdown: Callable[[], None] = lambda: None,
) -> None:
    """Run a gRPC server with health and reflection until SIGTERM/SIGINT (or `stop` is set,
    for in-process use), then refuse new calls, let the one in flight finish and stop.
    transport: TLS and a health-only port (default: plaintext, no health-only port).
    on_shutdown: called as shutdown begins (the target ends its open step streams)."""
    transport = transport or Transport()
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 * 2**20)])
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((service_full_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound, probes = await open_ports(server, health_servicer, host, port, transport)
    await server.start()
    for name in ("", service_full_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %s on %s:%d (%s)", service_full_name, host, bound, transport.describe())
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        reload_on_sighup(loop)
    if on_started is not None:
        on_started(bound)
    await stop.wait()
    t0 = time.perf_counter()
    log.info("shutting down: not serving new calls, letting the one in flight finish (up to %.0fs)", grace_seconds)
    await health_servicer.enter_graceful_shutdown()
    on_shutdown()
    await server.stop(grace_seconds)
    if probes is not None:
        await probes.stop(0)
    log.info("stopped in %.2fs", time.perf_counter() - t0)
