"""sublayer.kernels.cpu: the one reader of the CPU's features, and the choices made from them."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

import sublayer
from sublayer import settings
from sublayer.kernels import cpu

SRC = Path(sublayer.__file__).parent


@pytest.fixture
def fake_cpu(monkeypatch):
    """Pretend to run on a CPU with the given flags (x86_64, /proc/cpuinfo read)."""

    def use(*flags, read=True):
        monkeypatch.delenv("SUBLAYER_ISA", raising=False)
        monkeypatch.setattr(cpu, "_cpuinfo", lambda: (frozenset(flags), "Some CPU", read))
        monkeypatch.setattr(cpu.platform, "machine", lambda: "x86_64")
        monkeypatch.setattr(cpu, "_native_bf16", None)

    return use


def test_only_cpu_reads_cpuinfo():
    # bench/harness.py reads the model name and core count itself: benchmarks/compare_revisions.py runs it against
    # other revisions
    reads = re.compile(r"""["']/proc/cpuinfo["']""")
    readers = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if reads.search(p.read_text())]
    assert sorted(readers) == ["bench/harness.py", "kernels/cpu.py"]
    assert cpu.cpuinfo_text() == (Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else "")


def test_flags_of_this_machine():
    f = cpu.flags()
    if Path("/proc/cpuinfo").is_file():
        text = Path("/proc/cpuinfo").read_text()
        line = next(ln for ln in text.splitlines() if re.match(r"(flags|Features)\s*:", ln))
        listed = frozenset(line.split(":", 1)[1].split())
        if settings.isa() == "avx2":
            listed = frozenset(x for x in listed if not x.startswith(cpu._BEYOND_AVX2))
        assert f == listed
        assert cpu.has(next(iter(f))) and not cpu.has("no_such_flag")
        assert cpu.describe()["avx512"] == ("yes" if "avx512f" in f else "no")
    assert re.fullmatch(r"[0-9a-f]{10}", cpu.tag())


def test_isa_avx2_hides_what_an_avx2_cpu_lacks(monkeypatch):
    text = "processor : 0\nmodel name : Some CPU\nflags : fpu avx2 fma f16c avx512f avx512_bf16 amx_int8 avx_vnni\n"
    monkeypatch.setattr(cpu, "cpuinfo_text", lambda: text)
    monkeypatch.delenv("SUBLAYER_ISA", raising=False)
    cpu._cpuinfo.cache_clear()
    try:
        assert cpu.has("avx512f", "amx_int8")
        monkeypatch.setenv("SUBLAYER_ISA", "avx2")
        cpu._cpuinfo.cache_clear()
        assert cpu.flags() == {"fpu", "avx2", "fma", "f16c"}
        assert cpu.describe()["isa"].startswith("avx2") and cpu.describe()["avx512"] == "no"
    finally:
        cpu._cpuinfo.cache_clear()


