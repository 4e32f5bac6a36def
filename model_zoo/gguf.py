"""Llama GGUF -> an ordinary Hugging Face directory (safetensors, config, tokenizer).

Matrices stored quantised or in half precision are written in fp16 (as llama.cpp's own converters
do), the rest in fp32: a Q4_1 matrix dequantises to d * q + m, which fp16 holds to 2^-11 of its value,
far inside the quantisation's own step, and the engine runs fp16-valued weights through a product
that reads half the bytes (engine/linear.py). `round_as_written` applies the same rounding to a model
loaded another way (transformers' own GGUF load), to compare like with like.

llama.cpp stores Llama weights with two twists that a plain dequantisation would get wrong:
tensors are named its own way (``blk.N.attn_q``), and the rows of Q and K are permuted so that
its rotary embedding pairs adjacent dimensions where Hugging Face pairs the two halves of a head.
Both are undone here. Only what the Llama architecture needs is supported; anything else (other
architectures, rope scaling, a SentencePiece vocabulary) is refused by name, never guessed.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

CONTROL_TOKEN = 3  # llama.cpp's token_type for special tokens (<|im_start|> ...)

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class UnsupportedGGUF(ValueError):
    """The GGUF holds something this converter does not implement."""


@dataclass(frozen=True)
class LlamaHyper:
    vocab_size: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_positions: int
    tied: bool


def _field(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_hyper(reader: GGUFReader) -> LlamaHyper:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise UnsupportedGGUF(f"architecture {arch!r}: only 'llama' GGUFs are converted")
    scaling = _field(reader, "llama.rope.scaling.type", "none")
    if scaling not in ("none", None) or any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise UnsupportedGGUF(f"rope scaling ({scaling}, or a rope_freqs tensor) is not converted")
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    return LlamaHyper(
        vocab_size=int(_field(reader, "llama.vocab_size", len(tokens.data))),
        hidden=hidden,
        intermediate=int(_field(reader, "llama.feed_forward_length")),
        layers=int(_field(reader, "llama.block_count")),
        heads=heads,
        kv_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        max_positions=int(_field(reader, "llama.context_length", 2048)),
        tied=not any(t.name == "output.weight" for t in reader.tensors),
    )


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: within each head it interleaves the two rotary halves
    (row 2i, 2i+1 = dims i, i + d/2); Hugging Face keeps the halves as two blocks."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")  # blk.N.attn_q.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    raise UnsupportedGGUF(f"tensor {gguf_name!r} has no place in a Llama checkpoint")


def read_tensors(reader: GGUFReader, hyper: LlamaHyper, progress: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor dequantised (fp16 where `halved`, else fp32), named and laid out as Hugging Face's
    LlamaForCausalLM."""
    out: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="dequantise GGUF", unit="tensor", disable=not progress, mininterval=1.0):
        w = dequantize(t.data, t.tensor_type).reshape(tuple(int(n) for n in reversed(t.shape)))  # ggml: innermost first
        if t.name.endswith("attn_q.weight"):
            w = unpermute_rows(w, hyper.heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_rows(w, hyper.kv_heads)
        tensor = torch.from_numpy(np.require(w, np.float32, ["C", "W"]))  # F32 ones are read-only maps
        out[hf_name(t.name)] = tensor.half() if halved(tensor, t.tensor_type) else tensor
    return out


def halved(tensor: torch.Tensor, stored: GGMLQuantizationType) -> bool:
    """Whether a dequantised tensor is written in fp16: a matrix not stored as F32, within fp16's range."""
    return tensor.dim() == 2 and stored != GGMLQuantizationType.F32 and float(tensor.abs().max()) <= 65504.0


@torch.no_grad()
def round_as_written(model: torch.nn.Module, checkpoint_dir: str | Path) -> None:
    """Round `model`'s parameters to fp16 where the converted checkpoint stores them in fp16."""
    from safetensors import safe_open

    with safe_open(str(Path(checkpoint_dir) / "model.safetensors"), framework="pt") as f:
        halves = {name for name in f.keys() if f.get_slice(name).get_dtype() == "F16"}
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in halves:
            p.copy_(p.half().float())


def special_ids(reader: GGUFReader) -> dict[str, int | None]:
    def get(key: str) -> int | None:
        v = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return None if v is None else int(v)

    return {"bos": get("bos"), "eos": get("eos"), "pad": get("padding"), "unk": get("unknown")}


def build_tokenizer(reader: GGUFReader) -> Tokenizer:
    """llama.cpp's 'gpt2' vocabulary (byte-level BPE) as a `tokenizers` Tokenizer. The
    pre-tokenizer isolates every digit first (what llama.cpp's 'smollm' and 'starcoder'
    pre-tokenizers do), then applies GPT-2's split, as the original tokenizer.json does."""
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise UnsupportedGGUF(f"tokenizer model {model!r}: only byte-level BPE ('gpt2') is converted")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in ("smollm", "starcoder", "gpt-2", "default"):
        raise UnsupportedGGUF(f"pre-tokenizer {pre!r} is not converted")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    splits = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if pre in ("smollm", "starcoder"):
        splits.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [t for t, ty in zip(tokens, types, strict=True) if ty == CONTROL_TOKEN]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


def write_tokenizer(reader: GGUFReader, out: Path) -> None:
    tok = build_tokenizer(reader)
    tok.save(str(out / "tokenizer.json"))
    ids = special_ids(reader)
    names = {k: (tok.id_to_token(v) if v is not None else None) for k, v in ids.items()}
    template = _field(reader, "tokenizer.chat_template")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": names["bos"],
        "eos_token": names["eos"],
        "pad_token": names["pad"],
        "unk_token": names["unk"],
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, "llama.context_length", 2048)),
    }
    if template:  # both ways: in tokenizer_config.json (older readers) and as transformers 5 saves it
        config["chat_template"] = template
        (out / "chat_template.jinja").write_text(template)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def hf_config(hyper: LlamaHyper, ids: dict[str, int | None]) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": hyper.vocab_size,
        "hidden_size": hyper.hidden,
        "intermediate_size": hyper.intermediate,
        "num_hidden_layers": hyper.layers,
        "num_attention_heads": hyper.heads,
        "num_key_value_heads": hyper.kv_heads,
        "head_dim": hyper.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": hyper.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": hyper.rope_theta},
        "max_position_embeddings": hyper.max_positions,
        "tie_word_embeddings": hyper.tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
        "dtype": "float32",  # what it computes in: its fp16 matrices widen exactly
    }


def convert(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> dict:
    """Write ``out_dir`` (replaced if present, via a temporary sibling) from a Llama GGUF.
    Returns the config written."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".converting")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    reader = GGUFReader(str(gguf_path))
    hyper = read_hyper(reader)
    ids = special_ids(reader)
    tensors = read_tensors(reader, hyper, progress)
    if hyper.tied:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(hyper, ids)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tokenizer(reader, tmp)
    for f in tmp.iterdir():
        os.chmod(f, 0o644)  # read by other users too (containers, services)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return config
