"""The e2e stack: target, draft and router as three real processes (router.stack.Stack) on free
loopback ports, driven only through the public doors. TANDEM_E2E_MODELS names the model pair.

Against a cluster (`make e2e-test K8S=1`): TANDEM_E2E_K8S=1, the router reachable at
TANDEM_E2E_URL (HTTP) and TANDEM_E2E_GRPC (host:port), e.g. through
`kubectl -n tandem port-forward svc/router 8000:8000 50051:50051`, and TANDEM_E2E_MODELS a local
copy of the deployed pair (the reference). Faults are injected by deleting pods with kubectl
(KUBECONFIG names the cluster); the Deployments bring them back. TANDEM_E2E_API_KEY is the key
the deployment expects (Secret tandem-api-keys); TANDEM_E2E_CA the CA of an HTTPS router.

Clients reach either kind of stack through http_client(), grpc_channel() and auth_metadata(),
which carry the API key and the TLS settings a stack needs. `secure_stack` is the local stack
with TLS on every link and an API key (test_e2e_secure.py).
"""

from __future__ import annotations

import os
import ssl
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.tls import TLSFiles
from router.stack import Stack, free_port


@pytest.fixture(scope="session")
def models_dir() -> Path:
    path = Path(os.environ.get("TANDEM_E2E_MODELS", "models/tiny"))
    if not (path / "target" / "config.json").is_file():
        pytest.fail(f"no models in {path}: run `make models-tiny` (make e2e-test does it)")
    return path


class ClusterStack:
    """The same surface as router.stack.Stack, over a deployed Tandem (namespace `tandem`)."""

    def __init__(self, models: Path) -> None:
        self.models = models
        self.url = os.environ["TANDEM_E2E_URL"].rstrip("/")
        self.grpc_address = os.environ["TANDEM_E2E_GRPC"]
        self.grpc_port = int(self.grpc_address.rsplit(":", 1)[1])
        self.served_name = os.environ.get("TANDEM_E2E_MODEL_NAME", "tandem")
        self.api_key = os.environ.get("TANDEM_E2E_API_KEY", "")
        self.https = self.url.startswith("https://")
        self.probe_tls = TLSFiles(ca=Path(os.environ["TANDEM_E2E_CA"])) if os.environ.get("TANDEM_E2E_CA") else None

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.https:
            return None
        return ssl.create_default_context(cafile=str(self.probe_tls.ca) if self.probe_tls else None)

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


@dataclass
class SecureStack(Stack):
    api_key: str = ""
    pki: dict = field(default_factory=dict)


def http_client(stack, timeout: float = 120) -> httpx.Client:  # noqa: ANN001
    key = getattr(stack, "api_key", "")
    return httpx.Client(verify=stack.ssl_context() or True, timeout=timeout,
                        headers={"Authorization": f"Bearer {key}"} if key else {})


def auth_metadata(stack) -> tuple:  # noqa: ANN001
    key = getattr(stack, "api_key", "")
    return (("authorization", f"Bearer {key}"),) if key else ()


def grpc_channel(stack) -> grpc.Channel:  # noqa: ANN001
    address = getattr(stack, "grpc_address", f"127.0.0.1:{stack.grpc_port}")
    if not stack.https:
        return grpc.insecure_channel(address)
    tls = stack.probe_tls
    pem = [p.read_bytes() if p else None for p in ((tls.ca, tls.key, tls.cert) if tls else ())]
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(*pem))


@pytest.fixture(scope="session")
def stack(models_dir, tmp_path_factory):
    if os.environ.get("TANDEM_E2E_K8S") == "1":
        yield ClusterStack(models_dir)
        return
    from tests.test_lora import write_adapter

    logs = tmp_path_factory.mktemp("logs")
    adapter = write_adapter(models_dir / "target", tmp_path_factory.mktemp("lora") / "sql", seed=0)
    s = Stack(models_dir / "target", models_dir / "draft", served_model_name=models_dir.name,
              http_port=free_port(), grpc_port=free_port(), target_port=free_port(), draft_port=free_port(),
              log_dir=logs,
              service_args=["--num-blocks", "512", "--threads", "1"], target_args=["--lora-modules", f"sql={adapter}"],
              router_args=["--max-num-batched-tokens", "128", "--max-num-seqs", "32", "--draft-timeout", "2",
                           "--target-grace", "60", "--max-waiting", "512"])
    s.start(timeout=120)
    s.lora = adapter  # a LoRA adapter the target serves as model "sql"; beside it, merged/: the reference
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


@pytest.fixture(scope="module")
def secure_stack(models_dir, tmp_path_factory):
    """Mutual TLS between the router and both services, HTTPS and gRPC over TLS on the doors, an
    API key from a file; every certificate made here. The router logs at DEBUG, to show that even
    then no key is written."""
    if os.environ.get("TANDEM_E2E_K8S") == "1":
        pytest.skip("against a cluster, `stack` carries its key and CA (TANDEM_E2E_API_KEY, TANDEM_E2E_CA)")
    from tests.certs import CA

    root = tmp_path_factory.mktemp("secure")
    ca = CA("tandem-e2e-ca")
    files = {name: ca.write(root / name, ca.issue(name)) for name in ("services", "router", "public", "launcher")}
    key = "e2e-key-" + os.urandom(8).hex()
    (root / "api-keys").write_text(f"{key}\n")
    svc, rtr, pub = files["services"], files["router"], files["public"]
    logs = tmp_path_factory.mktemp("secure-logs")
    s = SecureStack(models_dir / "target", models_dir / "draft", served_model_name=models_dir.name,
                    http_port=free_port(), grpc_port=free_port(), target_port=free_port(), draft_port=free_port(),
                    log_dir=logs, probe_tls=files["launcher"], https=True, api_key=key,
                    pki={"ca": ca, "root": root, "files": files, "logs": logs},
                    service_args=["--num-blocks", "512", "--threads", "1", f"--tls-cert={svc.cert}",
                                  f"--tls-key={svc.key}", f"--tls-ca={svc.ca}"],
                    router_args=["--max-num-batched-tokens", "128", "--draft-timeout", "2", "--target-grace", "60",
                                 f"--tls-cert={rtr.cert}", f"--tls-key={rtr.key}", f"--tls-ca={rtr.ca}",
                                 f"--public-tls-cert={pub.cert}", f"--public-tls-key={pub.key}",
                                 f"--api-key-file={root / 'api-keys'}", "--log-level=DEBUG"])
    s.start(timeout=120)
    yield s
    codes = s.stop()
    bad = {n: c for n, c in codes.items() if c != 0}
    assert not bad, f"unclean shutdown {bad}; logs in {logs}"
