"""Chat prompts: the tokenizer's own chat template when it has one (Jinja, as transformers renders
it), else a documented plain fallback:

    <role>: <content>\n      for every message, then      assistant:
"""

from __future__ import annotations

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


class ChatFormatter:
    def __init__(self, tokenizer_config: dict) -> None:
        template = tokenizer_config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.bos = _token_text(tokenizer_config.get("bos_token"))
        self.eos = _token_text(tokenizer_config.get("eos_token"))
        self.template = None
        if template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self.template = env.from_string(template)

    def render(self, messages: list[tuple[str, str]]) -> str:
        if self.template is None:
            return "".join(f"{role}: {content}\n" for role, content in messages) + "assistant:"
        return self.template.render(messages=[{"role": r, "content": c} for r, c in messages],
                                    add_generation_prompt=True, bos_token=self.bos, eos_token=self.eos)


def _token_text(token: str | dict | None) -> str:
    if isinstance(token, dict):
        return token.get("content", "")
    return token or ""
