"""LoRA adapters, specified against an independent reference: the adapter merged into a copy of the
base checkpoint (W + scale * B @ A, what PEFT's merge_and_unload writes), run by transformers.

- the engine serves an adapter's sequences exactly as that merged model, its base sequences as the
  base model, both in one batch; an adapter's blocks never pass for the base model's in the prefix cache
- an adapter directory Tandem cannot serve is refused at load, saying why; a step naming an adapter
  that is not loaded is refused
- through the stack (the draft serves the base model for every request, so speculation is verified
  against the adapter): a request naming an adapter as its model gets the merged model's greedy
  answer, concurrent requests of several adapters and the base each get their own; /v1/models lists
  the adapters; a prompt cached under one model is never attached under another
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from common.block_hash import ROOT, adapter_root, chain_hashes
from engine.config import EngineConfig
from engine.lora import AdapterError
from engine.runner import InvalidInput, ModelRunner, SeqInput
from router.config import RouterConfig
from tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.conftest import hf_greedy, hf_logits
from tests.stack import complete, start_draft, start_router, start_target

RANK, ALPHA = 4, 8.0
TRAINED = ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")  # not k_proj, up_proj: parts left out


def write_adapter(base: Path, out: Path, seed: int) -> Path:
    """A PEFT LoRA adapter for `base` with random A and B (B non-zero: it changes the output), and beside
    it, in out/merged, the base checkpoint with the adapter merged in."""
    config = json.loads((base / "config.json").read_text())
    weights = load_file(str(base / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    adapter, merged = {}, dict(weights)
    for layer in range(config["num_hidden_layers"]):
        for module in TRAINED:
            part = "self_attn" if module.endswith(("q_proj", "v_proj", "o_proj")) else "mlp"
            name = f"model.layers.{layer}.{part}.{module}"
            out_dim, in_dim = weights[f"{name}.weight"].shape
            a = torch.randn(RANK, in_dim, generator=g) * 0.3
            b = torch.randn(out_dim, RANK, generator=g) * 0.3
            adapter[f"base_model.model.{name}.lora_A.weight"] = a
            adapter[f"base_model.model.{name}.lora_B.weight"] = b
            merged[f"{name}.weight"] = weights[f"{name}.weight"] + (ALPHA / RANK) * b @ a
    out.mkdir(parents=True)
    save_file(adapter, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": list(TRAINED), "bias": "none",
        "base_model_name_or_path": str(base)}))
    shutil.copytree(base, out / "merged")
    save_file(merged, str(out / "merged" / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def adapters(model_pair, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {name: write_adapter(model_pair[0], root / name, seed) for seed, name in enumerate(("sql", "poet"))}


@pytest.fixture(scope="module")
def runner(model_pair, adapters) -> ModelRunner:
    r = ModelRunner.load(model_pair[0], EngineConfig(num_blocks=64, block_size=4, device="cpu"))
    r.load_adapters(adapters)
    return r


def greedy(runner: ModelRunner, seqs: dict[int, tuple[list[int], str]], n: int) -> dict[int, list[int]]:
    """Greedy continuations of several sequences decoded together, one batch a step."""
    out: dict[int, list[int]] = {i: [] for i in seqs}
    feed = {i: (0, prompt) for i, (prompt, _) in seqs.items()}
    for _ in range(n):
        ids = list(feed)
        logits = runner.forward([SeqInput(i, feed[i][0], feed[i][1], adapter=seqs[i][1]) for i in ids])
        for i, row in zip(ids, logits, strict=True):
            tok = int(row[-1].argmax())
            out[i].append(tok)
            feed[i] = (feed[i][0] + len(feed[i][1]), [tok])
    runner.release(list(seqs))
    return out


def test_each_sequence_runs_its_adapter_as_the_merged_model_would_in_one_batch(runner, model_pair, adapters):
    prompt = [5, 17, 33, 8, 90, 41, 12, 7, 66]
    got = greedy(runner, {1: (prompt, "sql"), 2: (prompt, ""), 3: (prompt[:5], "poet"), 4: (prompt, "sql")}, 12)
    assert got[1] == got[4] == hf_greedy(adapters["sql"] / "merged", prompt, 12)
    assert got[2] == hf_greedy(model_pair[0], prompt, 12)
    assert got[3] == hf_greedy(adapters["poet"] / "merged", prompt[:5], 12)
    assert got[1] != got[2], "the adapter changes the answer (else this test proves nothing)"
    [logits] = runner.forward([SeqInput(9, 0, prompt, num_logits=len(prompt), adapter="poet")])
    torch.testing.assert_close(logits, hf_logits(adapters["poet"] / "merged", prompt), atol=1e-4, rtol=1e-4)
    runner.release([9])


def test_an_adapters_blocks_hash_apart_from_the_base_models(runner):
    tokens = list(range(10, 22))  # 3 full blocks of 4
    runner.forward([SeqInput(1, 0, tokens, adapter="sql"), SeqInput(2, 0, tokens)])
    for seq in (1, 2):
        runner.commit(seq, len(tokens))
    base, sql = chain_hashes(tokens, 4, ROOT), chain_hashes(tokens, 4, runner.adapters["sql"].root)
    assert runner.prefix.holds(base) and runner.prefix.holds(sql) and set(base).isdisjoint(sql)
    assert not runner.prefix.holds(chain_hashes(tokens, 4, runner.adapters["poet"].root)), "nothing cached for poet"
    assert runner.adapters["sql"].root not in (ROOT, adapter_root("sql")), "the root also hashes the adapter's files"
    runner.release([1, 2])


def test_a_step_naming_an_adapter_that_is_not_loaded_is_refused(runner):
    with pytest.raises(InvalidInput, match="lora"):
        runner.forward([SeqInput(1, 0, [5, 6], adapter="nope")])
    assert runner.cached_len(1) == 0


@pytest.mark.parametrize("breakage,message", [
    (lambda d: (d / "adapter_config.json").unlink(), "no PEFT LoRA adapter"),
    (lambda d: _edit_config(d, use_dora=True), "only plain LoRA"),
    (lambda d: _edit_tensors(d, "lora_A", "lora_embedding_A", only="q_proj"), "no LoRA weight"),
    (lambda d: _edit_tensors(d, "q_proj", "lm_head"), "not adapted by Tandem"),
    (lambda d: _edit_config(d, r=RANK + 1), "must be"),
    (lambda d: _edit_config(d, rank_pattern={"q_proj": 8}), "per-module ranks"),
    (lambda d: _edit_tensors(d, "layers.1.", "layers.7."), "the model has 2"),
    (lambda d: _reshape(d, "q_proj.lora_A", (RANK, 32)), "must be"),
], ids=["not-peft", "dora", "embedding-lora", "lm-head", "wrong-rank", "rank-pattern", "deeper-model", "narrower"])
def test_an_adapter_tandem_cannot_serve_is_refused_saying_why(model_pair, tmp_path, breakage, message):
    d = write_adapter(model_pair[0], tmp_path / "a", 0)
    breakage(d)
    runner = ModelRunner.load(model_pair[0], EngineConfig(num_blocks=8, block_size=4, device="cpu"))
    with pytest.raises(AdapterError, match=message):
        runner.load_adapters({"a": d})


def _edit_config(d: Path, **changes: object) -> None:
    config = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps(config | changes))


def _reshape(d: Path, which: str, shape: tuple[int, int]) -> None:
    tensors = load_file(str(d / "adapter_model.safetensors"))
    save_file({k: torch.zeros(shape) if which in k else v for k, v in tensors.items()},
              str(d / "adapter_model.safetensors"))


def _edit_tensors(d: Path, old: str, new: str, only: str = "") -> None:
    tensors = load_file(str(d / "adapter_model.safetensors"))
    save_file({(k.replace(old, new) if only in k else k): v for k, v in tensors.items()},
              str(d / "adapter_model.safetensors"))


# ---- through the stack -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stack(model_pair, adapters):
    target, _ = start_target(model_pair[0], adapters=adapters)
    draft, _ = start_draft(model_pair[1])
    router = start_router(RouterConfig(max_num_batched_tokens=64, max_num_seqs=16), target.address, draft.address,
                          model_pair[0])
    yield router
    router.stop(), target.stop(), draft.stop()


PROMPTS = [[5, 17, 33, 8, 90, 41, 12, 7, 66] * 3, [9, 8, 7, 6, 5, 4, 3, 2], [44, 45, 46, 47] * 6]


def test_a_request_naming_an_adapter_gets_the_merged_models_answer_beside_others(stack, model_pair, adapters):
    asked = [(p, m) for p in PROMPTS for m in ("tiny", "sql", "poet")]
    with cf.ThreadPoolExecutor(len(asked)) as pool:
        outs = list(pool.map(lambda pm: complete(stack.url, pm[0], 16, model=pm[1]), asked))
    for (prompt, model), out in zip(asked, outs, strict=True):
        ref = model_pair[0] if model == "tiny" else adapters[model] / "merged"
        assert out["choices"][0]["token_ids"] == hf_greedy(ref, prompt, 16), model
        assert out["model"] == model
    counted = httpx.get(f"{stack.url}/metrics").text
    for adapter in ("sql", "poet"):
        assert f'tandem:lora_requests_total{{adapter="{adapter}"}} {float(len(PROMPTS))}' in counted, adapter
    listed = httpx.get(f"{stack.url}/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in listed] == [("tiny", None), ("poet", "tiny"), ("sql", "tiny")]
    r = httpx.post(f"{stack.url}/v1/completions", json={"model": "prose", "prompt": [5], "max_tokens": 2})
    assert r.status_code == 404 and "'sql'" in r.json()["error"]["message"]


def test_a_prompt_cached_under_one_model_is_attached_only_under_that_model(stack, model_pair, adapters):
    prompt = [(11 * i) % 300 + 2 for i in range(70)]  # four full blocks of 16
    base = complete(stack.url, prompt, 4)
    assert complete(stack.url, prompt, 4)["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    first = complete(stack.url, prompt, 4, model="sql")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "the base model's KV is not the adapter's"
    again = complete(stack.url, prompt, 4, model="sql")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    want = hf_greedy(adapters["sql"] / "merged", prompt, 4)
    assert first["choices"][0]["token_ids"] == again["choices"][0]["token_ids"] == want
    assert base["choices"][0]["token_ids"] == hf_greedy(model_pair[0], prompt, 4)


def test_grpc_names_the_adapter_as_its_model(stack, adapters):
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        one = stub.GenerateUnary(generate_pb2.GenerateRequest(prompt_token_ids=PROMPTS[1], max_tokens=8, model="poet",
                                                              ignore_eos=True,
                                                              sampling=common_pb2.SamplingParams(temperature=0.0)),
                                 timeout=60)
        assert list(one.token_ids) == hf_greedy(adapters["poet"] / "merged", PROMPTS[1], 8)
        with pytest.raises(grpc.RpcError) as err:
            stub.GenerateUnary(generate_pb2.GenerateRequest(prompt_token_ids=[5], model="prose"), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prose" in err.value.details()
