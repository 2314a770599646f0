"""gpt-oss chats in OpenAI's harmony format, as vLLM renders them (not the jinja template).

vLLM never renders a gpt-oss chat with the checkpoint's chat template: it builds
harmony messages and renders them (its `harmony_utils` over `openai_harmony`). This
module is that rendering, written from the public harmony guide and vLLM's rules:

    <|start|>system<|message|>IDENTITY\nKnowledge cutoff: 2024-06\nCurrent date: DATE
        \n\nReasoning: EFFORT\n\n# Valid channels: analysis, commentary, final. Channel
        must be included for every message.[\nCalls to these tools must go to the
        commentary channel: 'functions'.]<|end|>
    <|start|>developer<|message|># Instructions\n\nTEXT[\n\n# Tools ...]<|end|>
    <|start|>user<|message|>TEXT<|end|>
    <|start|>assistant<|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>ARGS<|call|>
    <|start|>functions.NAME to=assistant<|channel|>commentary<|message|>RESULT<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|end|>
    <|start|>assistant                                   (the generation prompt)

Rules (vLLM's chat-completions path):
- the first message, if system or developer, is the developer message's
  `# Instructions`; a later system/developer message is a developer message of its own;
- the developer message exists when there are instructions or function tools; tools
  are rendered even with tool_choice "none" (vLLM's default);
- `reasoning_effort` (low/medium/high; default medium) goes in the system message;
  the date is today's (`PAGODA_SYSTEM_START_DATE`/`VLLM_SYSTEM_START_DATE` pin it);
- an assistant turn's `reasoning` (or `reasoning_content`) is an analysis message;
  every analysis message before the last final answer is dropped (earlier turns'
  chains of thought), the ones after it (a tool-call round in progress) are kept;
- a tool result names its function through the `tool_call_id` of an earlier call; a
  tool message without one is the request's error (ValueError: a 400).

Invariant: text pieces are tokenized on their own and the control tokens are
inserted as ids (`encode_harmony`), as the reference renderer does, so a message
that contains `<|end|>` as text cannot close its message.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pagoda.envs as envs  # the module, not the package: `pagoda` imports LLM, which imports this
from pagoda.tokenizer.harmony_schema import schema_to_typescript

# The architectures vLLM serves with harmony (its `model_type == "gpt_oss"`).
HARMONY_ARCHITECTURES = frozenset({"GptOssForCausalLM"})
CONTROL_TOKENS = ("<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>",
                  "<|call|>", "<|constrain|>")
# vLLM adds these to a gpt-oss chat's stop_token_ids (harmony's stop tokens for
# assistant actions): the answer is done, or a tool is called.
STOP_TOKENS = ("<|return|>", "<|call|>")
MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
REASONING_EFFORTS = ("low", "medium", "high")
CHANNELS_LINE = ("# Valid channels: analysis, commentary, final. "
                 "Channel must be included for every message.")
FUNCTIONS_LINE = "Calls to these tools must go to the commentary channel: 'functions'."


def uses_harmony(architecture: str | None) -> bool:
    """Whether chats of this architecture are rendered here instead of by a template."""
    return architecture in HARMONY_ARCHITECTURES


@dataclass(frozen=True)
class Control:
    """A harmony control token (one token id), as opposed to text."""

    text: str


Segment = str | Control


@dataclass
class _Message:
    author: str  # "system", "developer", "user", "assistant" or "functions.NAME"
    content: str
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None

    def segments(self, open_: bool = False) -> list[Segment]:
        header: list[Segment] = [Control("<|start|>"), self.author]
        if self.recipient is not None:
            header.append(f" to={self.recipient}")
        if self.channel is not None:
            header += [Control("<|channel|>"), self.channel]
        if self.content_type is not None:
            header.append(f" {self.content_type}")
        body: list[Segment] = [Control("<|message|>"), self.content]
        if open_:  # continue_final_message: the message stays open
            return header + body
        calls = self.author == "assistant" and self.recipient is not None
        return header + body + [Control("<|call|>" if calls else "<|end|>")]


def harmony_segments(messages: Sequence[Mapping[str, Any]],
                     tools: Sequence[Mapping[str, Any]] | None = None,
                     reasoning_effort: str | None = None,
                     add_generation_prompt: bool = True,
                     continue_final_message: bool = False,
                     current_date: str | None = None) -> list[Segment]:
    """The prompt of an OpenAI chat (messages as `tokenizer.chat.normalize_messages`
    leaves them, or raw: content a string or text parts) as text and control tokens.
    ValueError naming the field for what harmony cannot express."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                         "true: the first continues the last message, the second starts a "
                         "new assistant message.")
    if not messages:
        raise ValueError("messages must be a non-empty list of chat messages.")
    instructions, rest, offset = _leading_instructions(messages)
    functions = _function_tools(tools)
    rendered = [_Message("system", _system_text(reasoning_effort, current_date, bool(functions)))]
    if instructions is not None or functions:
        rendered.append(_Message("developer", _developer_text(instructions, functions)))
    conversation: list[_Message] = []
    call_names: dict[str, str] = {}
    for i, message in enumerate(rest, start=offset):
        conversation += _convert(message, f"messages[{i}]", call_names)
    conversation = _drop_old_analysis(conversation)
    if continue_final_message and (not conversation or conversation[-1].author != "assistant"):
        raise ValueError("continue_final_message is set but the final message is not an "
                         "assistant message with content.")
    out: list[Segment] = []
    for j, message in enumerate(rendered + conversation):
        last = j == len(rendered) + len(conversation) - 1
        out += message.segments(open_=continue_final_message and last)
    if add_generation_prompt:
        out += [Control("<|start|>"), "assistant"]
    return out


