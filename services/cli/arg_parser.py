"""The `pagoda` command line's parser: `--config` files and vLLM-aware errors.

`PagodaArgumentParser` is the class of the top-level parser, so argparse makes every
subcommand's parser one too. Over plain argparse it adds:
  * `--config FILE.yaml` on every command that has the option (`add_config_option`):
    the file's values are the starting namespace, command-line flags override them
    (config_file.py states the reading rules);
  * unknown flags: a line per flag saying it is not supported by Pagoda, and why when
    it is one of vLLM's (vllm_flags.py), instead of argparse's usage dump;
  * no abbreviations: `--max-log` must not silently mean `--max-logprobs`, and a
    vLLM flag Pagoda lacks must not be taken for a Pagoda flag it is a prefix of;
  * descriptions and epilogs keep their line breaks (the environment table).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pagoda.services.cli.config_file import ConfigFileError, config_values
from pagoda.services.cli.vllm_flags import unknown_flags_message

CONFIG_OPTION = "--config"
# Where an unknown flag was found (the innermost subcommand), carried up to `parse_args`.
_UNKNOWN_PROG = "_pagoda_unknown_flags_prog"


class PagodaArgumentParser(argparse.ArgumentParser):
    """argparse with `--config` files, vLLM-aware unknown-flag errors and no abbreviations."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)
        self._reading_config: str | None = None  # the file being read, for error messages

    def add_config_option(self) -> None:
        self.add_argument(CONFIG_OPTION, metavar="FILE.yaml", default=None,
                          help="Read flags from a YAML file (keys: long flag names, with "
                               "dashes or underscores); flags given here override it, as with "
                               "`vllm serve --config`.")

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        paths: list[str] = []
        if any(CONFIG_OPTION in a.option_strings for a in self._actions):
            paths, args = _pop_config_paths(args)
        relaxed: list[argparse.Action] = []
        if paths:
            namespace = namespace if namespace is not None else argparse.Namespace()
            values = self._read_config_files(paths)
            for dest, value in values.items():
                setattr(namespace, dest, value)
            namespace.config = paths[-1]
            # A required flag the file sets is no longer missing.
            relaxed = [a for a in self._actions if a.required and a.dest in values]
            for action in relaxed:
                action.required = False
        try:
            namespace, extras = super().parse_known_args(args, namespace)
        finally:
            for action in relaxed:
                action.required = True
        if any(_is_flag(a) for a in extras) and not hasattr(namespace, _UNKNOWN_PROG):
            setattr(namespace, _UNKNOWN_PROG, self.prog)
        return namespace, extras

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        flags = [a for a in extras if _is_flag(a)]
        if flags:
            prog = getattr(namespace, _UNKNOWN_PROG, self.prog)
            self.exit(2, unknown_flags_message(prog, flags) + "\n")
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace

    def error(self, message: str):
        if self._reading_config is not None:
            message = f"config file {self._reading_config}: {message}"
        super().error(message)

    def _read_config_files(self, paths: list[str]) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for path in paths:  # a later file overrides an earlier one
            self._reading_config = path
            try:
                values.update(config_values(self, path))
            except ConfigFileError as exc:
                self.exit(2, f"{self.prog}: error: {exc}\n")
            finally:
                self._reading_config = None
        return values


def _pop_config_paths(args: list[str]) -> tuple[list[str], list[str]]:
    """(the --config paths, the other words), up to a `--` terminator."""
    paths, rest = [], []
    i = 0
    while i < len(args):
        word = args[i]
        if word == "--":
            rest += args[i:]
            break
        if word == CONFIG_OPTION and i + 1 < len(args):
            paths.append(args[i + 1])
            i += 2
            continue
        if word.startswith(CONFIG_OPTION + "="):
            paths.append(word.split("=", 1)[1])
        else:
            rest.append(word)
        i += 1
    return paths, rest


def _is_flag(word: str) -> bool:
    """`--name` or `-x`, not `-` (stdin) nor a negative number."""
    return word.startswith("-") and word != "-" and not _is_number(word)


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True
