"""Measure the grammar engines Tandem could use, on this CPU: import cost (and whether torch comes
with it), grammar compile time, token-mask time along a valid output, rollback and copy.

    .venv/bin/python scripts/grammar_engines.py TOKENIZER_DIR [TOKENIZER_DIR ...]

Engines not installed are skipped (only llguidance is a dependency; the others were measured with
`pip install xgrammar==0.2.9 outlines-core==0.2.14` in a scratch environment). The numbers that
chose llguidance are in docs/architecture.md, "Structured output".
"""

from __future__ import annotations

import importlib
import json
import statistics
import sys
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    "kind": {"enum": ["cat", "dog", "fish"]}},
    "required": ["name", "age", "tags", "kind"], "additionalProperties": False}
INSTANCE = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"], "kind": "cat"}'
REGEX = r"[0-9]{3}-[0-9]{4}"
REGEX_TEXT = "555-0199"


def timed(fn, *args):  # noqa: ANN001, ANN002, ANN201
    t0 = time.perf_counter()
    out = fn(*args)
    return out, (time.perf_counter() - t0) * 1e3


def llguidance_engine(tok_dir: Path) -> dict:
    import llguidance as llg

    tok, tok_ms = timed(llg.LLTokenizer, (tok_dir / "tokenizer.json").read_text())
    ids = tok.tokenize_str(INSTANCE)
    out = {"tokenizer_ms": tok_ms}
    for name, grammar, text in (("json_schema", llg.LLMatcher.grammar_from_json_schema(SCHEMA), INSTANCE),
                                ("json_object", llg.LLMatcher.grammar_from_json_schema({"type": "object"}), INSTANCE),
                                ("regex", llg.LLMatcher.grammar_from_regex(REGEX), REGEX_TEXT)):
        ids = tok.tokenize_str(text)
        m, ms = timed(llg.LLMatcher, tok, grammar)
        assert not m.is_error(), m.get_error()
        masks = []
        for t in ids:
            _, mask_ms = timed(m.compute_bitmask)
            masks.append(mask_ms)
            assert m.consume_token(t), m.get_error()
        _, copy_ms = timed(m.deep_copy)
        _, rb_ms = timed(m.rollback, len(ids) // 2)
        out[name] = {"compile_ms": ms, "mask_ms_median": statistics.median(masks), "mask_ms_max": max(masks),
                     "tokens": len(ids), "copy_ms": copy_ms, "rollback_ms": rb_ms}
    return out


def xgrammar_engine(tok_dir: Path) -> dict:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir)
    info, tok_ms = timed(xgr.TokenizerInfo.from_huggingface, hf)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    out = {"tokenizer_ms": tok_ms}
    for name, compile_fn, text in (("json_schema", lambda: compiler.compile_json_schema(json.dumps(SCHEMA)), INSTANCE),
                                   ("json_object", compiler.compile_builtin_json_grammar, INSTANCE),
                                   ("regex", lambda: compiler.compile_regex(REGEX), REGEX_TEXT)):
        compiled, ms = timed(compile_fn)
        m = xgr.GrammarMatcher(compiled, max_rollback_tokens=64)
        ids = hf(text, add_special_tokens=False)["input_ids"]
        masks = []
        for t in ids:
            _, mask_ms = timed(m.fill_next_token_bitmask, bitmask)
            masks.append(mask_ms)
            assert m.accept_token(t)
        _, rb_ms = timed(m.rollback, len(ids) // 2)
        out[name] = {"compile_ms": ms, "mask_ms_median": statistics.median(masks), "mask_ms_max": max(masks),
                     "tokens": len(ids), "rollback_ms": rb_ms}
    return out


def outlines_engine(tok_dir: Path) -> dict:
    import numpy as np
    import outlines_core as oc
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size()
    specials = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    eos = tokenizer.token_to_id("</s>") or tokenizer.token_to_id("<|endoftext|>") or 0
    t0 = time.perf_counter()
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    tokens: dict[bytes, list[int]] = {}
    for token, i in tokenizer.get_vocab().items():
        if token in specials or i == eos:
            continue
        tokens.setdefault(bytes(byte_of[c] for c in token), []).append(i)
    vocab = oc.Vocabulary(eos, tokens)
    out = {"tokenizer_ms": (time.perf_counter() - t0) * 1e3}
    mask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
    for name, regex, text in (("json_schema", oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA)), INSTANCE),
                              ("regex", REGEX, REGEX_TEXT)):
        index, ms = timed(oc.Index, regex, vocab)
        guide = oc.Guide(index, max_rollback=64)
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        masks = []
        for t in ids:
            _, mask_ms = timed(guide.write_mask_into, mask.ctypes.data, mask.size, 4)
            masks.append(mask_ms)
            guide.advance(t, return_tokens=False)
        _, rb_ms = timed(guide.rollback_state, len(ids) // 2)
        out[name] = {"compile_ms": ms, "mask_ms_median": statistics.median(masks), "mask_ms_max": max(masks),
                     "tokens": len(ids), "rollback_ms": rb_ms}
    out["json_object"] = "no: regular expressions only (arbitrary JSON is not regular)"
    return out


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the character a byte-level BPE token spells it with."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def import_cost(module: str) -> dict:
    before = "torch" in sys.modules
    _, ms = timed(importlib.import_module, module)
    return {"import_ms": ms, "imports_torch": not before and "torch" in sys.modules}


def main() -> None:
    report: dict = {}
    for module in ("llguidance", "outlines_core", "xgrammar"):  # torch-free ones first: the import check is honest
        try:
            report[module] = import_cost(module)
        except ImportError:
            report[module] = "not installed"
    for tok_dir in map(Path, sys.argv[1:]):
        vocab = json.loads((tok_dir / "tokenizer.json").read_text())["model"]["vocab"]
        for module, fn in (("llguidance", llguidance_engine), ("outlines_core", outlines_engine),
                           ("xgrammar", xgrammar_engine)):
            if isinstance(report[module], dict):
                report[module][f"vocab {len(vocab)}"] = fn(tok_dir)
    print(json.dumps(report, indent=1, default=lambda x: round(x, 3) if isinstance(x, float) else str(x)))


if __name__ == "__main__":
    main()
