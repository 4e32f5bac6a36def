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


# ---- portable builds: precision decided at run time, quality gates that fail loudly ----------

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c\n"
AVX512_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512_bf16 amx_tile\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes sha2 crc32 atomics fphp asimdhp bf16 i8mm\n"


def test_bf16_is_used_only_where_the_cpu_has_it_natively():
    from demo_models.precision import use_bf16

    assert use_bf16("auto", AVX2_ONLY) is False
    assert use_bf16("auto", "") is False  # nothing known (not Linux): fp32
    assert use_bf16("auto", AVX512_BF16) is True and use_bf16("auto", ARM_BF16) is True
    assert use_bf16("fp32", AVX512_BF16) is False and use_bf16("bf16", AVX2_ONLY) is True
    with pytest.raises(ValueError):
        use_bf16("fp16")


@pytest.mark.parametrize("bf16", [False, True])
def test_the_training_loop_autocasts_only_when_told(bf16):
    from demo_models.train import TrainSchedule, run_schedule

    model = torch.nn.Linear(8, 8)
    seen = []

    def loss_fn(step):
        y = model(torch.randn(4, 8))
        seen.append((torch.is_autocast_enabled("cpu"), y.dtype))
        return y.float().pow(2).mean()

    info = run_schedule("t", TrainSchedule(steps=2, batch=1, seq_len=1, lr=1e-3, warmup=1), model, loss_fn, bf16)
    assert seen == [(bf16, torch.bfloat16 if bf16 else torch.float32)] * 2
    assert info["precision"] == ("bf16 autocast" if bf16 else "fp32") and info["steps"] == info["steps_planned"] == 2


def test_a_build_on_a_cpu_without_native_bf16_trains_in_fp32(monkeypatch, tmp_path):
    import demo_models.precision as precision

    monkeypatch.setattr(precision, "read_cpuinfo", lambda path="/proc/cpuinfo": AVX2_ONLY)
    report, _ = build("tiny", str(tmp_path / "pair"), log=lambda *a: None)
    assert report["training_precision"] == "fp32" and report["machine"]["native_bf16"] is False
    assert report["target"]["training"]["precision"] == report["draft"]["training"]["precision"] == "fp32"


def test_a_pair_below_its_gates_is_not_installed_unless_allowed(monkeypatch, tmp_path, capsys):
    import dataclasses

    from demo_models import VARIANTS
    from demo_models.__main__ import main

    impossible = dataclasses.replace(VARIANTS["tiny"], gate_acceptance_k4=1.01)
    monkeypatch.setitem(VARIANTS, "tiny", impossible)
    out = tmp_path / "pair"
    assert main(["--variant", "tiny", "--out", str(out)]) == 1
    assert "BUILD FAILED" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == [".building"]  # nothing where `make run` would look
    assert {"target", "draft", "report.json"} <= set(os.listdir(out / ".building"))

    report, cached = build(impossible, str(out), log=lambda *a: None, allow_partial=True)
    assert not cached and report["partial"] is True
    assert [g["ok"] for g in report["gates"]] == [False]
    assert sorted(os.listdir(out)) == ["draft", "report.json", "target"]
