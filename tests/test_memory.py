"""sublayer.set_memory_reuse / sublayer.memory: what it changes, that it is idempotent, and that the CLI reports it.

mallopt cannot be undone, so the process-wide checks run in a child process (this test process keeps its setting).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

import sublayer
from sublayer import memory

SRC = str(Path(sublayer.__file__).resolve().parents[1])
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _run(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("MALLOC_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)


CHILD = r"""
import json, resource, sublayer
from sublayer import memory

def faults_refilling(nbytes=64 << 20):
    # fill a fresh big bytearray twice; the minor faults of the second round tell whether freed memory was reused
    b = bytearray(nbytes); del b
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    b = bytearray(nbytes); del b
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

before = (memory.allocator_setting(), memory.memory_reuse_active(), faults_refilling())
r1 = sublayer.set_memory_reuse()
faults_refilling()  # the first big block under the new setting comes from the kernel once
after = (memory.allocator_setting(), memory.memory_reuse_active(), faults_refilling())
r2 = sublayer.set_memory_reuse()
print(json.dumps({"before": before, "after": after, "r1": r1, "r2": r2}))
"""


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_set_memory_reuse_stops_refaulting_and_is_idempotent():
    proc = _run(CHILD)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    (s0, on0, f0), (s1, on1, f1) = res["before"], res["after"]
    assert res["r1"] is True and res["r2"] is True  # second call: same answer, nothing else
    assert not on0 and on1
    assert s0.startswith("glibc default") and "memory reuse on" in s1
    pages = (64 << 20) // 4096
    assert f0 > pages // 2  # glibc default: a freed 64 MiB block goes back to the kernel, refilling faults again
    assert f1 < pages // 16  # memory reuse: the same pages come back, already mapped


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_cli_info_reports_the_allocator_setting():
    proc = _run("import sys; sys.argv = ['sublayer', 'info']; from sublayer.cli import main; main()")
    assert proc.returncode == 0, proc.stderr
    lines = {ln.split(None, 1)[0]: ln for ln in proc.stdout.splitlines() if ln.strip()}
    assert "memory reuse on" in lines["allocator"]
    assert "MiB" in lines["buffer"]


def test_allocator_setting_names_an_outside_allocator(monkeypatch):
    monkeypatch.setattr(memory, "_state", {"reuse": False})
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert memory.allocator_setting() == "jemalloc (LD_PRELOAD)"
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000000")
    assert "MALLOC_TRIM_THRESHOLD_" in memory.allocator_setting()


def test_buffer_cache_limit_errors():
    for bad in (-1, float("inf"), 2.0**41):
        with pytest.raises(ValueError, match=r"limit_mb must be a number of MiB in \[0, 2\*\*40\], got"):
            memory.buffer_cache(bad)
    np = pytest.importorskip("numpy")
    from sublayer import kernels

    # any real number; switched off (SUBLAYER_KERNELS=0) nothing is built and every figure is 0
    assert memory.buffer_cache(np.float32(256))["limit_mb"] == (256 if kernels.enabled() else 0.0)
    for bad in ("10", True):
        with pytest.raises(TypeError, match="limit_mb must be a number of MiB, got"):
            memory.buffer_cache(bad)
