"""Where the chat template comes from, and how it renders: like transformers' apply_chat_template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from corelib.errors import ConfigError
from corelib.server.chat import FALLBACK_TEMPLATE, ChatTemplate, ChatTemplateError

MESSAGES = [{"role": "user", "content": "Hi"}]


def test_without_a_template_the_fallback_is_role_lines(tmp_path: Path) -> None:
    for source in (ChatTemplate.load(None), ChatTemplate.load(str(tmp_path))):
        assert source.is_fallback and source.source == FALLBACK_TEMPLATE
        rendered = source.render([{"role": "system", "content": "Be brief"}, *MESSAGES])
        assert rendered == "system: Be brief\nuser: Hi\nassistant:"


def test_a_list_of_named_templates_uses_default_and_tokens_may_be_records(tmp_path: Path) -> None:
    config = {"bos_token": {"content": "<B>"}, "eos_token": "<E>", "chat_template": [
        {"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "{{ bos_token }}{{ eos_token }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.load(str(tmp_path)).render(MESSAGES) == "<B><E>"


def test_chat_template_jinja_wins_over_tokenizer_config_and_the_override_over_both(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "config"}))
    (tmp_path / "chat_template.jinja").write_text("file")
    assert ChatTemplate.load(str(tmp_path)).render(MESSAGES) == "file"
    override = tmp_path / "mine.jinja"
    override.write_text("{{ messages[0]['content'] | tojson }}{% if add_generation_prompt %}+{% endif %}")
    assert ChatTemplate.load(str(tmp_path), str(override)).render([{"role": "user", "content": "é<"}]) == '"é<"+'


def test_the_sandbox_refuses_what_a_template_must_not_do() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__ }}", "test")
    with pytest.raises(ChatTemplateError):
        template.render(MESSAGES)
    with pytest.raises(ChatTemplateError, match="no tools here"):
        ChatTemplate("{{ raise_exception('no tools here') }}", "test").render(MESSAGES)


def test_a_template_that_does_not_compile_is_one_line_naming_its_origin(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match=r"server.chat_template=.*bad.jinja does not compile"):
        ChatTemplate.load(None, str(bad))
    with pytest.raises(ConfigError, match="cannot be read"):
        ChatTemplate.load(None, str(tmp_path / "missing.jinja"))
