"""`kill -USR1` on a ktrans command prints every thread's Python stack to stderr and the command runs on (what the
device scripts send a benchmark that ran out of time, so a stuck run says where it waited)."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 on this platform")
def test_sigusr1_dumps_the_stacks_and_the_process_runs_on():
    code = ("import os, signal, time\n"
            "from ktrans.cli import _stacks_on_sigusr1\n"
            "_stacks_on_sigusr1()\n"
            "def waiting_here():\n"
            "    os.kill(os.getpid(), signal.SIGUSR1)\n"
            "    time.sleep(0.2)\n"
            "waiting_here()\n"
            "print('still running')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "still running"
    assert "waiting_here" in r.stderr and "Current thread" in r.stderr
