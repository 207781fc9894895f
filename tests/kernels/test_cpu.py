"""sublayer.kernels.cpu: the one reader of the CPU's features, and the choices made from them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import sublayer
from sublayer.kernels import cpu

SRC = Path(sublayer.__file__).parent


@pytest.fixture
def fake_cpu(monkeypatch):
    """Pretend to run on a CPU with the given flags (x86_64, /proc/cpuinfo read)."""

    def use(*flags, read=True):
        monkeypatch.setattr(cpu, "_cpuinfo", lambda: (frozenset(flags), "Some CPU", read))
        monkeypatch.setattr(cpu.platform, "machine", lambda: "x86_64")
        monkeypatch.setattr(cpu, "_native_bf16", None)

    return use


def test_only_cpu_reads_cpuinfo():
    # bench/harness.py imports nothing from sublayer: benchmarks/compare_revisions.py runs it against other revisions
    reads = re.compile(r"""["']/proc/cpuinfo["']""")
    readers = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if reads.search(p.read_text())]
    assert sorted(readers) == ["bench/harness.py", "kernels/cpu.py"]
    assert cpu.cpuinfo_text() == (Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else "")


def test_flags_of_this_machine():
    f = cpu.flags()
    if Path("/proc/cpuinfo").is_file():
        text = Path("/proc/cpuinfo").read_text()
        line = next(ln for ln in text.splitlines() if re.match(r"(flags|Features)\s*:", ln))
        assert f == frozenset(line.split(":", 1)[1].split())
        assert cpu.has(next(iter(f))) and not cpu.has("no_such_flag")
        assert cpu.describe()["avx512"] == ("yes" if "avx512f" in f else "no")
    assert re.fullmatch(r"[0-9a-f]{10}", cpu.tag())


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
