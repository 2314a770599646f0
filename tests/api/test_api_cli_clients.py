"""`pagoda chat` and `pagoda complete` against a running gateway (fakes behind it)."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from api_fakes import MODEL, SCRIPT, Gateway

from pagoda.services.cli.chat import chat_loop, make_client
from pagoda.services.cli.complete import complete_loop
from pagoda.services.cli.main import build_parser
from pagoda.free_ports import free_port

pytestmark = pytest.mark.extended  # make test-extended


def script_text(tokenizer, n: int) -> str:
    return tokenizer.decode(tokenizer.encode(SCRIPT, add_special_tokens=False)[:n])


def run_cli(*argv: str, stdin: str = "", env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagoda.services.cli.main", *argv], input=stdin,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_chat_keeps_the_conversation(gateway, smollm2_tokenizer):
    args = build_parser().parse_args(["chat", "--url", f"{gateway.url}/v1", "--max-tokens", "4",
                                      "--system-prompt", "Be brief."])
    client, model = make_client(args)
    out, err = io.StringIO(), io.StringIO()
    assert chat_loop(client, model, args, ["Hello", "And then?"], out, err) == 0
    answer = script_text(smollm2_tokenizer, 4)
    assert model == MODEL and out.getvalue() == f"{answer}\n{answer}\n" and not err.getvalue()
    second = smollm2_tokenizer.decode(list(gateway.scheduler.requests[-1].prompt_token_ids))
    for part in ("Be brief.", "Hello", answer, "And then?"):
        assert part in second  # the whole conversation went with the second message


def test_chat_reports_errors_and_goes_on(gateway, smollm2_tokenizer):
    args = build_parser().parse_args(["chat", "--url", f"{gateway.url}/v1", "--max-tokens",
                                      "300"])
    client, model = make_client(args)
    out, err = io.StringIO(), io.StringIO()
    args.max_tokens = 300  # beyond the fake's context: a 400 for the first message
    assert chat_loop(client, model, args, ["Hello"], out, err) == 0
    assert "maximum context length" in err.getvalue()
    args.max_tokens = 2
    assert chat_loop(client, model, args, ["Hello"], out, err) == 0
    assert out.getvalue().strip() == script_text(smollm2_tokenizer, 2).strip()


def test_complete_streams_each_prompt(gateway, smollm2_tokenizer):
    args = build_parser().parse_args(["complete", "--url", f"{gateway.url}/v1",
                                      "--max-tokens", "3", "--model-name", MODEL])
    client, model = make_client(args)
    out = io.StringIO()
    assert complete_loop(client, model, args, ["One", "Two"], out, io.StringIO()) == 0
    assert out.getvalue() == f"{script_text(smollm2_tokenizer, 3)}\n" * 2


@pytest.mark.parametrize("command", ["chat", "complete"])
def test_cli_quick_interactive_and_api_key(fake_peers, smollm2_tokenizer, command):
    gw = Gateway(fake_peers, api_key="k-1")
    try:
        url = ["--url", f"{gw.url}/v1", "--max-tokens", "3"]
        quick = run_cli(command, *url, "--api-key", "k-1", "-q", "Hi")
        assert quick.returncode == 0, quick.stderr
        assert quick.stdout == script_text(smollm2_tokenizer, 3) + "\n"
        session = run_cli(command, *url, stdin="Hi\nAgain\n", env={"PAGODA_API_KEY": "k-1"})
        assert session.returncode == 0, session.stderr
        assert session.stdout.count(script_text(smollm2_tokenizer, 3)) == 2
        if command == "chat":  # (the key check is shared: once is enough)
            denied = run_cli(command, *url, "--api-key", "wrong", "-q", "Hi")
            assert denied.returncode == 1 and "401" in denied.stderr
    finally:
        gw.stop()


def test_cli_unreachable_server_exits_1():
    result = run_cli("complete", "--url", f"http://127.0.0.1:{free_port()}/v1", "-q", "Hi")
    assert result.returncode == 1 and "Connection error" in result.stderr
