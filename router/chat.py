"""Chat prompts rendered the way transformers' apply_chat_template renders them.

The template comes from `chat_template.jinja` (transformers 5 saves it there) or the
`chat_template` entry of tokenizer_config.json (older checkpoints; a list of named templates
takes "default"). It renders in a sandbox with the features transformers' renderer has: the
loopcontrols extension, a tojson that does not HTML-escape, strftime_now, raise_exception,
dict and namespace. The special tokens of tokenizer_config.json (bos_token, eos_token, ...) are
template variables, as in transformers. Without any template, a documented plain fallback:

    <role>: <content>\n      for every message, then      assistant:

(an assistant message that starts with whitespace, as the model's own answers do, is joined to
"assistant:" without a second space, so it re-tokenizes as it was generated).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger(__name__)

Message = dict | tuple[str, str]
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: object, ensure_ascii: bool = False, indent: int | None = None, separators: tuple | None = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now, dict=dict, namespace=jinja2.utils.Namespace)
    return env.from_string(source)


class ChatFormatter:
    def __init__(self, template: str | None, special_tokens: dict[str, str], source: str = "") -> None:
        self.source = source
        self.special_tokens = special_tokens
        self.template = compile_template(template) if template else None

    @classmethod
    def from_dir(cls, tokenizer_dir: str | Path, template_file: str | Path | None = None) -> ChatFormatter:
        """The model's template (template_file, a Jinja file, instead: vLLM's --chat-template), with the
        special tokens of its tokenizer_config.json."""
        tokenizer_dir = Path(tokenizer_dir)
        config_path = tokenizer_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        special = {name: _token_text(config.get(name)) for name in _SPECIAL if config.get(name) is not None}
        jinja_file = tokenizer_dir / "chat_template.jinja"
        template, source = None, "none: plain 'role: content' fallback"
        if template_file:
            template, source = Path(template_file).read_text(), f"{template_file} (--chat-template)"
        elif jinja_file.is_file():
            template, source = jinja_file.read_text(), str(jinja_file)
        elif config.get("chat_template"):
            template = config["chat_template"]
            if isinstance(template, list):  # named templates: take the default one
                template = next((t["template"] for t in template if t.get("name") == "default"), None)
            source = f"{config_path} (chat_template)"
        log.info("chat template: %s", source)
        return cls(template, special, source)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True,
               continue_final_message: bool = False, **extra: object) -> str:
        """messages: transformers' dicts ({"role", "content"}, tool_calls, ...), or (role, content) pairs.
        extra: more template variables (tools). continue_final_message (vLLM's, and transformers'): the
        prompt ends inside the last message, an assistant's, so the model writes on from its text
        (everything after it is cut)."""
        dicts = [m if isinstance(m, dict) else {"role": m[0], "content": m[1]} for m in messages]
        if self.template is None:
            text = "".join(_plain_turn(m["role"], m["content"]) for m in dicts)
            text += FALLBACK_GENERATION_PROMPT if add_generation_prompt else ""
        else:
            variables = {**self.special_tokens, **extra}  # as transformers: the caller's win over the tokens'
            text = self.template.render(messages=dicts, add_generation_prompt=add_generation_prompt, **variables)
        if not continue_final_message:
            return text
        final = dicts[-1]["content"].rstrip()
        end = text.rfind(final)
        if not final or end < 0:
            raise ValueError("the final message's text is not in the rendered prompt: it cannot be continued")
        return text[:end + len(final)]


FALLBACK_GENERATION_PROMPT = "assistant:"


def _plain_turn(role: str, content: str) -> str:
    """One message of the template-less format. The model writes on from "assistant:", usually
    starting with a space: an answer it wrote, sent back as history, is joined to "assistant:" as it
    was generated, so the next turn's prompt tokenizes like the tokens it produced (and reuses their
    cached KV) instead of diverging at a doubled space."""
    if role == "assistant" and content[:1].isspace():
        return f"{FALLBACK_GENERATION_PROMPT}{content}\n"
    return f"{role}: {content}\n"


def _token_text(token: str | dict | None) -> str:
    if isinstance(token, dict):
        return token.get("content", "")
    return token or ""
