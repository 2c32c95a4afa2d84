"""Shared fixtures: pairs of engines in this process, and peer processes."""

import os
import subprocess
import sys
import textwrap

import pytest

import te


def config(backend, **stub):
    """An engine configuration for `backend` on loopback (stub options as keywords)."""
    cfg = {"engine": {"backend": backend, "listen": "127.0.0.1:0", "default_timeout": "10s"}}
    if stub:
        cfg["backends"] = {"stub": stub}
    return cfg


@pytest.fixture(params=["tcp", "stub"])
def pair(request):
    """(target, initiator, peer): two engines of one backend, the initiator connected."""
    with te.Engine(config(request.param)) as target, te.Engine(config(request.param)) as init:
        yield target, init, init.connect(target.address, timeout=5)


class Proc:
    """A Python peer process: runs `code` (or the script and arguments `argv`, with
    `env` added to the environment), reads its stdout lines, writes its stdin."""

    def __init__(self, code=None, argv=None, env=None):
        args = ["-c", textwrap.dedent(code)] if argv is None else [str(a) for a in argv]
        self.p = subprocess.Popen(
            [sys.executable, *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
        )

    def read(self):
        line = self.p.stdout.readline()
        if not line:
            raise AssertionError(f"the peer process exited ({self.p.wait()})")
        return line.strip()

    def send(self, line):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def close(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


@pytest.fixture
def proc():
    """Starts peer processes and kills what is left of them after the test."""
    started = []

    def start(code):
        started.append(Proc(code))
        return started[-1]

    yield start
    for p in started:
        p.close()
