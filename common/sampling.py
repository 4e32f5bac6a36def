"""Range checks of sampling parameters, shared by the router (at the door) and the services."""

from __future__ import annotations


def validate_sampling(temperature: float, top_p: float, top_k: int, field: str = "sampling") -> list[str]:
    """Problems with these parameters, each naming its field ([] when valid)."""
    problems = []
    if not temperature >= 0.0 or temperature != temperature:
        problems.append(f"{field}.temperature must be >= 0, got {temperature}")
    if not 0.0 <= top_p <= 1.0:
        problems.append(f"{field}.top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        problems.append(f"{field}.top_k must be >= 0, got {top_k}")
    return problems
