"""Ray's driver-side tests run in a child pytest, one child per case module.

Why: a Ray driver whose local raylet dies is ended by Ray's own core worker
(`_exit(1)`, "Exiting because the Raylet IPC connection failed and the local Raylet
is dead"). Run in this process, that ends the whole `make test` run mid-line with
exit code 1 and no report: CI at stop 45 stopped that way at 29%, inside
`test_killed_rank_actor_is_replaced_in_its_bundle`. In a child, the same crash fails
one test here, and its message carries the child's report and the warning, error and
fatal lines of the private head's Ray logs (the head's temp dir is left behind when
its driver dies, under the child's TMPDIR, a short-lived directory of this test's).

The cases themselves (`ray_group_cases.py`, `ray_head_cases.py`) are ordinary pytest
modules: `pytest tests/executor/ray_group_cases.py` runs one directly.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent
LOG_LINES = 40
# Ray's glog lines are "[date time L pid tid] ..." with L the level; a crash adds
# "Check failed" and "*** ..." stack lines. Its Python processes (the agents) log
# "date time\tLEVEL file:line -- ..." and die with a traceback ending "SomeError: ...".
TELLING = re.compile(r"^\[\S+ \S+ [WEF] |\t(WARNING|ERROR|CRITICAL) |^Traceback |"
                     r"^\w*(Error|Exception)\b|Check failed|^\*\*\*|SIG[A-Z]+|[Kk]illed")
# Warnings every 10 s from a head started without Ray's metrics agent (no dashboard).
NOISE = re.compile(r"Failed to export metrics|metrics agent|event\+metrics exporter")
CHILD_TIMEOUT_S = 480  # under the suite's 600 s a test, so a hang still reports here


def ray_log_tails(root: Path) -> str:
    """Every Ray log of each private head under `root` (raylet, GCS, the driver's core
    worker, the actors'), cut to what says why a process died:
    warning, error and fatal lines and crash traces, not the periodic state dumps."""
    parts = []
    for log in sorted(root.glob("pagoda-ray-*/session_*/logs/*")):
        if log.is_file() and not log.parent.parent.is_symlink():
            lines = log.read_text(errors="replace").splitlines()
            telling = [line for line in lines
                       if TELLING.search(line) and not NOISE.search(line)][-LOG_LINES:]
            if telling:
                parts.append(f"--- {log.relative_to(root)} ---\n" + "\n".join(telling))
    return "\n".join(parts) or "(no Ray logs were left behind)"


@pytest.mark.parametrize("module", [
    "ray_group_cases.py",
    pytest.param("ray_head_cases.py", marks=pytest.mark.extended),  # make test-extended
])
def test_ray_cases_pass_in_their_own_process(module):
    # Not pytest's tmp_path: Ray's socket paths under it would pass AF_UNIX's 107 bytes.
    with tempfile.TemporaryDirectory(prefix="pgr-") as short_tmp:
        run_in_child(module, Path(short_tmp))


def run_in_child(module: str, tmp: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp)}
    child = subprocess.Popen(
        # -v names each case as it starts: a child killed at the timeout shows which ran.
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", str(HERE / module)],
        cwd=HERE.parent.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        output, _ = child.communicate(timeout=CHILD_TIMEOUT_S)
        ended = f"exited with {child.returncode}"
    except subprocess.TimeoutExpired:
        child.kill()
        output, _ = child.communicate()
        ended = f"was killed after {CHILD_TIMEOUT_S} s"
    report = output[-6000:]
    assert child.returncode == 0, (
        f"{module} {ended}:\n{report}\n{ray_log_tails(tmp)}")
    assert " passed" in report, report  # it ran its cases, not none
