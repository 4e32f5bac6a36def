"""On a CUDA GPU (make gpu-check; skipped elsewhere): the engine's logits against transformers' on the
same device, for a mixed batch (prompt chunk, verification query, decodes) after chunked prefill:
float32 with PyTorch SDPA and no graphs; bfloat16 with CUDA graphs, over PyTorch SDPA (what runs where
flash-attn is not installed) and over flash-attn."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from engine import EngineConfig, ModelRunner, SeqInput
from tests.conftest import write_checkpoint

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check)")]

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=1024)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model_dir(request, tmp_path_factory):
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config,  # qwen3: per-head q/k norms
              "qwen3": lambda **shape: Qwen3Config(**shape, head_dim=64)}[request.param](**SHAPE)
    return write_checkpoint(config, tmp_path_factory.mktemp(f"gpu-{request.param}"), seed=2)


def reference(model_dir, seqs: dict[int, list[int]], dtype: torch.dtype) -> dict[int, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    with torch.no_grad():
        return {s: model(torch.tensor([t], device="cuda")).logits[0].float() for s, t in seqs.items()}


def engine_logits(runner: ModelRunner, seqs: dict[int, list[int]]) -> dict[int, torch.Tensor]:
    """Chunked prefill, then one mixed batch: the rest of seq 1's prompt, a 5-token query on seq 2,
    single-token decodes of 3 and 4 (the decodes alone again afterwards: a graph-shaped step)."""
    runner.forward([SeqInput(1, 0, seqs[1][:300], 0), SeqInput(2, 0, seqs[2][:-5], 0),
                    SeqInput(3, 0, seqs[3][:-2], 0), SeqInput(4, 0, seqs[4][:-2], 0)])
    out = runner.forward([SeqInput(1, 300, seqs[1][300:], len(seqs[1]) - 300), SeqInput(2, len(seqs[2]) - 5,
                          seqs[2][-5:], 5), SeqInput(3, len(seqs[3]) - 2, seqs[3][-2:-1], 1),
                          SeqInput(4, len(seqs[4]) - 2, seqs[4][-2:-1], 1)])
    last = runner.forward([SeqInput(3, len(seqs[3]) - 1, seqs[3][-1:], 1),
                           SeqInput(4, len(seqs[4]) - 1, seqs[4][-1:], 1)])
    return {1: out[0], 2: out[1], 3: torch.cat([out[2], last[0]]), 4: torch.cat([out[3], last[1]])}


def _seqs() -> dict[int, list[int]]:
    g = torch.Generator().manual_seed(0)
    return {s: torch.randint(0, SHAPE["vocab_size"], (n,), generator=g).tolist()
            for s, n in ((1, 420), (2, 77), (3, 300), (4, 9))}


@pytest.mark.parametrize("dtype,backend,eager,atol", [("float32", "torch", True, 5e-4),
                                                       ("bfloat16", "torch", False, 6e-2),
                                                       ("bfloat16", "flash", False, 6e-2)])
def test_engine_matches_transformers_on_cuda(model_dir, dtype, backend, eager, atol):
    if backend == "flash":
        pytest.importorskip("flash_attn")
    seqs = _seqs()
    runner = ModelRunner.load(model_dir, EngineConfig(
        num_blocks=16 if backend == "flash" else 64, block_size=256 if backend == "flash" else 16, device="cuda",
        dtype=dtype, attention_backend=backend, enforce_eager=eager, cuda_graph_max_batch=4, cuda_graph_max_query=5))
    assert runner.backend.name == ("flash-attn" if backend == "flash" else "torch-sdpa")
    got = engine_logits(runner, seqs)
    ref = reference(model_dir, seqs, getattr(torch, dtype))
    for s, logits in got.items():
        want = ref[s][-logits.shape[0]:]
        torch.testing.assert_close(logits, want, atol=atol, rtol=0, msg=f"seq {s}")
        agree = (logits.argmax(-1) == want.argmax(-1)).float().mean().item()
        assert agree >= (1.0 if dtype == "float32" else 0.95), f"seq {s}: top-1 agreement {agree:.3f}"
    if not eager:
        assert runner.graphs is not None and runner.graphs.runs >= 1


def test_lora_adapters_on_cuda_match_the_merged_model(tmp_path):
    """A batch mixing an adapter's sequence and the base model's on CUDA with graphs on (steps that name an
    adapter run eagerly), against transformers on the merged checkpoint."""
    from tests.test_lora import write_adapter

    base = write_checkpoint(LlamaConfig(**SHAPE), tmp_path / "base", seed=2)
    adapter = write_adapter(base, tmp_path / "sql", seed=0)
    runner = ModelRunner.load(base, EngineConfig(num_blocks=64, block_size=16, device="cuda", dtype="float32",
                                                 cuda_graph_max_batch=4, cuda_graph_max_query=5))
    runner.load_adapters({"sql": adapter})
    seqs = _seqs()
    out = runner.forward([SeqInput(1, 0, seqs[2], len(seqs[2]), adapter="sql"),
                          SeqInput(2, 0, seqs[4], len(seqs[4]))])
    for logits, model, s in ((out[0], adapter / "merged", 2), (out[1], base, 4)):
        ref = reference(model, {s: seqs[s]}, torch.float32)[s]
        torch.testing.assert_close(logits, ref, atol=5e-4, rtol=0, msg=str(model))
