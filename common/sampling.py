"""Sampling parameters: one type from the front doors to the wire, with one set of defaults.

A request names only what it wants to change; everything else comes from the served model's
generation_config.json (as transformers and vLLM apply it), else OpenAI's defaults
(temperature 1, top_p 1, top_k 0). The router resolves them once, at the door.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from tandem.v1 import common_pb2


class InvalidField(ValueError):
    """A request field is out of range: HTTP 400 / gRPC INVALID_ARGUMENT. `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def validate_sampling(temperature: float, top_p: float, top_k: int, field: str = "sampling") -> list[str]:
    """Problems with these parameters, each naming its field ([] when valid)."""
    problems = []
    if not (temperature >= 0.0 and math.isfinite(temperature)):
        problems.append(f"{field}.temperature must be a finite number >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        problems.append(f"{field}.top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        problems.append(f"{field}.top_k must be >= 0, got {top_k}")
    return problems


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled
    seed: int | None = None  # set: reproducible whatever shares the batch
    typical_acceptance: bool = False  # lossy opt-in (Medusa); strict rejection sampling otherwise

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check(self) -> None:
        """InvalidField naming the first bad parameter."""
        problems = validate_sampling(self.temperature, self.top_p, self.top_k, "sampling")
        if problems:
            name = problems[0].split(" ", 1)[0].removeprefix("sampling.")
            raise InvalidField(name, problems[0].split(" ", 1)[1])
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidField("seed", "must be in [0, 2^63)")

    def updated(self, **given: object) -> SamplingParams:
        """These defaults with the request's own values (None = not given) on top."""
        return dataclasses.replace(self, **{k: v for k, v in given.items() if v is not None})

    def to_proto(self) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            acceptance=common_pb2.ACCEPTANCE_TYPICAL if self.typical_acceptance else common_pb2.ACCEPTANCE_STRICT)

    @staticmethod
    def given_in(msg: common_pb2.SamplingParams) -> dict[str, object]:
        """The fields a proto message sets (for updated())."""
        given: dict[str, object] = {name: getattr(msg, name) for name in ("temperature", "top_p", "top_k", "seed")
                                    if msg.HasField(name)}
        if msg.acceptance == common_pb2.ACCEPTANCE_TYPICAL:
            given["typical_acceptance"] = True
        return given

    @classmethod
    def from_generation_config(cls, model_dir: str | Path) -> SamplingParams:
        """The checkpoint's sampling defaults (generation_config.json); do_sample false means greedy."""
        path = Path(model_dir) / "generation_config.json"
        raw = json.loads(path.read_text()) if path.is_file() else {}
        if raw.get("do_sample") is False:
            return cls(temperature=0.0)
        return cls(temperature=float(raw.get("temperature", 1.0)), top_p=float(raw.get("top_p", 1.0)),
                   top_k=int(raw.get("top_k", 0) or 0))
