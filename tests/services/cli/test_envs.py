"""vLLM's environment variables, each with its effect, behind Pagoda's own names."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from pagoda.metrics.stat_logger import log_stats_interval
from pagoda.services.cli.main import build_parser, main
from pagoda.services.cli.serve import build_services
from pagoda.services.common.logs import setup_logging

NAMES = ["API_KEY", "LOG_LEVEL", "LOGGING_LEVEL", "CONFIGURE_LOGGING", "LOGGING_CONFIG_PATH",
         "LOG_STATS_INTERVAL", "ENGINE_READY_TIMEOUT_S"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in NAMES:
        monkeypatch.delenv(f"PAGODA_{name}", raising=False)
        monkeypatch.delenv(f"VLLM_{name}", raising=False)


@pytest.fixture
def root_logger():
    """The root logger, restored after the test (setup_logging reconfigures it)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


def parse(argv):
    return build_parser().parse_args(argv)


def test_api_key(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "vllm-key")
    assert parse(["gateway"]).api_key == "vllm-key"
    args = parse(["serve"])
    gateway = next(s for s in build_services(args, "redis://x") if s.name == "gateway")
    assert gateway.env["PAGODA_API_KEY"] == "vllm-key"  # the gateway requires it
    monkeypatch.setenv("PAGODA_API_KEY", "pagoda-key")
    assert parse(["gateway"]).api_key == "pagoda-key"  # Pagoda's name wins
    assert parse(["gateway", "--api-key", "flag"]).api_key == "flag"  # the flag wins


def test_logging_level(monkeypatch, root_logger):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "debug")
    setup_logging("test")
    assert root_logger.level == logging.DEBUG
    monkeypatch.setenv("PAGODA_LOG_LEVEL", "ERROR")
    setup_logging("test")
    assert root_logger.level == logging.ERROR


def test_configure_logging_off_leaves_logging_alone(monkeypatch, root_logger, tmp_path):
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    before = (root_logger.handlers[:], root_logger.level)
    setup_logging("test")
    assert (root_logger.handlers, root_logger.level) == before
    # Asking for a config file while configuration is off is a contradiction (vLLM's rule).
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(tmp_path / "logging.json"))
    with pytest.raises(RuntimeError, match="VLLM_CONFIGURE_LOGGING.*VLLM_LOGGING_CONFIG_PATH"):
        setup_logging("test")


def test_logging_config_path(monkeypatch, root_logger, tmp_path):
    log_file = tmp_path / "pagoda.log"
    config = {"version": 1, "disable_existing_loggers": False,
              "formatters": {"plain": {"format": "CUSTOM|%(name)s|%(message)s"}},
              "handlers": {"file": {"class": "logging.FileHandler", "filename": str(log_file),
                                    "formatter": "plain"}},
              "root": {"level": "INFO", "handlers": ["file"]}}
    path = tmp_path / "logging.json"
    path.write_text(json.dumps(config))
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(path))
    setup_logging("test")
    logging.getLogger("pagoda.test").info("hello from the config")
    for handler in root_logger.handlers:
        handler.flush()
    assert log_file.read_text() == "CUSTOM|pagoda.test|hello from the config\n"
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(tmp_path / "missing.json"))
    with pytest.raises(RuntimeError, match="does not exist"):
        setup_logging("test")


def test_log_stats_interval(monkeypatch):
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "2.5")
    args = parse(["serve"])
    assert log_stats_interval(args) == 2.5
    scheduler = next(s for s in build_services(args, "redis://x") if s.name == "scheduler")
    assert scheduler.argv[scheduler.argv.index("--log-stats-interval") + 1] == "2.5"
    assert log_stats_interval(parse(["scheduler"])) == 2.5
    monkeypatch.setenv("PAGODA_LOG_STATS_INTERVAL", "7")
    assert log_stats_interval(parse(["scheduler"])) == 7.0


def test_engine_ready_timeout():
    """`pagoda serve` gives up on services not healthy within the variable's seconds."""
    env = {**os.environ, "VLLM_ENGINE_READY_TIMEOUT_S": "0.5", "PAGODA_ENGINE_READY_TIMEOUT_S": ""}
    out = subprocess.run([sys.executable, "-m", "pagoda.services.cli.main", "serve"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1
    assert "services not healthy after 0s" in out.stderr  # vs the 900 s default


def test_a_bad_value_names_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_ENGINE_READY_TIMEOUT_S", "soon")
    assert main(["serve"]) == 2
    assert "VLLM_ENGINE_READY_TIMEOUT_S='soon'" in capsys.readouterr().err


def test_help_lists_both_names():
    out = subprocess.run([sys.executable, "-m", "pagoda.services.cli.main", "serve", "--help"],
                         capture_output=True, text=True, timeout=120)
    for name in NAMES[:1] + NAMES[3:]:
        assert f"PAGODA_{name}, VLLM_{name}" in out.stdout
    assert "PAGODA_LOG_LEVEL, VLLM_LOGGING_LEVEL" in out.stdout
