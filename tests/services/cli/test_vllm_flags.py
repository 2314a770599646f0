"""vLLM command lines: unknown flags named as "not supported by Pagoda", no abbreviations,
--trust-remote-code refused, and the unsupported-flag list kept honest."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pagoda.engine.arg_utils import EngineArgs
from pagoda.services.cli.main import build_parser, main
from pagoda.services.cli.vllm_flags import UNSUPPORTED


def leaf_parsers(parser: argparse.ArgumentParser):
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        yield parser
    for group in groups:
        for child in group.choices.values():
            yield from leaf_parsers(child)


def test_a_vllm_flag_pagoda_lacks_is_named_with_the_reason():
    # As a user would run it: the console script, its stderr and exit code.
    out = subprocess.run([sys.executable, "-m", "pagoda.services.cli.main", "serve",
                          "meta-llama/Llama-3.1-8B-Instruct", "--cpu-offload-gb", "4",
                          "--tool-parser-plugin", "p.py", "--made-up-flag=3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert lines[0].startswith("pagoda serve: error: --cpu-offload-gb (a vLLM flag) is "
                               "not supported by Pagoda: weight offloading is not implemented")
    assert lines[1].startswith("pagoda serve: error: --tool-parser-plugin (a vLLM flag) is "
                               "not supported by Pagoda: parser plugins are not loaded")
    assert lines[2] == ("pagoda serve: error: --made-up-flag is not supported by Pagoda: "
                        "pagoda serve has no such flag (see `pagoda serve --help`).")
    assert "usage:" not in out.stderr


def test_the_innermost_command_is_named(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", "--cpu-offload-gb"])
    assert "pagoda bench serve: error: --cpu-offload-gb (a vLLM flag)" in \
        capsys.readouterr().err


def test_no_abbreviations(capsys):
    # `--max-log` must not silently mean `--max-logprobs` (nor `--max-log-len`).
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-log", "3"])
    assert "--max-log is not supported by Pagoda" in capsys.readouterr().err


def test_no_listed_flag_is_a_pagoda_flag():
    """An entry Pagoda has since implemented would be a stale, wrong message."""
    flags = {o.lstrip("-") for p in leaf_parsers(build_parser()) for a in p._actions
             for o in a.option_strings}
    assert not flags & set(UNSUPPORTED), flags & set(UNSUPPORTED)


def test_trust_remote_code_is_refused_before_anything_starts(capsys):
    assert main(["serve", "--trust-remote-code"]) == 2
    assert "Pagoda runs no remote code" in capsys.readouterr().err
    with pytest.raises(ValueError, match="Pagoda runs no remote code"):
        EngineArgs(trust_remote_code=True).create_engine_config()
    # Saying no is fine.
    assert build_parser().parse_args(["serve", "--no-trust-remote-code"]).trust_remote_code \
        is False


@pytest.mark.parametrize("flags, message", [
    (["--structured-outputs-config", '{"backend": "outlines"}'],
     "backend 'outlines' is not supported; Pagoda has auto, xgrammar, guidance"),
    (["--reasoning-parser", "nope"], "Unknown reasoning parser 'nope'"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "nope"], "Unknown tool-call parser"),
])
def test_bad_parser_and_backend_flags_are_refused_before_anything_starts(flags, message,
                                                                        capsys):
    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err


def test_bad_tls_and_chat_template_flags_are_refused_before_anything_starts(tmp_path, capsys):
    assert main(["serve", "--ssl-keyfile", str(tmp_path / "k.pem")]) == 2
    assert "--ssl-keyfile and --ssl-certfile go together" in capsys.readouterr().err
    assert main(["serve", "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "looks like a file path" in capsys.readouterr().err


def test_vllm_legacy_flags_are_accepted_and_mapped(caplog):
    """vLLM still accepts --task, --tokenizer-mode and --swap-space: a moved command line
    must not exit 2; --task picks the runner, and what changes nothing says so."""
    args = build_parser().parse_args(["serve", "--task", "embed", "--tokenizer-mode", "auto",
                                      "--swap-space", "4"])
    with caplog.at_level("WARNING"):
        engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.runner, engine_args.convert) == ("pooling", "auto")
    assert "swap_space" in caplog.text and "'task' option is deprecated" in caplog.text
    assert EngineArgs(task="generate").runner == "generate"
    assert EngineArgs().runner == "auto"


@pytest.mark.parametrize("kwargs, message", [
    (dict(tokenizer_mode="mistral"), "tokenizer_mode 'mistral' is not supported"),
    (dict(task="embed", runner="generate"), "task 'embed' means runner 'pooling'"),
    (dict(task="transcription"), "Unknown task 'transcription'"),
    (dict(swap_space=-1), "swap_space must be non-negative"),
])
def test_legacy_values_that_cannot_be_honoured_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)
