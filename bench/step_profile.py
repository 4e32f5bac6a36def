"""Where one target step's time goes, without gRPC: the service's own step (TargetServicer.step, what
Step runs) split into its forward_ms, the runner's forward and the model alone, for B sequences
decoding at k = 0 or verifying k drafts, alone or beside a prompt chunk of C tokens (the mixed step of
chunked prefill), over CUDA graphs and eagerly.

    python -m bench.step_profile --model models/demo/target [--batches 1,16] [--ks 0,4] [--chunks 0,128]

The model's time is taken with the device synchronized before and after it (on a GPU: what it
computes plus its kernel launches); `host` is the rest of the step, work that a faster host or
fewer launches would save. `make gpu-check` runs it on each pair present: on an H200 a demo decode
step took ~3 ms at c=1 through the whole stack, and c=16 steps with prompt chunks 72-78 ms against
24 ms without (docs/gpu.md); this says where.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.v1 import common_pb2, target_pb2

PROMPT_LEN = 64
CHUNKED_SEQ = 10_000  # the seq_id of the prompt whose chunks run beside the decodes


@dataclass(frozen=True)
class StepTimes:
    path: str  # "graphs" | "eager"
    batch: int
    k: int
    chunk: int  # prompt tokens beside the decodes (0: decodes only)
    step_ms: float  # TargetServicer.step, parse to response
    forward_ms: float  # what the service reports (the router's "target" part)
    runner_ms: float  # ModelRunner.forward: validate, prepare, execute
    model_ms: float  # ModelRunner.execute, synchronized: the model's work on the device
    replayed: float  # share of steps served by a captured graph

    @property
    def host_ms(self) -> float:
        return self.step_ms - self.model_ms

    def row(self) -> str:
        return (f"| {self.path} | {self.batch} | {self.k} | {self.chunk} | {self.step_ms:.3f} | "
                f"{self.forward_ms:.3f} | {self.runner_ms:.3f} | {self.model_ms:.3f} | {self.host_ms:.3f} | "
                f"{self.replayed:.0%} |")


HEADER = ("| path | B | k | chunk | step ms | forward_ms | runner ms | model ms | host ms | graph replays |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def _synchronized(device: torch.device, fn: Callable, spent: list[float]) -> Callable:
    def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        spent.append((time.perf_counter() - t0) * 1000)
        return out

    return timed


def profile(model: str, device: str, eager: bool, batches: list[int], ks: list[int], steps: int,
            chunks: tuple[int, ...] = (0,), repeats: int = 1) -> list[StepTimes]:
    """One service (as `python -m target_service` builds it) and, per (B, k, chunk), `steps` measured
    steps after a few unmeasured ones; the whole grid `repeats` times over (a row each time), so that
    a drift in the machine's speed spreads over every size instead of landing on one."""
    from engine.service import load_runner
    from target_service.__main__ import build_parser
    from target_service.server import create_servicer

    argv = ["--model", model, "--device", device, "--log-level", "WARNING", "--max-draft-tokens", str(max(ks))]
    runner = load_runner(build_parser().parse_args(argv + (["--enforce-eager"] if eager else [])))
    servicer = create_servicer(runner, "profile", max(ks))
    path = "graphs" if runner.graphs is not None else "eager"
    spent_runner: list[float] = []
    spent_model: list[float] = []
    runner.forward = _synchronized(runner.device, runner.forward, spent_runner)
    runner.execute = _synchronized(runner.device, runner.execute, spent_model)
    greedy = common_pb2.SamplingParams(temperature=0.0)
    vocab = runner.model_config.vocab_size
    g = torch.Generator().manual_seed(0)

    def random_tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    out = []
    for b in [b for _ in range(repeats) for b in batches]:
        for k in ks:
            for chunk in chunks:
                ids = list(range(1, b + 1))
                servicer.worker.release([*ids, CHUNKED_SEQ])
                prompts = [target_pb2.StepEntry(seq_id=s, start_pos=0, emit=True, sampling=greedy, logprobs=-1,
                                                tokens=random_tokens(PROMPT_LEN)) for s in ids]
                res = servicer.step(target_pb2.StepRequest(entries=prompts)).results
                state = {r.seq_id: (r.cached_len, r.tokens[-1]) for r in res}
                chunked = 0  # prompt tokens the chunked sequence holds
                times: list[tuple[float, float]] = []
                replays = runner.graphs.runs if runner.graphs is not None else 0
                for n in range(steps + 5):
                    if n == 5:
                        spent_runner.clear()
                        spent_model.clear()
                        replays = runner.graphs.runs if runner.graphs is not None else 0
                    entries = [target_pb2.StepEntry(
                        seq_id=s, start_pos=state[s][0], tokens=[state[s][1], *random_tokens(k)], num_draft_tokens=k,
                        emit=True, sampling=greedy, logprobs=-1) for s in ids]
                    if chunk:
                        if chunked + chunk > runner.max_model_len - 1:  # a new prompt, as the next request's
                            servicer.worker.release([CHUNKED_SEQ])
                            chunked = 0
                        entries.append(target_pb2.StepEntry(seq_id=CHUNKED_SEQ, start_pos=chunked, emit=False,
                                                            tokens=random_tokens(chunk), sampling=greedy, logprobs=-1))
                        chunked += chunk
                    t0 = time.perf_counter()
                    response = servicer.step(target_pb2.StepRequest(entries=entries))
                    if n >= 5:
                        times.append(((time.perf_counter() - t0) * 1000, response.forward_ms))
                    state = {r.seq_id: (r.cached_len, r.tokens[-1]) for r in response.results if r.seq_id in state}
                ran = (runner.graphs.runs - replays) if runner.graphs is not None else 0
                out.append(StepTimes(path, b, k, chunk, statistics.mean(t for t, _ in times),
                                     statistics.mean(f for _, f in times), statistics.mean(spent_runner),
                                     statistics.mean(spent_model), ran / steps))
    servicer.worker.release([*range(1, max(batches) + 1), CHUNKED_SEQ])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the target model directory")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, ...")
    p.add_argument("--batches", default="1,16", help="sequences per step, comma-separated")
    p.add_argument("--ks", default="0,4", help="draft tokens verified per sequence, comma-separated")
    p.add_argument("--chunks", default="0",
                   help="prompt tokens of a chunk beside the decodes, comma-separated (0: decodes only); "
                        "e.g. 0,128 adds the mixed steps of chunked prefill")
    p.add_argument("--steps", type=int, default=40, help="measured steps per (B, k), after 5 unmeasured")
    p.add_argument("--repeats", type=int, default=1, help="run the whole grid this many times (a row each)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches, ks = [int(x) for x in args.batches.split(",")], [int(x) for x in args.ks.split(",")]
    chunks = tuple(int(x) for x in args.chunks.split(","))
    cuda = torch.cuda.is_available() and args.device in ("auto", "cuda") or args.device.startswith("cuda")
    print(f"step profile of {args.model}: means over {args.steps} steps, prompts of {PROMPT_LEN} tokens\n")
    print(HEADER)
    for eager in ([False, True] if cuda else [True]):
        for t in profile(args.model, args.device, eager, batches, ks, args.steps, chunks, args.repeats):
            print(t.row(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