def render_harmony(*args: Any, **kwargs: Any) -> str:
    """The prompt text of `harmony_segments(...)`."""
    return segments_text(harmony_segments(*args, **kwargs))


def segments_text(segments: Sequence[Segment]) -> str:
    """The text of rendered segments (the prompt text a reply, a log or echo shows)."""
    return "".join(s.text if isinstance(s, Control) else s for s in segments)


def encode_harmony(tokenizer: Any, segments: Sequence[Segment]) -> list[int]:
    """Token ids: each text piece encoded on its own with its special-token look-alikes
    kept as text, each control token its single id. ValueError when the tokenizer
    lacks a control token (not a gpt-oss tokenizer)."""
    ids: list[int] = []
    for segment in segments:
        if isinstance(segment, Control):
            ids.append(control_token_id(tokenizer, segment.text))
        elif segment:
            ids += tokenizer.encode(segment, add_special_tokens=False, split_special_tokens=True)
    return ids


def control_token_id(tokenizer: Any, token: str) -> int:
    """The id of harmony control token `token`; ValueError if it is not one token."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or token_id == getattr(tokenizer, "unk_token_id", None) \
            or tokenizer.convert_ids_to_tokens(token_id) != token:
        raise ValueError(f"This tokenizer has no single token for the harmony control token "
                         f"{token}: gpt-oss chats (the harmony format) need gpt-oss's tokenizer.")
    return token_id


def stop_token_ids(tokenizer: Any) -> list[int]:
    """vLLM's extra stop tokens for gpt-oss chats: <|return|> and <|call|>."""
    return [control_token_id(tokenizer, t) for t in STOP_TOKENS]


def effort_from_kwargs(chat_template_kwargs: Mapping[str, Any] | None) -> str | None:
    """The request's `reasoning_effort` (the chat route puts it in chat_template_kwargs)."""
    return (chat_template_kwargs or {}).get("reasoning_effort")


# ---------------------------------------------------------------- the parts
def _leading_instructions(messages: Sequence[Mapping[str, Any]]
                          ) -> tuple[str | None, Sequence[Mapping[str, Any]], int]:
    """(the first message's text if it is system/developer, the other messages, the
    index of the first of them)."""
    first = messages[0]
    if isinstance(first, Mapping) and first.get("role") in ("system", "developer"):
        return _text(first.get("content"), "messages[0].content"), messages[1:], 1
    return None, messages, 0


def _system_text(effort: str | None, current_date: str | None, has_functions: bool) -> str:
    effort = "medium" if effort is None else effort
    if effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort={effort!r} is not supported by the harmony format "
                         f"(gpt-oss); supported: {', '.join(REASONING_EFFORTS)}.")
    date = current_date or envs.get("PAGODA_SYSTEM_START_DATE") or \
        datetime.datetime.now().strftime("%Y-%m-%d")
    channels = CHANNELS_LINE + ("\n" + FUNCTIONS_LINE if has_functions else "")
    return (f"{MODEL_IDENTITY}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\nCurrent date: {date}"
            f"\n\nReasoning: {effort}\n\n{channels}")


