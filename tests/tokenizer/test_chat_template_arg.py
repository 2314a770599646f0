"""`--chat-template`: a file or the template itself, read as vLLM reads it."""

from __future__ import annotations

import copy

import pytest

from pagoda.tokenizer.chat import apply_chat_template
from pagoda.tokenizer.chat_template import load_chat_template, use_chat_template


def test_a_file_is_read(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{{ messages[0]['content'] }}\n")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}\n"


def test_an_inline_template_with_escapes():
    assert load_chat_template("{{ 'a' }}\\n{{ 'b' }}") == "{{ 'a' }}\n{{ 'b' }}"
    assert load_chat_template(None) is None


def test_a_path_that_does_not_open_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_it_replaces_the_models_template(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)  # the session fixture stays untouched
    use_chat_template(tok, "{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    ids = apply_chat_template(tok, [{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == "[hi]"