@pytest.mark.skipif(not (cpu.is_x86() and cpu.has("avx2")), reason="SUBLAYER_ISA=avx2 needs an x86 CPU with AVX2")
def test_isa_avx2_process_builds_for_x86_64_v3_and_caps_torch():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    env.update(SUBLAYER_ISA="avx2", SUBLAYER_KERNELS="0")
    code = ("import sublayer, torch; from sublayer import kernels; "
            "print(kernels.cflags()[1], torch.backends.cpu.get_cpu_capability(), kernels.cpu.has('avx512f'))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.stdout.split() == ["-march=x86-64-v3", "AVX2", "False"], out.stderr


def test_tag_follows_the_flags(fake_cpu):
    fake_cpu("avx2", "fma")
    a = cpu.tag()
    fake_cpu("avx2", "fma", "avx512f")
    assert cpu.tag() != a
    fake_cpu("fma", "avx2")
    assert cpu.tag() == a


@pytest.mark.parametrize(
    "flags, read, native",
    [(("avx2",), True, False), (("avx2", "avx512_bf16"), True, True), (("amx_bf16",), True, True), ((), False, True)],
)
def test_native_bf16_gemm(fake_cpu, monkeypatch, flags, read, native):
    fake_cpu(*flags, read=read)
    assert cpu.native_bf16_gemm() is native
    monkeypatch.setattr(cpu, "_native_bf16", None)
    monkeypatch.setenv("SUBLAYER_BF16_GEMM", "fp32" if native else "native")
    assert cpu.native_bf16_gemm() is not native


@pytest.mark.parametrize(
    ("vendor", "flags", "onednn"),
    [("AuthenticAMD", ("avx2", "avx512f"), True), ("AuthenticAMD", ("avx2",), False),
     ("GenuineIntel", ("avx2", "avx512f"), False)],
)  # fmt: skip
def test_onednn_fp32_gemm_on_amd_with_avx512_only(fake_cpu, monkeypatch, vendor, flags, onednn):
    fake_cpu(*flags)
    monkeypatch.setattr(cpu, "cpuinfo_text", lambda: f"vendor_id\t: {vendor}\n")
    cpu.onednn_fp32_gemm.cache_clear()
    try:
        assert cpu.onednn_fp32_gemm() is (onednn and torch.backends.mkldnn.is_available())
    finally:
        cpu.onednn_fp32_gemm.cache_clear()


def test_int8_engine(fake_cpu, monkeypatch):
    both = ["fbgemm", "onednn", "none"]
    fake_cpu("avx2")
    assert cpu.int8_engine(both) == "fbgemm"
    fake_cpu("avx2", "avx512_vnni")
    assert cpu.int8_engine(both) == "onednn" and cpu.int8_engine(["fbgemm"]) == "fbgemm"
    monkeypatch.setenv("SUBLAYER_INT8_ENGINE", "fbgemm")
    assert cpu.int8_engine(both) == "fbgemm"
    monkeypatch.setenv("SUBLAYER_INT8_ENGINE", "onednn")
    fake_cpu("avx2")
    assert cpu.int8_engine(both) == "onednn" and cpu.int8_engine(["fbgemm"]) == "fbgemm"  # forced, if supported
    assert cpu.int8_engine(torch.backends.quantized.supported_engines) in torch.backends.quantized.supported_engines


def test_describe_without_cpuinfo(fake_cpu):
    fake_cpu(read=False)
    assert cpu.describe() == {}
    fake_cpu("avx512f", "amx_bf16")
    assert cpu.describe() == {"avx512": "yes", "amx-bf16": "yes", "avx512-bf16": "no"}


@pytest.mark.parametrize(
    "cpus, busy, spin, sleep",
    [(2, 0.0, 2, 2), (2, 0.4, 2, 2), (2, 0.6, 1, 2), (2, 1.0, 1, 2), (2, 7.0, 1, 2), (2, None, 2, 2),
     (16, 3.2, 13, 16), (1.5, 0.0, 1, 1), (0.5, 0.0, 1, 1), (7, 6.6, 1, 7)],
)  # fmt: skip
def test_default_threads_leaves_busy_cores_to_their_owners_when_waits_spin(cpus, busy, spin, sleep):
    for waits_sleep, want in ((False, spin), (True, sleep)):
        n, why = cpu.default_threads(cpus, busy, waits_sleep=waits_sleep)
        assert n == want
        assert why.startswith(f"{max(1, int(cpus))} usable CPUs")
        assert ("unknown" in why) is (busy is None)


def test_choose_threads_order(monkeypatch):
    monkeypatch.setattr(cpu, "busy_cpus", lambda seconds=0.1: 1.0)  # a fake load: one busy neighbour
    monkeypatch.setattr(cpu, "usable_cpus", lambda: 2.0)
    monkeypatch.delenv("SUBLAYER_THREADS", raising=False)
    assert cpu.choose_threads(3) == (3, "--threads")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert cpu.choose_threads() == (1, "2 usable CPUs, 1.0 kept busy by other processes; waits spin: busy CPUs left "
                                    "to them")  # fmt: skip
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert cpu.choose_threads() == (2, "2 usable CPUs, 1.0 kept busy by other processes; waits sleep")
    monkeypatch.setenv("SUBLAYER_THREADS", "5")
    assert cpu.choose_threads() == (5, "SUBLAYER_THREADS")
    monkeypatch.setenv("SUBLAYER_THREADS", "many")
    with pytest.raises(ValueError, match="SUBLAYER_THREADS='many'"):
        cpu.choose_threads()


def test_busy_cpus_sees_a_busy_neighbour():
    import subprocess
    import sys

    if cpu.busy_cpus(0.01) is None:
        pytest.skip("no /proc/stat")
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = cpu.busy_cpus(0.5)
    finally:
        spin.kill()
        spin.wait()
    assert 0.5 < busy <= (__import__("os").cpu_count() or 1)
    assert 1.0 <= cpu.usable_cpus() <= (__import__("os").cpu_count() or 1)


def test_others_busy_is_the_machines_busy_time_less_this_process(monkeypatch):
    monkeypatch.setattr(cpu, "_cpu_ticks", lambda: (150, 200, 2))  # 3 of 4 ticks busy since (0, 0): 1.5 CPUs of 2
    t = time.perf_counter()
    since = ((0, 0, 2), time.process_time() - 0.25, t - 0.5)  # this process: 0.25 s of CPU in 0.5 s, 0.5 CPU
    assert abs(cpu.others_busy(since) - 1.0) < 0.02
    assert cpu.others_busy(((150, 200, 2), 0.0, t)) is None  # no tick has passed
    assert cpu.others_busy((None, 0.0, t)) is None  # no /proc/stat
    since = ((0, 0, 2), time.process_time() - 5.0, t - 0.5)  # more than the ticks say (their granularity): not < 0
    assert cpu.others_busy(since) == 0.0


STAT = """cpu  400 0 100 500 0 0 0 0 0 0
cpu0 100 0 0 100 0 0 0 0 0 0
cpu1 100 0 50 50 0 0 0 0 0 0
cpu2 100 0 25 75 0 0 0 0 0 0
cpu3 100 0 25 275 0 0 0 0 0 0
intr 12345 0 1
ctxt 999
"""


def test_cpu_ticks_count_only_the_cpus_this_process_may_run_on(monkeypatch, tmp_path):
    # a container pinned to CPUs 1 and 3 of 4 (a cpuset): busy CPUs 0 and 2 are not its to share
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {1, 3}, raising=False)
    assert cpu._cpu_ticks(str(stat)) == (150 + 125, 200 + 400, 2)

    def unknown(pid):
        raise OSError("no affinity")

    monkeypatch.setattr(cpu.os, "sched_getaffinity", unknown, raising=False)
    monkeypatch.setattr(cpu.os, "cpu_count", lambda: 4)
    assert cpu._cpu_ticks(str(stat)) == (500, 1000, 4)  # the all-CPU line, as this many CPUs
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {12, 13}, raising=False)
    assert cpu._cpu_ticks(str(stat)) == (500, 1000, 4)  # a /proc/stat with the container's CPUs renumbered
    assert cpu._cpu_ticks(str(tmp_path / "missing")) is None
    stat.write_text("intr 12345 0 1\n")
    assert cpu._cpu_ticks(str(stat)) is None  # no CPU line at all
