"""Tokenizer identity: draft and target must tokenize identically (DESIGN invariant 4)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def tokenizer_fingerprint(model_dir: str | Path) -> str:
    """sha256 over the vocabulary, merges and special tokens of tokenizer.json.

    Normalised through JSON so formatting differences do not matter; "" when the directory
    has no tokenizer.json (the router then refuses speculation unless told otherwise).
    """
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return ""
    raw = json.loads(path.read_text())
    model = raw.get("model", {})
    identity = {
        "type": model.get("type"),
        "vocab": model.get("vocab"),
        "merges": model.get("merges"),
        "added_tokens": sorted((t["id"], t["content"]) for t in raw.get("added_tokens", [])),
        "pre_tokenizer": raw.get("pre_tokenizer"),
        "normalizer": raw.get("normalizer"),
    }
    blob = json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def eos_token_ids(model_dir: str | Path) -> list[int]:
    """EOS ids from generation_config.json, else config.json."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []
