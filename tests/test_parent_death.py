"""Children die with their parent, and nothing starts a child through `preexec_fn`
(which would fork the whole process and run Python in the child before exec:
unsafe with gRPC or any other threads running, see `pagoda.parent_death`)."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from serve_cluster import wait_until

from pagoda.parent_death import dying_with_this_process

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="PR_SET_PDEATHSIG is Linux's")


def is_gone(pid: int) -> bool:
    """Exited (a zombie nobody reaped yet counts: it runs no more code)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_child_gets_the_signal_when_its_parent_is_killed():
    parent_code = textwrap.dedent("""
        import signal, subprocess, time
        from pagoda.parent_death import dying_with_this_process
        child = subprocess.Popen(dying_with_this_process(["sleep", "600"], signal.SIGTERM))
        print(child.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE)
    try:
        child = int(parent.stdout.readline())
        assert not is_gone(child)
    finally:
        parent.kill()
        parent.wait()
    # Killed, the parent ran no clean-up: only the child's own setting stops `sleep`.
    assert wait_until(lambda: is_gone(child), 30)


def test_a_child_whose_parent_is_already_gone_dies_at_once():
    """The parent died before the child's prctl: the child was re-parented, sees a
    parent pid that is not the one it was given, and acts on the signal itself."""
    not_its_parent = os.getppid()
    done = subprocess.run([sys.executable, "-m", "pagoda.parent_death", str(not_its_parent),
                           "SIGTERM", "sleep", "600"], timeout=60)
    assert done.returncode == -signal.SIGTERM


def test_the_wrapped_program_runs_as_the_same_process():
    done = subprocess.run(dying_with_this_process([sys.executable, "-c", "print('ran')"]),
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "ran\n")


def test_no_child_is_started_through_preexec_fn():
    offences = []
    for folder in (ROOT / "libs", ROOT / "services"):
        for path in folder.rglob("*.py"):
            if "_proto" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.keyword) and node.arg == "preexec_fn":
                    offences.append(f"{path.relative_to(ROOT)}:{node.value.lineno}")
    assert not offences, "preexec_fn forks a threaded process: " + ", ".join(offences)
