"""Children started with `lifeline_env()` die with their parent, even when it is SIGKILLed (Linux)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from engine.process.lifeline import LIFELINE_ENV, die_with_parent_if_asked

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from engine.process.lifeline import lifeline_env
    child = subprocess.Popen([sys.executable, "-c",
        "from engine.process.lifeline import die_with_parent_if_asked; die_with_parent_if_asked(); import time; "
        "time.sleep(60)"], env={**__import__('os').environ, **lifeline_env()}, start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(60)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_child_dies_with_a_sigkilled_parent() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": REPO})
    child_pid = int(parent.stdout.readline())  # type: ignore[union-attr]
    child = psutil.Process(child_pid)
    time.sleep(1.0)  # the child has set its death signal
    assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)
    child.wait(10)  # raises psutil.TimeoutExpired if the child outlived its parent


def test_no_request_no_effect(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LIFELINE_ENV, raising=False)
    die_with_parent_if_asked()  # nothing asked: this process keeps running


def test_a_parent_gone_already_stops_the_child() -> None:
    code = ("import os; os.environ['KVFLOW_DIE_WITH_PARENT'] = '1'; "  # pid 1 is never our parent here
            "from engine.process.lifeline import die_with_parent_if_asked; die_with_parent_if_asked(); "
            "import time; time.sleep(30)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                            timeout=20)
    assert result.returncode == -signal.SIGTERM
