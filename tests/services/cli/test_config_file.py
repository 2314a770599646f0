"""`--config FILE.yaml` on every command, read as `vllm serve --config` reads it."""

from __future__ import annotations

import textwrap

import pytest

from pagoda.services.cli.main import build_parser
from pagoda.services.cli.serve import build_services
from pagoda.services.cli.services import SERVICES

# A config a vLLM user already has (vLLM's documented example plus common keys), with
# both spellings of keys, lists, booleans and a mapping.
VLLM_CONFIG = """\
model: /models/llama
host: "127.0.0.1"
port: 6379
uvicorn-log-level: "info"
served_model_name: [llama, llama-alias]
max-model-len: 4096
max_num_seqs: 32
enable-prefix-caching: false
enforce-eager: true
dtype: bfloat16
api-key: from-the-file
allowed-origins: ["https://app.example"]
max-logprobs: 5
generation-config: vllm
override-generation-config: {temperature: 0.5}
enable-prompt-tokens-details: true
disable-log-requests: true
trust-remote-code: false
"""


def parse(argv: list[str]):
    return build_parser().parse_args(argv)


def write(tmp_path, text: str, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_serve_reads_a_vllm_config_file(tmp_path):
    args = parse(["serve", "--config", write(tmp_path, VLLM_CONFIG)])
    assert (args.model, args.host, args.port, args.uvicorn_log_level) == \
        ("/models/llama", "127.0.0.1", 6379, "info")
    assert args.served_model_name == ["llama", "llama-alias"]
    assert (args.max_model_len, args.max_num_seqs, args.dtype) == (4096, 32, "bfloat16")
    assert args.enable_prefix_caching is False and args.enforce_eager is True
    assert args.allowed_origins == ["https://app.example"]
    assert args.max_logprobs == 5 and args.generation_config == "vllm"
    assert args.enable_prompt_tokens_details is True and args.enable_log_requests is False
    assert args.trust_remote_code is False
    # What the services are started with follows from it.
    services = {s.name: s for s in build_services(args, "redis://127.0.0.1:1/0")}
    scheduler, gateway = services["scheduler"].argv, services["gateway"].argv
    assert scheduler[scheduler.index("--model") + 1] == "/models/llama"
    assert {"--no-enable-prefix-caching", "--enforce-eager"} <= set(scheduler)
    assert scheduler[scheduler.index("--max-model-len") + 1] == "4096"
    assert gateway[gateway.index("--max-logprobs") + 1] == "5"
    assert gateway[gateway.index("--uvicorn-log-level") + 1] == "info"
    assert "--enable-prompt-tokens-details" in gateway
    assert gateway[gateway.index("--override-generation-config") + 1] == '{"temperature": 0.5}'
    assert services["gateway"].env["PAGODA_API_KEY"] == "from-the-file"


def test_command_line_overrides_the_file(tmp_path):
    config = write(tmp_path, VLLM_CONFIG)
    args = parse(["serve", "/models/other", "--config", config, "--port", "9000",
                  "--enable-prefix-caching", "--served-model-name", "x"])
    assert args.model_tag == "/models/other"  # the positional wins over `model:` (as vLLM)
    assert args.port == 9000 and args.enable_prefix_caching is True
    assert args.served_model_name == ["x"]
    assert args.max_model_len == 4096  # the rest still comes from the file
    # The flag may come before or after the others, in either spelling.
    args = parse(["serve", "--port=9001", f"--config={config}"])
    assert args.port == 9001 and args.host == "127.0.0.1"


@pytest.mark.parametrize("command", sorted(SERVICES))
def test_every_service_takes_a_config_file(tmp_path, command):
    args = parse([command, "--config", write(tmp_path, "port: 12345\nhost: 0.0.0.0\n")])
    assert (args.port, args.host) == (12345, "0.0.0.0")


def test_run_batch_gets_its_required_files_from_the_config(tmp_path):
    config = write(tmp_path, "input_file: in.jsonl\noutput-file: out.jsonl\nskip-done: true\n"
                             "max-model-len: 128\n")
    args = parse(["run-batch", "--config", config])
    assert (args.input_file, args.output_file, args.skip_done, args.max_model_len) == \
        ("in.jsonl", "out.jsonl", True, 128)
    assert parse(["run-batch", "--config", config, "-o", "-"]).output_file == "-"


@pytest.mark.parametrize("text,expected", [
    ("max-modle-len: 10\n", "unknown key 'max-modle-len': pagoda serve has no --max-modle-len"),
    ("cpu_offload_gb: 4\n", "key 'cpu_offload_gb' (vLLM's --cpu-offload-gb) is "
                            "not supported by Pagoda: weight offloading"),
    ("enforce-eager: maybe\n", "key 'enforce-eager' is a switch; give true or false"),
    ("port: eighty\n", "argument --port: invalid int value: 'eighty'"),
    ("dtype: int4\n", "argument --dtype: invalid choice: 'int4'"),
    ("- port\n- 80\n", "must map flag names to values, got list"),
    ("port: [80\n", "is not valid YAML"),
])
def test_a_bad_file_is_an_error_naming_the_file_and_key(tmp_path, capsys, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(SystemExit) as exit_info:
        parse(["serve", "--config", path])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert path in err and expected in err


def test_a_missing_file_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse(["gateway", "--config", str(tmp_path / "nope.yaml")])
    assert "cannot read config file" in capsys.readouterr().err
