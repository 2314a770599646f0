"""A chat template that would build a value past the size limit is refused BEFORE the
value is built: the render's memory peak stays far below the value's size, whether the
template is the model's own (trusted) or a request's `chat_template`. A real template's
work (filters, str methods, namespaces, tojson) still renders exactly as jinja's own
sandbox renders it."""

from __future__ import annotations

import tracemalloc

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagoda.tokenizer import template_sandbox
from pagoda.tokenizer.chat import render_chat_template

MB = 1_000_000
PEAK_BYTES = 20 * MB  # each value refused below would take 80 MB to 1 GB
S = "{% set s = 'x' * 1000000 %}"  # one 1 MB string, referenced many times below
TWENTY = "[" + ",".join(["s"] * 20) + "]"  # 20 references: 20 MB once printed
TWENTY_ARGS = ",".join(["s"] * 20)

# Refused by their plan, before they allocate: the default limit (16 Mi characters).
PLANNED = [
    "{{ 'x' * 400000000 }}",
    "{{ ('a' * 1000) | replace('a', 'x' * 1000000) }}",
    "{{ ('x' * 1000000) | center(400000000) }}",
    "{{ range(100000000) | list }}",
    "{{ ('x' * 1000000).ljust(400000000) }}",
    "{{ ('x' * 1000000).zfill(400000000) }}",
    "{{ ('\t' * 1000000).expandtabs(1000) }}",
    "{{ ('x' * 1000000).replace('x', 'y' * 100) }}",
    "{{ ('x' * 1000000) | replace('', 'y' * 100) }}",
    S + "{{ " + TWENTY + " | join }}",
    S + "{{ " + TWENTY + " | join(',') }}",
    S + "{{ ','.join(" + TWENTY + ") }}",
    S + "{{ ('%s' * 20) % (" + TWENTY_ARGS + ") }}",
    S + "{{ '%(a)s' * 20 % {'a': s} }}",
    S + "{{ ('%s' * 20) | format(" + TWENTY_ARGS + ") }}",
    S + "{{ ('{0}' * 20).format(s) }}",
    "{{ ('\n' * 1000000) | indent(100) }}",
    "{{ ('a ' * 200000) | wordwrap(1, wrapstring='x' * 100) }}",
    S + "{{ " + TWENTY + " }}",
    S + "{{ " + TWENTY + " ~ '' }}",
    S + "{{ " + TWENTY + " | string }}",
    S + "{{ " + TWENTY + " | tojson }}",
    S + "{{ " + TWENTY + " | pprint }}",
    S + "{{ [" + TWENTY + "] * 1 }}",
    "{{ ('x' * 3000000) | list | length }}",
    "{{ ('x' * 3000000) | sort | length }}",
    "{{ ('x' * 1000000) | batch(1) | list | length }}",
    "{{ (' ' * 3000000).split(' ') | length }}",
    "{{ ('<' * 10000000) | e }}",
    "{{ ('<>' * 3000000) | urlencode }}",
    "{{ ([[0] * 1000000] * 10) | sum(start=[]) | length }}",
    "{{ dict.fromkeys(range(100), 'x' * 1000000) }}",
    "{{ lipsum(100000) }}",
]
# Values that grow step by step (a loop): refused as they pass the limit, so under a
# 4 M-character limit the peak stays near 4 MB (80 MB and more without the bound).
GROWN = [
    "{% set t %}{% for i in range(100) %}{{ 'x' * 1000000 }}{% endfor %}{% endset %}",
    "{% macro m() %}{% for i in range(100) %}{{ 'x' * 1000000 }}{% endfor %}{% endmacro %}"
    "{{ m() | length }}",
    "{% set ns = namespace(l=[]) %}{% for i in range(100) %}"
    "{% set ns.l = ns.l + ['x' * 1000000] %}{% endfor %}",
    "{{ range(100) | map('string') | map('center', 1000000) | join | length }}",
    "{{ range(100) | map('string') | map('center', 1000000) | list | length }}",
]


@pytest.fixture(params=["trusted", "request"])
def render(request, smollm2_tokenizer, monkeypatch):
    """Render a template as the model's own chat template, or as a request's."""
    messages = [{"role": "user", "content": "Hi"}]

    def render(template: str) -> str:
        if request.param == "trusted":
            monkeypatch.setattr(smollm2_tokenizer, "chat_template", template)
            return render_chat_template(smollm2_tokenizer, messages, True, False, {})
        return render_chat_template(smollm2_tokenizer, messages, True, False,
                                    {"chat_template": template})

    return render


def refused_peak(render, template: str) -> int:
    """The render's peak of traced memory; it must be refused for its size."""
    template_sandbox.compile_chat_template(template)  # compiled outside the measure
    tracemalloc.start()
    try:
        with pytest.raises(template_sandbox.TemplateLimitError,
                           match="would build a value of more than|pads a string|"
                                 "Range too big"):
            render(template)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("template", PLANNED)
def test_a_value_past_the_limit_is_refused_before_it_is_built(render, template):
    assert refused_peak(render, template) < PEAK_BYTES


@pytest.mark.parametrize("template", GROWN)
def test_a_value_grown_step_by_step_is_refused_as_it_passes_the_limit(render, template):
    limits = template_sandbox.TemplateLimits(max_output_chars=4 * MB)
    with template_sandbox.template_limits(limits):
        assert refused_peak(render, template) < 2 * 4 * MB


REAL = """{%- set ns = namespace(system='', n=0) %}
{%- for message in messages %}{% if message.role == 'system' %}
{%- set ns.system = ns.system + message.content + '\\n\\n' %}{% endif %}{% endfor %}
{%- for message in messages %}{% set content = message.content %}
{%- if message.role == 'assistant' and '</think>' in content %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}
{{- '<|im_start|>' + message.role + '\\n' + content | trim }}
{%- for call in message.tool_calls or [] %}{{ '\\n<tool_call>' ~ call.function.name }}
{{- call.function.arguments | tojson(indent=2) }}{% endfor %}{{ '<|im_end|>\\n' }}
{%- set ns.n = ns.n + 1 %}{% endfor %}{% set content = messages[-1].content %}
{{- ns.system | length }} {{ ns.n }} {{ messages | map(attribute='role') | join(', ') }}
{{- messages | selectattr('role', 'equalto', 'user') | list | length }}
{{- '%s-%d' | format('a', 3) }}{{ 'x' | center(20) }}{{ '{:>6}'.format(7) }}
{{- (content | wordwrap(80)) | length }} {{ content | indent(2) | length }}
{{- content.replace('a', 'bb') | length }} {{ messages | tojson | length }}
{{- (content * 2) | length }} {{ content.upper() | length }} {{ content | e | length }}
{{- messages | pprint | length }} {{ content.split() | length }} {{ tools | tojson }}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""


def test_a_real_templates_work_renders_as_jinjas_own_sandbox_renders_it():
    """Nothing a real template does on a large conversation (600 K characters) is
    refused or changed by the planning."""
    word = "lorem ipsum a<b dolor, sit amet \u00e9\u4e2d "
    content = word * (100_000 // len(word))
    messages = [{"role": "system", "content": "Be brief."}] + [
        {"role": "user", "content": content},
        {"role": "assistant", "content": "<think>t</think>" + content,
         "tool_calls": [{"function": {"name": "f", "arguments": {"a": [1, {"b": "c"}]}}}]},
    ] * 3
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = template_sandbox._tojson
    variables = {"messages": messages, "tools": tools, "add_generation_prompt": True}
    want = env.from_string(REAL).render(**variables)
    assert template_sandbox.render(REAL, **variables) == want
    assert len(want) > 600_000
