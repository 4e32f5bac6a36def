"""The locally built demo pair (demo_models/): built here in its tiny variant, in seconds."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from demo_models import build

try:  # engine/ is written in parallel; this test runs as soon as it has landed.
    from engine import EngineConfig, ModelRunner, SeqInput
except ImportError as exc:  # pragma: no cover - depends on the state of the repository
    ENGINE_MISSING = f"engine/ not importable yet ({exc}); the engine-vs-transformers check cannot run"
else:
    ENGINE_MISSING = ""

SAMPLE = 'def greet(name: str) -> str:\n    """Say hello."""\n    return f"hello, {name}!"  # ünïcode\n'


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("demo_tiny") / "pair")
    report, cached = build("tiny", out, log=lambda *a: None)
    assert not cached
    return out, report


def test_both_models_load_through_transformers(tiny):
    out, _ = tiny
    for name in ("target", "draft"):
        d = os.path.join(out, name)
        model = AutoModelForCausalLM.from_pretrained(d)
        tok = AutoTokenizer.from_pretrained(d)
        cfg = json.load(open(os.path.join(d, "config.json")))
        gen = json.load(open(os.path.join(d, "generation_config.json")))
        assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
        assert cfg["dtype"] == "float32" and next(model.parameters()).dtype == torch.float32
        assert (gen["bos_token_id"], gen["eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id) == (0, 1)
        ids = tok(SAMPLE, return_tensors="pt").input_ids
        assert ids[0, 0].item() == tok.bos_token_id
        assert tok.decode(ids[0], skip_special_tokens=True) == SAMPLE
        with torch.inference_mode():
            logits = model(ids).logits
        assert logits.shape == (1, ids.size(1), cfg["vocab_size"]) and torch.isfinite(logits).all()


def test_tokenizers_are_identical(tiny):
    out, _ = tiny
    for f in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(out, "target", f), "rb") as a, open(os.path.join(out, "draft", f), "rb") as b:
            assert a.read() == b.read(), f
    t, d = (AutoTokenizer.from_pretrained(os.path.join(out, n)) for n in ("target", "draft"))
    for text in (SAMPLE, "", "import os\n\nclass A(object):\n\tpass\n", "x = [1, 2, 3] * 4 \u20ac"):
        assert t(text).input_ids == d(text).input_ids
    assert t.get_vocab() == d.get_vocab()


def test_report(tiny):
    out, report = tiny
    on_disk = json.load(open(os.path.join(out, "report.json")))
    assert on_disk["settings_hash"] == report["settings_hash"]
    for name in ("target", "draft"):
        assert on_disk[name]["params"] > 0 and on_disk[name]["heldout_ce_nats"] > 0
    per_k = on_disk["acceptance"]["per_k"]
    assert [r["k"] for r in per_k] == list(range(1, 9))
    for r in per_k:
        assert 0.0 <= r["acceptance_rate"] <= 1.0
        assert 1.0 <= r["mean_emitted_per_step"] <= r["k"] + 1
    assert on_disk["cost"]["target_ms"] > 0 and on_disk["cost"]["draft_ms"] > 0
    assert 0.0 <= on_disk["heldout_text_top1_agreement"] <= 1.0
    assert 0.0 < on_disk["acceptance"]["target_distinct_4gram_ratio"] <= 1.0


def test_second_build_is_cached_and_builds_are_deterministic(tiny, tmp_path):
    out, report = tiny
    weights = os.path.join(out, "target", "model.safetensors")
    stamp = os.stat(weights).st_mtime_ns
    again, cached = build("tiny", out, log=lambda *a: None)
    assert cached and again == report
    assert os.stat(weights).st_mtime_ns == stamp  # nothing was rewritten

    # A second build elsewhere gives the same weights and tokenizer, byte for byte.
    other = str(tmp_path / "pair")
    report2, cached2 = build("tiny", other, log=lambda *a: None)
    assert not cached2 and report2["settings_hash"] == report["settings_hash"]
    for name in ("target", "draft"):
        a = load_file(os.path.join(out, name, "model.safetensors"))
        b = load_file(os.path.join(other, name, "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
        for f in ("tokenizer.json", "config.json"):
            assert open(os.path.join(out, name, f)).read() == open(os.path.join(other, name, f)).read()
    assert report2["acceptance"] == report["acceptance"]

    # A report with other settings is stale: the build runs again.
    path = os.path.join(other, "report.json")
    stale = json.load(open(path))
    stale["settings_hash"] = "0" * 16
    json.dump(stale, open(path, "w"))
    _, cached3 = build("tiny", other, log=lambda *a: None)
    assert not cached3
    shutil.rmtree(other)


@pytest.mark.skipif(bool(ENGINE_MISSING), reason=ENGINE_MISSING)
def test_engine_logits_match_transformers(tiny):
    out, _ = tiny
    for name in ("target", "draft"):
        d = os.path.join(out, name)
        ids = AutoTokenizer.from_pretrained(d)(SAMPLE * 2).input_ids
        with torch.inference_mode():
            ref = AutoModelForCausalLM.from_pretrained(d)(torch.tensor([ids])).logits[0]
        runner = ModelRunner.load(d, EngineConfig(num_blocks=64, block_size=16, dtype="float32", device="cpu"))
        [logits] = runner.forward([SeqInput(seq_id=1, start_pos=0, tokens=ids, num_logits=len(ids))])
        assert logits.shape == ref.shape, name
        torch.testing.assert_close(logits.float(), ref, atol=1e-4, rtol=1e-4)
