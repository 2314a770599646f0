"""`--config FILE.yaml`: a command's flags read from a YAML file, as `vllm serve --config`.

Keys are long flag names, with dashes or underscores (`max-model-len`,
`max_model_len`); `model` (or a command's positional name) sets the positional
model. Values follow vLLM's reading:
  * a boolean sets a switch (`enforce-eager: true`; `enable-prefix-caching: false` is
    `--no-enable-prefix-caching`), and `false` on an on-only switch leaves it off;
  * a list fills a flag that takes several values (`served-model-name: [a, b]`) and
    is written as JSON for a flag that takes one (`allowed-origins: ["*"]`);
  * a mapping is written as JSON (`override-generation-config: {temperature: 0.5}`);
  * anything else is the flag's text, checked by the flag's own type and choices.
Priority: command line > config file > environment > built-in default, because the
file's values become the parse's starting namespace and flags given on the command
line overwrite them. A key that names no flag is an error naming the key.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import yaml

from pagoda.services.cli.vllm_flags import unknown_key_message


class ConfigFileError(ValueError):
    """A config file that cannot be used; the message names the file (and key)."""


def read_config_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigFileError(f"cannot read config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"config file {path} must map flag names to values, got "
                              f"{type(data).__name__}")
    return data


def config_values(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """{namespace attribute: value} for every key of the file, converted and checked by
    `parser`'s own actions (a bad value exits through `parser.error`)."""
    options = {opt: a for a in parser._actions for opt in a.option_strings
               if opt.startswith("--")}
    positionals = {a.dest: a for a in parser._actions if not a.option_strings}
    values: dict[str, Any] = {}
    tokens: list[str] = []
    token_dests: list[str] = []
    for key, value in read_config_file(path).items():
        flag = "--" + str(key).replace("_", "-")
        action = options.get(flag)
        if action is None and str(key) in positionals:
            values[str(key)] = value if value is None else str(value)
            continue
        if action is None:
            raise ConfigFileError(unknown_key_message(path, key, parser.prog))
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)) \
                or action.dest == "config":
            raise ConfigFileError(f"config file {path}: key {key!r} cannot be set in a "
                                  f"config file")
        if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreConstAction)):
            switch = _switch_value(action, flag, value, path, key)
            if switch is not _UNSET:
                values[action.dest] = switch
            continue
        tokens += _tokens(action, flag, value)
        token_dests.append(action.dest)
    if tokens:
        values.update(_parse_tokens(parser, tokens, token_dests))
    return values


_UNSET = object()


def _switch_value(action: argparse.Action, flag: str, value: Any, path: str, key: Any) -> Any:
    if not isinstance(value, bool):
        raise ConfigFileError(f"config file {path}: key {key!r} is a switch; give true or "
                              f"false, not {value!r}")
    if isinstance(action, argparse.BooleanOptionalAction):
        return (not value) if flag.startswith("--no-") else value
    return action.const if value else _UNSET


def _tokens(action: argparse.Action, flag: str, value: Any) -> list[str]:
    """The command-line words that set `value` through `action`."""
    takes_many = action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1)
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return [word for item in items for word in (flag, _text(item))]
    if isinstance(value, list) and takes_many:
        return [flag, *map(_text, value)]
    return [flag, _text(value)]


def _text(value: Any) -> str:
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _parse_tokens(parser: argparse.ArgumentParser, tokens: list[str],
                  dests: list[str]) -> dict[str, Any]:
    """Parse only `tokens` with `parser`'s actions (types, choices), no required checks."""
    required = [a for a in parser._actions if a.required]
    for action in required:
        action.required = False
    try:
        namespace, _ = argparse.ArgumentParser.parse_known_args(parser, tokens,
                                                               argparse.Namespace())
    finally:
        for action in required:
            action.required = True
    return {dest: getattr(namespace, dest) for dest in dests}
