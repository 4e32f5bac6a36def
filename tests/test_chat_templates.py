"""Chat prompts are token-identical to transformers' apply_chat_template, for templates in the
styles of SmolLM2 (ChatML with a default system prompt), Llama 3 (BOS in the template, a dated
system header from strftime_now, loop controls) and Qwen2 (tools rendered with tojson, namespace),
saved the transformers-5 way (chat_template.jinja beside tokenizer_config.json)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from router.chat import ChatFormatter
from router.codec import TextCodec
from tests.conftest import write_tokenizer

SMOLLM2_STYLE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

LLAMA3_STYLE = (
    "{{- bos_token }}\n{%- if not date_string is defined %}{%- set date_string = strftime_now('%d %b %Y') %}"
    "{%- endif %}\n{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{{- 'Today Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}\n"
    "{%- for message in messages %}{%- if message['role'] == 'tool' %}{%- continue %}{%- endif %}"
    "{%- if message['role'] not in ['user', 'assistant'] %}{{- raise_exception('unexpected role ' + message['role']) }}"
    "{%- endif %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}{%- if loop.index > 50 %}{%- break %}{%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}\n")

QWEN2_STYLE = (
    "{%- set ns = namespace(system_seen=false) %}\n{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- endif %}\n{%- for message in messages %}{%- if message.role == 'system' %}{%- set ns.system_seen = true %}"
    "{%- endif %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}\n"
    "{%- if not ns.system_seen %}{{- '<|im_start|>system\\nYou are Qwen <\"é\">.<|im_end|>\\n' }}{%- endif %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n")

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>"]
TEMPLATES = {"smollm2": (SMOLLM2_STYLE, "<|im_start|>"), "llama3": (LLAMA3_STYLE, "<|begin_of_text|>"),
             "qwen2": (QWEN2_STYLE, None)}
CONVERSATIONS = [
    [("user", "What is the capital of France?")],
    [("system", "Be brief & exact."), ("user", "Hi <b>there</b>"), ("assistant", "Hello!"), ("user", "Sort [3, 1, 2]")],
]


def save_transformers5_layout(directory: Path, template: str, bos: str | None) -> Path:
    """tokenizer.json with the chat special tokens, tokenizer_config.json without a template,
    chat_template.jinja beside it (what transformers 5 save_pretrained writes)."""
    write_tokenizer(directory)
    tok = json.loads((directory / "tokenizer.json").read_text())
    next_id = max(t["id"] for t in tok["added_tokens"]) + len(tok["model"]["vocab"])
    for i, content in enumerate(SPECIALS):
        tok["added_tokens"].append({"id": next_id + i, "content": content, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})
    (directory / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["bos_token"] = bos or "<s>"
    config["eos_token"] = "<|im_end|>"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "chat_template.jinja").write_text(template)
    return directory


@pytest.mark.parametrize("style", sorted(TEMPLATES))
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_chat_prompt_tokens_equal_transformers(tmp_path, style, conversation):
    template, bos = TEMPLATES[style]
    d = save_transformers5_layout(tmp_path / style, template, bos)
    msgs = CONVERSATIONS[conversation]
    hf = AutoTokenizer.from_pretrained(d)
    dicts = [{"role": r, "content": c} for r, c in msgs]
    want = hf.apply_chat_template(dicts, tokenize=True, add_generation_prompt=True, return_dict=False)
    codec = TextCodec(d)
    got = asyncio.run(codec.encode_chat(dicts, 100_000))
    assert got == want
    codec.close()
    if bos is not None and template.count("bos_token"):
        assert got.count(hf.convert_tokens_to_ids(bos)) == 1, "BOS once, from the template: never a second one"


def test_template_from_tokenizer_config_and_named_templates(tmp_path):
    """Older checkpoints keep the template in tokenizer_config.json; a list of named templates uses "default"."""
    d = save_transformers5_layout(tmp_path / "old", SMOLLM2_STYLE, None)
    (d / "chat_template.jinja").unlink()
    config = json.loads((d / "tokenizer_config.json").read_text())
    msgs = CONVERSATIONS[1]
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": SMOLLM2_STYLE}))
    rendered = ChatFormatter.from_dir(d).render(msgs)
    assert rendered.startswith("<|im_start|>system\nBe brief") and rendered.endswith("<|im_start|>assistant\n")
    named = [{"name": "tool_use", "template": "nope"}, {"name": "default", "template": SMOLLM2_STYLE}]
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}))
    assert ChatFormatter.from_dir(d).render(msgs) == rendered


def test_a_chat_template_file_replaces_the_models_own_as_transformers_would_render_it(tmp_path):
    """The router's --chat-template: the file's template, with the model's special tokens, renders what
    transformers' apply_chat_template(chat_template=...) renders."""
    template, bos = TEMPLATES[sorted(TEMPLATES)[0]]
    d = save_transformers5_layout(tmp_path / "model", SMOLLM2_STYLE, None)
    custom = tmp_path / "custom.jinja"
    custom.write_text(template)
    dicts = [{"role": r, "content": c} for r, c in CONVERSATIONS[1]]
    hf = AutoTokenizer.from_pretrained(d)
    want = hf.apply_chat_template(dicts, tokenize=True, add_generation_prompt=True, return_dict=False,
                                  chat_template=template)
    codec = TextCodec(d, chat_template=str(custom))
    try:
        assert asyncio.run(codec.encode_chat(dicts, 100_000)) == want
        assert codec.chat.source.endswith("(--chat-template)")
        assert want != hf.apply_chat_template(dicts, tokenize=True, add_generation_prompt=True, return_dict=False)
    finally:
        codec.close()


