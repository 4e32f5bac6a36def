"""Text <-> token ids off the event loop: prompts are tokenized (and chats rendered) on a small
thread pool, so a huge prompt never freezes the streams the event loop is serving, and a prompt
that cannot fit the model is refused from its length in bytes before any of it is encoded."""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tokenizers import Tokenizer

from common.sampling import MAX_BAD_WORDS
from router.chat import ChatFormatter
from router.config import THINK_CLOSE, THINK_OPEN
from router.core import RequestError

log = logging.getLogger(__name__)

MAX_BAD_WORD_CHARS = 256


class TextCodec:
    def __init__(self, tokenizer_dir: str | Path, threads: int = 2, chat_template: str = "") -> None:
        """chat_template: a Jinja file rendering chats instead of the model's own template."""
        tokenizer_dir = Path(tokenizer_dir)
        self.tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        self.chat = ChatFormatter.from_dir(tokenizer_dir, chat_template or None)
        # the reasoning parsers' markers as single tokens, where the vocabulary has them (else None)
        self.think_end = self.tokenizer.token_to_id(THINK_CLOSE)
        self.think_start = self.tokenizer.token_to_id(THINK_OPEN)
        # Every token stands for at most this many bytes of text: a prompt of B bytes has at least
        # B / max_token_bytes tokens, so one far too long is refused without encoding it.
        self.max_token_bytes = max(1, max(len(self.tokenizer.decode([i]).encode()) for i in
                                          range(self.tokenizer.get_vocab_size())))
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")

    def check_size(self, text: str, max_tokens: int, field: str) -> None:
        """RequestError when `text` surely has more than max_tokens tokens (a cheap lower bound)."""
        at_least = len(text.encode()) // (2 * self.max_token_bytes)  # 2x: normalizers may shrink text
        if at_least > max_tokens:
            raise RequestError(field, f"has at least {at_least} tokens; max_model_len is {max_tokens}")

    async def encode(self, text: str, max_tokens: int, field: str = "prompt", plain: bool = False) -> list[int]:
        """plain: without the special tokens a prompt starts with (BOS): a text inside one."""
        self.check_size(text, max_tokens, field)
        return await self._run(self._encode, text, not plain)

    async def encode_chat(self, messages: list[dict], max_tokens: int, extra: dict | None = None) -> list[int]:
        """messages as ChatFormatter.render takes them; extra: its options (add_generation_prompt,
        continue_final_message, tools)."""
        self.check_size("".join(m["content"] for m in messages), max_tokens, "messages")
        return await self._run(self._encode_chat, messages, extra or {})

    def _encode(self, text: str, special: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works; encode() holds it (measured: 2 s of a 2 MB text)
        return self.tokenizer.encode_batch([text], add_special_tokens=special)[0].ids

    def _encode_chat(self, messages: list[dict], extra: dict) -> list[int]:
        try:
            prompt = self.chat.render(messages, **extra)
        except Exception as err:  # a template may reject a conversation (raise_exception)
            raise RequestError("messages", f"chat template: {err}") from None
        # the rendered template carries its own special tokens (BOS included): add none
        return self.tokenizer.encode_batch([prompt], add_special_tokens=self.chat.template is None)[0].ids

    def bad_word_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """vLLM's bad_words as token sequences: each word as written and after a space (a word that
        starts the text and one in its middle tokenize differently), distinct. Short texts: encoded here."""
        if len(words) > MAX_BAD_WORDS or any(not w.strip() or len(w) > MAX_BAD_WORD_CHARS for w in words):
            raise RequestError("bad_words", f"at most {MAX_BAD_WORDS} words of 1 to {MAX_BAD_WORD_CHARS} characters, "
                                            "not only spaces")
        variants = [v for w in words for v in (w.lstrip(), " " + w.lstrip())]
        encoded = self.tokenizer.encode_batch(variants, add_special_tokens=False)
        return tuple(dict.fromkeys(tuple(e.ids) for e in encoded if e.ids))

    def think_tokens(self, parser: str | None) -> tuple[int, int | None]:
        """(think-end, think-start or None where the output starts inside thinking) as the reasoning
        parser reads them: what thinking_token_budget needs."""
        end, start = self.think_end, self.think_start
        if parser is None or end is None or (parser != "deepseek_r1" and start is None):
            raise RequestError("thinking_token_budget", "needs the router's --reasoning-parser and a model whose "
                                                        f"{THINK_OPEN} and {THINK_CLOSE} are single tokens")
        return end, None if parser == "deepseek_r1" else start

    async def _run(self, fn, *args):  # noqa: ANN001, ANN002, ANN202
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def decode(self, ids: list[int]) -> str:
        """Text of token ids as an answer shows it (special tokens skipped): an echoed prompt of ids."""
        return await self._run(functools.partial(self.tokenizer.decode, skip_special_tokens=True), ids)

    def decode_one(self, ids: list[int]) -> str:
        """Tokens' own text, as logprobs show it."""
        return self.tokenizer.decode(ids)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
