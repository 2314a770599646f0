"""The start-up line every service logs, and `pagoda bench startup`'s reading of it."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest

from pagoda.services.bench.startup import services_from_log, summary
from pagoda.services.common import startup_clock


@pytest.fixture
def fresh_clock(monkeypatch):
    monkeypatch.setattr(startup_clock, "_phases", [])
    monkeypatch.setattr(startup_clock, "_last", None)
    monkeypatch.setattr(startup_clock, "_reported", False)


def test_process_start_time_is_before_now_and_after_boot():
    started = startup_clock.process_start_time()
    assert started <= time.time()
    # This test process started within the test run, not at boot or in the future.
    assert time.time() - started < 3600


def test_a_fresh_process_reports_its_imports_from_its_start():
    """In a new interpreter, the first phase counts from the process's start: sleeping
    before the first mark shows up in it."""
    code = ("import time; time.sleep(0.6); import logging, sys; "
            "logging.basicConfig(stream=sys.stdout, level=logging.INFO, format='%(message)s'); "
            "from pagoda.services.common import startup_clock as c; c.mark('imports'); "
            "c.report('serving')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    phases, what, total = startup_clock.parse_report(out)
    assert what == "serving"
    assert phases["imports"] >= 0.6
    assert total >= phases["imports"]


def test_report_logs_the_phases_once_and_parse_reads_them_back(fresh_clock, caplog):
    startup_clock.mark("imports")
    time.sleep(0.05)
    startup_clock.mark("model load")
    with caplog.at_level(logging.INFO, logger=startup_clock.__name__):
        startup_clock.report("serving")
        startup_clock.report("serving")  # once per process
    lines = [r.getMessage() for r in caplog.records if "start-up:" in r.getMessage()]
    assert len(lines) == 1
    phases, what, total = startup_clock.parse_report("[gpu-worker] 2026 INFO x " + lines[0])
    assert list(phases) == ["imports", "model load"]
    assert phases["model load"] >= 0.05
    assert what == "serving" and total >= sum(phases.values()) - 0.01


def test_parse_report_ignores_other_lines():
    assert startup_clock.parse_report("[gateway] INFO gateway on http://127.0.0.1:8000") is None


def test_the_bench_places_each_service_on_the_spawn_timeline():
    lines = [
        (10.0, "[kv-cache-manager] INFO start-up: imports 1.00 s, gRPC server 0.10 s; "
               "serving 1.20 s after the process started\n"),
        (15.0, "[tokenizer-0] INFO start-up: imports 2.00 s, tokenizer load 1.00 s; "
               "serving 3.50 s after the process started\n"),
        (16.0, "[tokenizer-1] INFO start-up: imports 2.50 s, tokenizer load 1.00 s; "
               "serving 4.00 s after the process started\n"),
        (12.0, "[gateway] INFO gateway on http://127.0.0.1:8000\n"),
        (9.0, "pagoda serve: start-up: imports 0.70 s, checks and Redis 0.20 s, spawning "
              "services 0.05 s; services started 1.00 s after the process started\n"),
    ]
    services = services_from_log(lines, spawned=8.0)
    assert set(services) == {"kv-cache-manager", "tokenizer", "pagoda serve"}
    assert services["pagoda serve"]["phases"]["imports"] == 0.7
    # The later of two tokenizer replicas is the one the cluster waited for.
    assert services["tokenizer"]["served_s"] == pytest.approx(8.0)
    assert services["tokenizer"]["started_s"] == pytest.approx(4.0)
    assert services["tokenizer"]["phases"] == {"imports": 2.5, "tokenizer load": 1.0}
    table = summary({"cold": [], "warm": [{"ready_s": 9.0, "first_token_s": 9.5,
                                           "services": services}]})
    assert "| warm | 1 | 9.00 (9.00-9.00) | 9.50 (9.50-9.50) |" in table
    assert "| tokenizer | 4.00 | imports 2.50, tokenizer load 1.00 | 8.00 |" in table
