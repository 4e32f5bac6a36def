"""Run a file of requests in OpenAI's Batch format through a router, as vLLM's run_batch does.

    tandem batch -i requests.jsonl -o results.jsonl --url http://127.0.0.1:8000   # a running router
    tandem batch -i requests.jsonl -o results.jsonl models/smollm2                  # a stack started for the run
    tandem batch -i requests.jsonl -o results.jsonl --url URL --resume              # finish an interrupted run

Each input line is one request, as OpenAI's Batch API takes them:

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...]}}

url: /v1/chat/completions, /v1/completions, /v1/responses or /v1/messages; a body without "model"
gets the router's served model. The whole file is checked before anything is sent (custom_ids
unique, no streaming), so a bad line costs nothing. Each answer is one output line, in the order
answers come, written as it comes:

    {"id": "batch_req_...", "custom_id": "q1", "response": {"status_code": 200, "request_id": "...",
     "body": {...}}, "error": null}

An answer with an error status (a 400 naming a bad field) is a result like any other; a request the
router could not take for now (429, 503: overloaded, draining) is retried after its Retry-After, and
one that never got an answer (connection lost past --max-retries) has "response": null and its
"error". An interrupted run keeps every line written: --resume runs only the custom_ids the output
lacks. Exit 0 when every request got an answer, 1 when some did not, 2 for a bad input file.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tqdm import tqdm

from common.cli import Secret, env_settable

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
RETRY_STATUS = (429, 503)  # refused for now: the router's queue is full, it is starting or draining


class BatchFileError(ValueError):
    """A line of the input file that cannot run, named by file and line."""


@dataclass(frozen=True)
class BatchRequest:
    custom_id: str
    url: str
    body: dict


def read_requests(path: Path, lines: IO[str]) -> list[BatchRequest]:
    out: list[BatchRequest] = []
    seen: set[str] = set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        at = f"{path}:{n}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise BatchFileError(f"{at}: not JSON ({err.msg})") from None
        if not isinstance(item, dict):
            raise BatchFileError(f"{at}: a line is one JSON object")
        custom_id, method, url, body = (item.get(k) for k in ("custom_id", "method", "url", "body"))
        if not isinstance(custom_id, str) or not custom_id:
            raise BatchFileError(f"{at}: custom_id must be a non-empty string")
        if custom_id in seen:
            raise BatchFileError(f"{at}: custom_id {custom_id!r} is used twice")
        if method != "POST":
            raise BatchFileError(f"{at}: method must be \"POST\"")
        if url not in URLS:
            raise BatchFileError(f"{at}: url must be one of {', '.join(URLS)}")
        if not isinstance(body, dict):
            raise BatchFileError(f"{at}: body must be a JSON object (the request)")
        if body.get("stream") or body.get("background"):
            raise BatchFileError(f"{at}: a batch request is answered whole: no stream or background")
        seen.add(custom_id)
        out.append(BatchRequest(custom_id, url, body))
    if not out:
        raise BatchFileError(f"{path}: no requests")
    return out


def answered(path: Path) -> dict[str, str]:
    """custom_id -> output line of the requests an earlier run answered (not: a line cut short by an
    interruption, a request that got no answer)."""
    done = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("response") is not None:
            done[record.get("custom_id")] = line
    return done


class Client:
    """POSTs to one router, retrying what it refuses for now and connections it loses."""

    def __init__(self, base: str, api_key: str | None, timeout_s: float, max_retries: int) -> None:
        self.base, self.timeout_s, self.max_retries = base.rstrip("/"), timeout_s, max_retries
        self.headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"}
                                                              if api_key else {})

    def get(self, path: str) -> dict:
        request = urllib.request.Request(self.base + path, headers=self.headers)
        with urllib.request.urlopen(request, timeout=self.timeout_s) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict, request_id: str) -> tuple[int, dict, str]:
        """(status, JSON body, request id) of the answer; OSError once the retries are spent. request_id:
        sent as X-Request-Id, so the router's logs and traces name the request by its output line's id."""
        data = json.dumps(body).encode()
        headers = self.headers | {"X-Request-Id": request_id}
        for attempt in range(self.max_retries + 1):
            try:
                request = urllib.request.Request(self.base + path, data=data, headers=headers, method="POST")
                with urllib.request.urlopen(request, timeout=self.timeout_s) as r:
                    return r.status, json.loads(r.read()), r.headers.get("x-request-id", "")
            except urllib.error.HTTPError as err:
                if err.code not in RETRY_STATUS or attempt == self.max_retries:
                    return err.code, _json(err.read()), err.headers.get("x-request-id", "")
                wait = _seconds(err.headers.get("Retry-After")) or 2.0 ** attempt
            except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
                if attempt == self.max_retries:
                    raise OSError(getattr(err, "reason", err)) from None
                wait = 2.0 ** attempt
            time.sleep(min(wait, 30.0))
        raise AssertionError("unreachable: the last attempt returns or raises")


def _seconds(retry_after: str | None) -> float:
    try:
        return float(retry_after or 0)
    except ValueError:  # an HTTP date: not what the router sends
        return 0.0


def _json(raw: bytes) -> dict:
    try:
        out = json.loads(raw)
    except ValueError:
        return {"error": {"message": raw.decode("utf-8", "replace")[:1000]}}
    return out if isinstance(out, dict) else {"body": out}


def run(client: Client, requests: list[BatchRequest], out: IO[str], concurrency: int, model: str,
        progress: bool = True) -> dict[str, int]:
    """Run every request, `concurrency` at a time, one output line each as it is answered."""
    lock = threading.Lock()
    counts = {"ok": 0, "error_status": 0, "unanswered": 0, "completion_tokens": 0}
    bar = tqdm(total=len(requests), desc="batch", unit="req", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)

    def one(req: BatchRequest) -> None:
        body = req.body if "model" in req.body else {"model": model, **req.body}
        record: dict = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": req.custom_id}
        try:
            status, answer, request_id = client.post(req.url, body, record["id"])
            record |= {"response": {"status_code": status, "request_id": request_id or answer.get("id", ""),
                                    "body": answer}, "error": None}
            kind = "ok" if status < 300 else "error_status"
        except OSError as err:
            record |= {"response": None, "error": {"code": "connection_error", "message": str(err)}}
            kind = "unanswered"
        usage = (record.get("response") or {}).get("body", {}).get("usage") or {}
        with lock:
            out.write(json.dumps(record) + "\n")
            out.flush()
            counts[kind] += 1
            counts["completion_tokens"] += usage.get("completion_tokens", usage.get("output_tokens", 0))
            bar.update(1)
            bar.set_postfix(errors=counts["error_status"], unanswered=counts["unanswered"], refresh=False)

    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        futures = [pool.submit(one, r) for r in requests]
        try:
            for future in as_completed(futures):
                future.result()
        except KeyboardInterrupt:  # what runs ends and is written; nothing new starts
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        finally:
            bar.close()
    return counts


def build_parser(prog: str = "tandem batch") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", type=Path, default=None,
                   help="start a stack on this model (a pair directory, as tandem serve takes it) for the run; "
                        "or give --url")
    p.add_argument("-i", "--input", type=Path, required=True, help="the requests, one JSON object per line")
    p.add_argument("-o", "--output", type=Path, required=True,
                   help="where the answers go, one JSON object per line (refused if it holds answers already, "
                        "unless --resume)")
    p.add_argument("--url", default="", help="a running router's HTTP address, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", type=Secret, default=None,
                   help="the router's API key, if it asks for one (from the environment as the router reads its "
                        "keys: the first of a comma-separated list)")
    p.add_argument("--resume", action="store_true",
                   help="append to --output, running only the custom_ids it has no answer for")
    p.add_argument("--concurrency", type=int, default=16,
                   help="requests in flight at once (the router batches them into its steps)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--max-retries", type=int, default=5,
                   help="tries after a lost connection or a 429 / 503 (the router's queue full, starting or "
                        "draining), waiting its Retry-After or 1, 2, 4 ... s")
    p.add_argument("--served-model-name", default="",
                   help="with MODEL: the model name requests give (default: the pair directory's name, as tandem "
                        "serve; a body without \"model\" gets it)")
    p.add_argument("--no-draft", action="store_true", help="with MODEL: no draft service")
    p.add_argument("--router-arg", action="append", default=[], help="with MODEL: extra router flag (repeat)")
    p.add_argument("--service-arg", action="append", default=[], help="with MODEL: extra flag for both services")
    return env_settable(p)


def main(argv: list[str] | None = None, prog: str = "tandem batch") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if (args.model is None) == (not args.url):
        parser.error("give a model directory to start a stack for the run, or --url of a running router")
    try:
        with args.input.open(encoding="utf-8") as lines:
            requests = read_requests(args.input, lines)
    except (OSError, BatchFileError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    done = answered(args.output) if args.output.is_file() else {}
    if done and not args.resume:
        print(f"error: {args.output} holds {len(done)} answers already: --resume runs only the requests it "
              f"lacks; remove it to start over", file=sys.stderr)
        return 2
    todo = [r for r in requests if r.custom_id not in done]
    if done:
        print(f"resuming: {len(done)} of {len(requests)} answered already, {len(todo)} to run", file=sys.stderr)
    if not todo:
        return 0
    try:
        stack = _stack(args) if args.model is not None else None
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError) as err:
        print(f"error: the stack did not start: {err}", file=sys.stderr)
        return 1
    try:
        url = stack.url if stack is not None else args.url
        key = args.api_key.split(",")[0].strip() if args.api_key else None
        client = Client(url, key, args.timeout, args.max_retries)
        try:
            model = client.get("/v1/models")["data"][0]["id"]
        except urllib.error.HTTPError as err:
            why = _json(err.read()).get("error", {}).get("message", "")
            print(f"error: the router at {url} refused /v1/models: {err.code} {why}"
                  + (" (give its key: --api-key)" if err.code == 401 else ""), file=sys.stderr)
            return 1
        except (OSError, ValueError, KeyError, IndexError) as err:
            print(f"error: no router answers /v1/models at {url} ({err})", file=sys.stderr)
            return 1
        t0 = time.perf_counter()
        if args.resume and args.output.is_file():  # the answers kept, one line each: no cut line, no
            # earlier "no answer" for a request that runs again
            kept = args.output.with_name(args.output.name + ".kept")
            kept.write_text("".join(line + "\n" for line in done.values()), encoding="utf-8")
            kept.replace(args.output)
        with args.output.open("a" if args.resume else "w", encoding="utf-8") as out:
            counts = run(client, todo, out, args.concurrency, model, progress=sys.stderr.isatty())
        seconds = time.perf_counter() - t0
    except KeyboardInterrupt:
        print(f"\ninterrupted: the answers so far are in {args.output}; --resume runs the rest", file=sys.stderr)
        return 130
    finally:
        if stack is not None:
            stack.stop()
    print(f"{len(todo)} requests in {seconds:.1f} s ({counts['completion_tokens'] / seconds:.1f} output tokens/s): "
          f"{counts['ok']} answered, {counts['error_status']} with an error status, {counts['unanswered']} not "
          f"answered -> {args.output}", file=sys.stderr)
    return 1 if counts["unanswered"] else 0


def _stack(args: argparse.Namespace):  # noqa: ANN202 (router.stack imports subprocess machinery: only when asked)
    from router.launch import resolve_models
    from router.stack import Stack, stack_ports

    target_dir, draft_dir = resolve_models(args.model, None, args.no_draft)
    pair_name = args.model.resolve().name if target_dir.parent.resolve() == args.model.resolve() else ""
    logs = Path(tempfile.mkdtemp(prefix="tandem-batch-"))
    stack = Stack(target_dir, draft_dir, served_model_name=args.served_model_name or pair_name, log_dir=logs,
                  service_args=args.service_arg, router_args=args.router_arg, **stack_ports())
    print(f"starting a stack on {args.model} (logs in {logs}) ...", file=sys.stderr, flush=True)
    try:
        stack.start()
    except BaseException:
        stack.stop()
        raise
    return stack


if __name__ == "__main__":
    sys.exit(main(prog="python -m router.batch"))