def test_no_template_falls_back_to_plain_roles(tmp_path):
    write_tokenizer(tmp_path)
    msgs = [("system", "Be brief."), ("user", "Hi")]
    assert ChatFormatter.from_dir(tmp_path).render(msgs) == "system: Be brief.\nuser: Hi\nassistant:"


def test_without_a_template_an_answer_sent_back_reads_as_it_was_generated(tmp_path):
    """The next turn's prompt starts with the previous prompt and the tokens the model produced, so a
    prefix cache holds all of them: the answer is not re-rendered behind a doubled space."""
    from tokenizers import Tokenizer

    write_tokenizer(tmp_path)
    chat, tok = ChatFormatter.from_dir(tmp_path), Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    history = [("system", "Be brief."), ("user", "Wrap this text.")]
    generated = tok.encode(" def wrap(text):\n    return text.split()", add_special_tokens=False).ids
    answer = tok.decode(generated)
    before = tok.encode(chat.render(history)).ids
    after = tok.encode(chat.render([*history, ("assistant", answer), ("user", "Why?")])).ids
    assert after[:len(before) + len(generated)] == before + generated
    hand_written = chat.render([("user", "Hi"), ("assistant", "Hello."), ("user", "Bye")])
    assert hand_written == "user: Hi\nassistant: Hello.\nuser: Bye\nassistant:"


def test_a_template_may_refuse_a_conversation(tmp_path):
    d = save_transformers5_layout(tmp_path / "l3", LLAMA3_STYLE, "<|begin_of_text|>")
    with pytest.raises(Exception, match="unexpected role developer"):
        ChatFormatter.from_dir(d).render([("developer", "x")])


def test_tojson_does_not_escape_html_or_unicode(tmp_path):
    """transformers' tojson keeps <, >, & and non-ASCII as they are (jinja's own escapes them)."""
    d = save_transformers5_layout(tmp_path / "q", QWEN2_STYLE, None)
    tools = [{"type": "function", "function": {"name": "lookup", "description": "<b>café</b> & more"}}]
    msgs = [("user", "find it")]
    want = AutoTokenizer.from_pretrained(d).apply_chat_template(
        [{"role": r, "content": c} for r, c in msgs], tools=tools, tokenize=False, add_generation_prompt=True)
    got = ChatFormatter.from_dir(d).render(msgs, tools=tools)
    assert got == want and '"<b>café</b> & more"' in got