def _developer_text(instructions: str | None, functions: list[Mapping[str, Any]]) -> str:
    sections = []
    if instructions is not None:
        sections += ["# Instructions", instructions]
    if functions:
        sections.append(_tools_section(functions))
    return "\n\n".join(sections)


def _function_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[Mapping[str, Any]]:
    functions = []
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function" \
                or not isinstance(tool.get("function"), Mapping):
            raise ValueError(f"tools[{i}]: only function tools are supported with gpt-oss's "
                             "harmony format.")
        functions.append(tool["function"])
    return functions


def _tools_section(functions: list[Mapping[str, Any]]) -> str:
    lines = ["## functions\n", "namespace functions {\n"]
    for function in functions:
        lines += [f"// {line}" for line in _lines(function.get("description") or "")]
        parameters = function.get("parameters")
        if parameters is None:
            lines.append(f"type {function.get('name')} = () => any;\n")
        else:
            lines.append(f"type {function.get('name')} = (_: "
                         f"{schema_to_typescript(parameters)}) => any;\n")
    lines.append("} // namespace functions")
    return "# Tools\n\n" + "\n".join(lines)


def _lines(text: str) -> list[str]:
    """`text` split into lines as the reference does (no empty last line)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def _convert(message: Mapping[str, Any], where: str, call_names: dict[str, str]
             ) -> list[_Message]:
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} must be an object with 'role' and 'content'.")
    role = message.get("role")
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ValueError(f"{where}.reasoning must be a string.")
    if role == "assistant":
        out = []
        content = _text(message.get("content"), f"{where}.content")
        calls = message.get("tool_calls") or []
        if calls:  # vLLM's order: a preamble, the reasoning, then the calls
            if content:
                out.append(_Message("assistant", content, "commentary"))
            if reasoning:
                out.append(_Message("assistant", reasoning, "analysis"))
            for j, call in enumerate(calls):
                name, arguments, call_id = _call(call, f"{where}.tool_calls[{j}]")
                if call_id:
                    call_names[call_id] = name
                out.append(_Message("assistant", arguments, "commentary",
                                    f"functions.{name}", "json"))
            return out
        if reasoning:
            out.append(_Message("assistant", reasoning, "analysis"))
        if content:
            out.append(_Message("assistant", content, "final"))
        return out
    if role in ("tool", "function"):
        name = message.get("name") if role == "function" else \
            call_names.get(message.get("tool_call_id") or "")
        if not name:
            raise ValueError(
                f"{where}.tool_call_id {message.get('tool_call_id')!r} does not answer any "
                "earlier assistant tool call: a tool result must follow the call it answers.")
        return [_Message(f"functions.{name}", _text(message.get("content"), f"{where}.content")
                         or "", "commentary", "assistant")]
    if role in ("system", "developer"):
        return [_Message("developer", _developer_text(
            _text(message.get("content"), f"{where}.content") or "", []))]
    if role == "user":
        return [_Message("user", _text(message.get("content"), f"{where}.content") or "")]
    raise ValueError(f"{where}.role {role!r} is not a chat role.")


def _call(call: Any, where: str) -> tuple[str, str, str]:
    """(function name, arguments as the JSON text, call id) of an assistant tool call."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where}.function.name is required.")
    arguments = function.get("arguments") or ""
    if isinstance(arguments, Mapping):  # offline callers may give the object itself
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise ValueError(f"{where}.function.arguments must be a JSON string.")
    call_id = call.get("id") or ""
    return function["name"], arguments, call_id if isinstance(call_id, str) else ""


def _text(content: Any, where: str) -> str | None:
    """A content as one string: text parts are concatenated (vLLM's harmony reading)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, bytes):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type") in ("text", "input_text") \
                    and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise ValueError(f"{where}[{j}]: gpt-oss's harmony format takes text only.")
        return "".join(texts)
    raise ValueError(f"{where} must be a string or a list of text parts.")


def _drop_old_analysis(messages: list[_Message]) -> list[_Message]:
    """Drop analysis messages before the last final answer (vLLM's auto-drop)."""
    last_final = max((i for i, m in enumerate(messages)
                      if m.author == "assistant" and m.channel == "final"), default=-1)
    return [m for i, m in enumerate(messages) if not (i < last_final and m.channel == "analysis")]
