"""Sampling and acceptance on a device other than the CPU give the CPU's answers, and nothing in
them draws from a generator (or makes a tensor) on the wrong device.

CPU-only PyTorch has one such device that really executes: `lazy` (Lazy Tensor Core with its
TorchScript backend). Like CUDA it refuses CPU tensors mixed into its ops and CPU generators in
its random ops, which is how the old sampling code failed on GPUs (issue #15). On a CUDA machine
the same tests also run on `cuda` (`make gpu-check` runs them: marker `device`).
"""

from __future__ import annotations

import functools

import pytest
import torch

from draft_service.drafts import Continuation, DraftRequest
from draft_service.proposer import Proposer, _Row
from engine.sampling import SamplingSpec, filtered_probs, logprobs_of, sample, truncate_top, uniforms
from target_service.acceptance import Rule, SparseDist, Verification, accept

pytestmark = pytest.mark.device


@functools.cache
def _lazy_device() -> torch.device | None:
    try:
        import torch._lazy.ts_backend

        torch._lazy.ts_backend.init()
        torch.ones(1, device="lazy").cpu()
    except Exception:  # pragma: no cover - a build without Lazy Tensor Core
        return None
    return torch.device("lazy")


DEVICES = [pytest.param("lazy", id="lazy")]
if torch.cuda.is_available():
    DEVICES.append(pytest.param("cuda", id="cuda"))


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    if request.param == "lazy":
        dev = _lazy_device()
        if dev is None:
            pytest.skip("this PyTorch build has no lazy tensor backend")
        return dev
    return torch.device(request.param)


V = 50
SPECS = [SamplingSpec(), SamplingSpec(temperature=0.7, seed=1), SamplingSpec(temperature=1.0, top_k=5, seed=2),
         SamplingSpec(temperature=1.2, top_p=0.8, seed=3), SamplingSpec(temperature=1.0)]


def logits_for(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 2


def test_lazy_is_a_real_non_cpu_device_that_refuses_cpu_generators():
    """The property these tests rely on: the old code's CPU generator fails on this device."""
    dev = _lazy_device()
    if dev is None:
        pytest.skip("this PyTorch build has no lazy tensor backend")
    probs = torch.full((2, V), 1.0 / V, device=dev)
    with pytest.raises(Exception):  # noqa: B017 - the exact error differs by device
        torch.empty_like(probs).exponential_(generator=torch.Generator())
    with pytest.raises(Exception):  # noqa: B017
        (probs + torch.ones(V)).cpu()


def test_filtered_probs_and_sample_agree_with_cpu(device):
    logits = logits_for(len(SPECS))
    cpu = filtered_probs(logits, SPECS)
    dev = filtered_probs(logits.to(device), SPECS)
    assert dev.device.type == device.type
    torch.testing.assert_close(dev.cpu(), cpu, atol=1e-6, rtol=0)
    draws = [(s.seed, 7, 0) for s in SPECS]
    u_cpu = uniforms([d for d in draws if d[0] is not None], "cpu")
    seeded = [i for i, s in enumerate(SPECS) if s.seed is not None]
    assert sample(dev[seeded], u_cpu.to(device)).cpu().tolist() == sample(cpu[seeded], u_cpu).tolist()
    ids, q = truncate_top(dev, 8)
    chosen, _, top_ids, top_lp = logprobs_of(logits.to(device), ids[:, 0], 3)
    assert {t.device.type for t in (ids, q, chosen, top_ids, top_lp)} == {device.type}


def _batch() -> tuple[list[torch.Tensor], list[Verification]]:
    q = SparseDist([1, 4, 9], [0.5, 0.3, 0.2])
    batch = [
        Verification([3, 4], SamplingSpec(), 10),  # greedy
        Verification([4, 9, 1], SamplingSpec(temperature=1.0, seed=5), 20, [q, q, q]),  # strict
        Verification([], SamplingSpec(temperature=0.8, top_k=10, seed=6), 30),  # plain sample
        Verification([2, 2], SamplingSpec(temperature=1.0, seed=7), 40, rule=Rule.TYPICAL),
        Verification([1], SamplingSpec(temperature=1.0, top_p=0.5, seed=8), 50, [q]),
    ]
    logits = [logits_for(len(v.draft) + 1, seed=n) for n, v in enumerate(batch)]
    return logits, batch


def test_acceptance_gives_the_cpu_tokens(device):
    logits, batch = _batch()
    on_cpu = accept(logits, batch)
    on_device = accept([x.to(device) for x in logits], batch)
    assert on_device == on_cpu


def test_draft_sampling_gives_the_cpu_tokens(device):
    proposer = Proposer(runner=None, max_draft_tokens=4, sparse_top_n=8)  # type: ignore[arg-type]
    requests = [DraftRequest(n, 0, [1, 2, 3], k=2, spec=s) for n, s in enumerate(SPECS) if s.seed is not None]
    logits = logits_for(len(requests), seed=9)
    out = {}
    for where in ("cpu", device):
        rows = [_Row(r.seq_id, r, Continuation(), -1, 2) for r in requests]
        proposer._draw(rows, list(range(len(rows))), logits.to(where))
        out[str(where)] = [(row.out.drafts, row.out.probs) for row in rows]
    for (drafts, qs), (cpu_drafts, cpu_qs) in zip(out[str(device)], out["cpu"], strict=True):
        assert drafts == cpu_drafts  # the same tokens, exactly
        for q, cpu_q in zip(qs, cpu_qs, strict=True):  # the same q up to the device's float rounding
            assert q.token_ids == cpu_q.token_ids
            assert q.probs == pytest.approx(cpu_q.probs, rel=1e-5, abs=1e-7)


def test_no_generator_anywhere_on_the_sampling_path(monkeypatch):
    """Randomness is counter-based: the sampling path never makes a torch.Generator, so none can be
    on the wrong device (the property the old code broke on every GPU)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the sampling path made a torch.Generator")

    logits, batch = _batch()
    monkeypatch.setattr(torch, "Generator", refuse)
    assert len(accept(logits, batch)) == len(batch)
    proposer = Proposer(runner=None, max_draft_tokens=4, sparse_top_n=8)  # type: ignore[arg-type]
    requests = [DraftRequest(1, 0, [1], k=1, spec=SamplingSpec(temperature=1.0, seed=1))]
    proposer._draw([_Row(1, requests[0], Continuation(), -1, 0)], [0], torch.zeros(1, V))
