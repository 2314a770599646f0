"""Chat templates render sandboxed and bounded: the model's template gives exactly what
transformers gives; a template that loops forever, builds huge strings or reaches for
Python internals is stopped with a ValueError (a 400 for a request's template)."""

from __future__ import annotations

import pytest

from pagoda.tokenizer import template_sandbox
from pagoda.tokenizer.chat import render_chat_template

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Why?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
]
TOOLS = [{"type": "function", "function": {"name": "f", "description": "d",
                                           "parameters": {"type": "object", "properties": {}}}}]


def render_with(tokenizer, template: str) -> str:
    """The first conversation rendered with `template` as the request's chat template."""
    return render_chat_template(tokenizer, CONVERSATIONS[0], True, False,
                                {"chat_template": template})


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_the_models_template_renders_as_transformers_renders_it(smollm2_tokenizer, conversation):
    tok = smollm2_tokenizer
    cases = [(True, False, None), (False, False, None), (True, False, TOOLS)]
    if conversation[-1]["role"] == "assistant":
        cases.append((False, True, None))
    for add_generation_prompt, continue_final, tools in cases:
        ours = render_chat_template(tok, conversation, add_generation_prompt, continue_final,
                                    tools=tools)
        theirs = tok.apply_chat_template(conversation, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final)
        assert ours == theirs


def test_transformers_globals_and_tags_work(smollm2_tokenizer):
    template = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                "{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}"
                "{{ ns.n }}{{ dict(a=1)['a'] }}{{ 7 * 7 }}{{ bos_token }}")
    out = render_with(smollm2_tokenizer, template)
    assert out == '{"role": "user", "content": "Hi"}' + "1149" + smollm2_tokenizer.bos_token
    with pytest.raises(ValueError, match="no assistant here"):
        render_with(smollm2_tokenizer, "{{ raise_exception('no assistant here') }}")


@pytest.mark.parametrize("template", [
    "{{ 'a' * 100000000 }}",
    "{{ [0] * 100000000 }}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s | length }}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}",
    "{{ 'x' | center(1000000000) }}",
    "{{ 'x'.ljust(1000000000) }}",
    "{{ '%999999999d' % 1 }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ 2 ** 100000000 }}",
    "{{ (10 ** 4000) ** 4000 }}",
    "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
])
def test_a_template_cannot_build_huge_values(smollm2_tokenizer, template):
    with pytest.raises(ValueError):
        render_with(smollm2_tokenizer, template)


def test_a_template_that_runs_too_long_is_stopped(smollm2_tokenizer, monkeypatch):
    monkeypatch.setattr(template_sandbox, "MAX_RENDER_SECONDS", 0.5)
    loops = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
             "{% endfor %}")
    with pytest.raises(ValueError, match="to render"):
        render_with(smollm2_tokenizer, loops)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.append(1) }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}",
    "{{ cycler.__init__.__globals__ }}",
])
def test_the_sandbox_keeps_python_out_of_reach(smollm2_tokenizer, template):
    with pytest.raises(ValueError):
        render_with(smollm2_tokenizer, template)


def test_limits_given_to_a_render_apply_to_it_and_the_defaults_elsewhere(smollm2_tokenizer):
    """An operator's limits (the tokenizer's --chat-template-render-timeout and
    --chat-template-max-output-chars) hold inside `template_limits`; outside, the same
    renders pass under the defaults (the offline LLM)."""
    long_message = [{"role": "user", "content": "x" * 3000}]
    loops = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
             "{% endfor %}")
    small = template_sandbox.TemplateLimits(render_timeout_s=0.2, max_output_chars=2000)
    with template_sandbox.template_limits(small):
        with pytest.raises(ValueError, match="more than 2000 characters"):
            render_chat_template(smollm2_tokenizer, long_message, True, False, {})
        with pytest.raises(ValueError, match="more than 0.2 s to render"):
            render_with(smollm2_tokenizer, loops)
    assert "x" * 3000 in render_chat_template(smollm2_tokenizer, long_message, True, False, {})
    assert template_sandbox.current_limits() == template_sandbox.TemplateLimits()


@pytest.mark.parametrize("timeout_s,max_chars", [(0, 10), (-1, 10), (1.0, 0)])
def test_limits_must_be_positive(timeout_s, max_chars):
    with pytest.raises(ValueError, match="positive"):
        template_sandbox.TemplateLimits(timeout_s, max_chars)
