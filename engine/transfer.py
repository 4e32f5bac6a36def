"""Device -> host copies of what crosses gRPC (sampled tokens, logprobs, the draft's sparse q).

Everything a step sends back is copied in one go at the end: on CUDA each tensor lands in pinned
host memory with a non-blocking copy and the stream is synchronised once, instead of one blocking
copy (and one sync) per `.tolist()`. Pinned blocks come from PyTorch's caching host allocator, so
asking for them every step costs no fresh page-locking after the first steps.
"""

from __future__ import annotations

import torch


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """CPU copies of `tensors` (the same objects when already on the CPU)."""
    out = []
    cuda = None
    for t in tensors:
        if t.device.type == "cpu":
            out.append(t)
        elif t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            out.append(host)
            cuda = t.device
        else:
            out.append(t.to("cpu"))
    if cuda is not None:
        torch.cuda.current_stream(cuda).synchronize()
    return out


def to_lists(*tensors: torch.Tensor) -> list[list]:
    """Python lists of `tensors`, after one batched host copy."""
    return [t.tolist() for t in to_host(*tensors)]
