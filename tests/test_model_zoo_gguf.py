"""GGUF -> Hugging Face conversion (model_zoo/gguf.py), on small GGUF files written here the way
llama.cpp writes them: Q/K rows permuted, weights in F32 or quantised to Q8_0."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors import safe_open
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from model_zoo.gguf import UnsupportedGGUF, convert, round_as_written, unpermute_rows

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "a t"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permutation of Q/K rows (what the converter must undo)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_llama(tied: bool) -> torch.nn.Module:
    vocab = len(SPECIALS) + 256 + len(MERGES)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rope_theta=50000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def write_gguf(model, path, qtype: GGMLQuantizationType) -> None:
    cfg = model.config
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merged = [m.replace(" ", "") for m in MERGES]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(SPECIALS + alphabet + merged)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(alphabet) + len(merged)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            _, _, i, *rest = name.split(".")
            gname = f"blk.{i}.{parts['.'.join(rest[:-1])]}.{rest[-1]}"
        else:
            gname = names[name]
        a = t.float().numpy()
        if gname.endswith("attn_q.weight"):
            a = permute_rows(a, cfg.num_attention_heads)
        elif gname.endswith("attn_k.weight"):
            a = permute_rows(a, cfg.num_key_value_heads)
        if a.ndim == 2 and qtype != GGMLQuantizationType.F32:
            w.add_tensor(gname, quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def logits(model_dir, ids, **kw) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kw).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_permutation_round_trips():
    w = np.arange(8 * 3 * 5, dtype=np.float32).reshape(24, 5)
    assert np.array_equal(unpermute_rows(permute_rows(w, 3), 3), w)
    assert not np.array_equal(permute_rows(w, 3), w)


@pytest.mark.parametrize("tied", [True, False])
def test_f32_gguf_converts_back_to_the_original_model(tmp_path, tied):
    model = tiny_llama(tied)
    write_gguf(model, tmp_path / "m.gguf", GGMLQuantizationType.F32)
    config = convert(tmp_path / "m.gguf", tmp_path / "hf", progress=False)
    assert config["tie_word_embeddings"] is tied and config["num_key_value_heads"] == 2
    ids = [5, 17, 40, 3, 99, 200, 7, 1, 64]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits(tmp_path / "hf", ids), want, atol=1e-5, rtol=0)


def test_quantised_gguf_matches_transformers_own_gguf_load(tmp_path):
    """Quantised matrices are written in fp16 (norms in fp32): transformers' own load of the GGUF,
    rounded the same way, gives the same logits; the fp16 rounding moved some values."""
    write_gguf(tiny_llama(True), tmp_path / "q.gguf", GGMLQuantizationType.Q4_1)
    convert(tmp_path / "q.gguf", tmp_path / "hf", progress=False)
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert {n for n, d in dtypes.items() if d == "F16"} == {n for n in dtypes if "norm" not in n}
    ids = [9, 8, 7, 100, 150, 2, 33]
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, gguf_file="q.gguf").eval()
    with torch.no_grad():
        unrounded = ref(torch.tensor([ids])).logits[0]
        round_as_written(ref, tmp_path / "hf")
        want = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits(tmp_path / "hf", ids), want, atol=1e-5, rtol=0)
    assert not torch.equal(unrounded, want)


def test_tokenizer_and_chat_template_are_written_both_ways(tmp_path):
    write_gguf(tiny_llama(True), tmp_path / "m.gguf", GGMLQuantizationType.F32)
    convert(tmp_path / "m.gguf", tmp_path / "hf", progress=False)
    ours = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    for text in ("the heater in a set", " at the end\n\tre", "<|im_start|>user\nhi<|im_end|>"):
        assert ours(text).input_ids == ref(text).input_ids
        assert ours.decode(ours(text).input_ids) == text
    assert ours.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert (tmp_path / "hf" / "chat_template.jinja").read_text() == TEMPLATE
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n"
    # digits are split one by one, as llama.cpp's 'smollm' pre-tokenizer does
    assert ours.convert_ids_to_tokens(ours("12").input_ids) == ["1", "2"]
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)


def test_other_architectures_are_refused(tmp_path):
    w = GGUFWriter(str(tmp_path / "x.gguf"), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedGGUF, match="gpt2"):
        convert(tmp_path / "x.gguf", tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists()
