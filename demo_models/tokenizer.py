"""Byte-level BPE tokenizer trained on the corpus with the ``tokenizers`` library.

Saved in the Hugging Face layout (``tokenizer.json`` + ``tokenizer_config.json``) so that
``transformers.AutoTokenizer.from_pretrained(dir)`` loads it. Like Llama's tokenizer it
prepends ``<s>`` when special tokens are requested; ``</s>`` ends each training document.
"""

from __future__ import annotations

import json
import os
import shutil

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, PAD]  # ids 0, 1, 2
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE. Deterministic for the same texts in the same order."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [BOS_ID, EOS_ID, PAD_ID]
    # Prepend <s> like Llama does, only when special tokens are asked for.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str, model_max_length: int) -> None:
    """Write tokenizer.json and tokenizer_config.json (stable, sorted JSON)."""
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"), pretty=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)
        fh.write("\n")


def copy_tokenizer(src_dir: str, dst_dir: str) -> None:
    """Byte-identical copies: draft and target must share one tokenizer."""
    os.makedirs(dst_dir, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(src_dir, name), os.path.join(dst_dir, name))


def encode_documents(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each document as ``<s> text </s>`` (batch-encoded, order preserved)."""
    encs = tok.encode_batch(texts, add_special_tokens=False)
    return [[BOS_ID, *e.ids, EOS_ID] for e in encs]