QWEN3_THINKING = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}{{- bos_token if say_bos is defined else '' }}")


@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": False}, {"enable_thinking": True, "say_bos": 1},
                                    {"bos_token": "<|begin_of_text|>", "say_bos": 1}])
def test_chat_template_kwargs_render_as_transformers_template_kwargs(tmp_path, kwargs):
    """vLLM's chat_template_kwargs are more template variables, as transformers' apply_chat_template takes
    them (Qwen3's enable_thinking); they override the special tokens' variables as there, never the
    request's own fields."""
    from router.core import RequestError
    from router.gateway.openai_types import ChatBody

    d = save_transformers5_layout(tmp_path / "q3", QWEN3_THINKING, None)
    messages = [{"role": "user", "content": "Hi"}]
    body = ChatBody(model="m", messages=messages, chat_template_kwargs=kwargs)
    codec = TextCodec(d)
    got = asyncio.run(codec.encode_chat(body.conversation(), 100_000, body.template_options()))
    codec.close()
    want = AutoTokenizer.from_pretrained(d).apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                                return_dict=False, **(kwargs or {}))
    assert got == want
    for taken in ({"add_generation_prompt": False}, {"messages": []}, {"tools": []}):
        with pytest.raises(RequestError, match="chat_template_kwargs"):
            ChatBody(model="m", messages=messages, chat_template_kwargs=taken).template_options()


# In the style of Qwen3's template: the last real user query found by a reversed loop, thinking
# split out of earlier answers' content (or taken from reasoning_content), tool calls with their
# arguments as objects, consecutive tool answers folded into one user turn.
QWEN3_STYLE = """{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for tool in tools %}
{{- '\\n' + (tool | tojson) }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}
{%- if ns.multi_step_tool and message.role == "user" and message.content is string
      and not message.content.startswith('<tool_response>') %}
{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == "user" or message.role == "system" %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}
{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
{%- if not reasoning and '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}
{{- '<|im_start|>assistant\\n' }}
{%- if loop.index0 > ns.last_query_index and reasoning %}
{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}{%- endif %}{{- content }}
{%- for call in message.tool_calls or [] %}{%- set call = call.function if call.function else call %}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{{- call.arguments if call.arguments is string else call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if loop.first or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""


def test_a_qwen3_style_agent_conversation_renders_as_transformers(tmp_path):
    """Tools, a call with its arguments, two tool answers, thinking given as reasoning_content and as
    <think> in content, enable_thinking: the prompt is transformers' to the character."""
    from router.gateway.openai_types import ChatBody

    d = save_transformers5_layout(tmp_path / "q3", QWEN3_STYLE, None)
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    sent = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>\ngreet\n</think>\n\nHello!"},
            {"role": "user", "content": "Weather in Oslo and Bergen?"},
            {"role": "assistant", "content": "", "reasoning_content": "two cities", "tool_calls": [call, call]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"},
            {"role": "tool", "tool_call_id": "c1", "content": "sun"}]
    body = ChatBody(model="m", messages=sent, tools=tools, tool_choice="none",
                    chat_template_kwargs={"enable_thinking": False})
    got = ChatFormatter.from_dir(d).render(body.conversation(), **body.template_options())
    parsed = {**call, "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    hf_messages = [*sent[:4], {**sent[4], "tool_calls": [parsed, parsed]}, *sent[5:]]
    want = AutoTokenizer.from_pretrained(d).apply_chat_template(hf_messages, tools=tools, tokenize=False,
                                                                add_generation_prompt=True, enable_thinking=False)
    assert got == want
    assert "<think>\ntwo cities\n</think>" in got and "greet" not in got and got.count("<tool_response>") == 2
