"""The e2e stack: target, draft and router as three real processes (router.launch.Stack) on free
loopback ports, driven only through the public doors. TANDEM_E2E_MODELS names the model pair.

Against a cluster (`make e2e-test K8S=1`): TANDEM_E2E_K8S=1, the router reachable at
TANDEM_E2E_URL (HTTP) and TANDEM_E2E_GRPC (host:port), e.g. through
`kubectl -n tandem port-forward svc/router 8000:8000 50051:50051`, and TANDEM_E2E_MODELS a local
copy of the deployed pair (the reference). Faults are injected by deleting pods with kubectl
(KUBECONFIG names the cluster); the Deployments bring them back.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from router.launch import Stack, free_port


@pytest.fixture(scope="session")
def models_dir() -> Path:
    path = Path(os.environ.get("TANDEM_E2E_MODELS", "models/tiny"))
    if not (path / "target" / "config.json").is_file():
        pytest.fail(f"no models in {path}: run `make models-tiny` (make e2e-test does it)")
    return path


class ClusterStack:
    """The same surface as router.launch.Stack, over a deployed Tandem (namespace `tandem`)."""

    def __init__(self, models: Path) -> None:
        self.models = models
        self.url = os.environ["TANDEM_E2E_URL"].rstrip("/")
        self.grpc_address = os.environ["TANDEM_E2E_GRPC"]
        self.grpc_port = int(self.grpc_address.rsplit(":", 1)[1])
        self.served_name = os.environ.get("TANDEM_E2E_MODEL_NAME", "tandem")

    def _kubectl(self, *args: str) -> None:
        subprocess.run(["kubectl", "-n", "tandem", *args], check=True, timeout=600)

    def kill(self, name: str, sig: int = 9) -> None:
        self._kubectl("delete", "pod", "-l", f"app.kubernetes.io/component={name}", "--grace-period=0", "--force",
                      "--wait=false")

    def start_service(self, name: str) -> None:
        pass  # the Deployment recreates the pod

    def wait_service(self, name: str, timeout: float = 600) -> None:
        time.sleep(2)
        self._kubectl("rollout", "status", f"deployment/{name}", f"--timeout={int(timeout)}s")


@pytest.fixture(scope="session")
def stack(models_dir, tmp_path_factory):
    if os.environ.get("TANDEM_E2E_K8S") == "1":
        yield ClusterStack(models_dir)
        return
    logs = tmp_path_factory.mktemp("logs")
    s = Stack(models_dir / "target", models_dir / "draft", served_model_name=models_dir.name,
              http_port=free_port(), grpc_port=free_port(), target_port=free_port(), draft_port=free_port(),
              log_dir=logs,
              service_args=["--num-blocks", "512", "--threads", "1"],
              router_args=["--max-num-batched-tokens", "128", "--max-num-seqs", "32", "--draft-timeout", "2",
                           "--target-grace", "60", "--max-waiting", "512"])
    s.start(timeout=120)
    yield s
    codes = s.stop()
    bad = {n: c for n, c in codes.items() if c != 0}
    assert not bad, f"unclean shutdown {bad}; logs in {logs}"


class Reference:
    """transformers on the target checkpoint: the independent reference."""

    def __init__(self, target_dir: Path) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self._cache: dict[tuple, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text).input_ids

    def greedy(self, prompt_ids: list[int], n: int) -> list[int]:
        key = (tuple(prompt_ids), n)
        if key not in self._cache:
            with torch.no_grad():
                out = self.model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                                          attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                          pad_token_id=0, eos_token_id=None)
            self._cache[key] = out[0, len(prompt_ids):].tolist()
        return self._cache[key]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def logprobs(self, ids: list[int], start: int) -> list[float]:
        """Log-probability of each token ids[start:] given its prefix."""
        with torch.no_grad():
            logp = self.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        return [logp[i - 1, ids[i]].item() for i in range(start, len(ids))]


@pytest.fixture(scope="session")
def ref(models_dir) -> Reference:
    return Reference(models_dir / "target")
