"""sublayer.settings: every SUBLAYER_* variable is read there, documented, typed, and a bad value is a clear error."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sublayer import settings

SRC = Path(settings.__file__).parent


def _sources():
    return [p for p in SRC.rglob("*") if p.suffix in (".py", ".cpp", ".h") and p.is_file()]


def test_only_settings_reads_sublayer_variables():
    reads = re.compile(r"""(environ\s*(\.get\s*\(|\[)|getenv\s*\(|setdefault\s*\()\s*["']SUBLAYER_""")
    offenders = [str(p.relative_to(SRC)) for p in _sources() if p != Path(settings.__file__) and reads.search(p.read_text())]
    assert offenders == []
    assert reads.search('os.environ.get("SUBLAYER_X")') and reads.search("std::getenv('SUBLAYER_X')")  # the pattern bites


def test_every_variable_named_in_the_sources_is_documented():
    macros = {m for p in _sources() for m in re.findall(r"#define (SUBLAYER_\w+)", p.read_text())}
    named = {m for p in _sources() for m in re.findall(r"SUBLAYER_[A-Z0-9_]*[A-Z0-9]", p.read_text())} - macros
    assert named and named <= set(settings.VARIABLES), named - set(settings.VARIABLES)
    text = Path(settings.__file__).read_text()
    for name in settings.VARIABLES:  # each documented one is read by an accessor too
        assert text.count(f'"{name}"') == 2, name


def test_settings_imports_nothing_from_sublayer():
    text = Path(settings.__file__).read_text()
    assert not re.search(r"^\s*(from \.|from sublayer|import sublayer)", text, re.M)


def test_defaults_when_unset_or_empty():
    for env in ({}, dict.fromkeys(settings.VARIABLES, " ")):
        assert settings.kernels_enabled(env) and settings.decoding_enabled(env) and not settings.kernels_verbose(env)
        assert settings.fit_threads(env)
        assert settings.kernels_cache_root(env) == Path.home() / ".cache" / "sublayer" / "kernels"
        assert settings.kernels_lock_timeout(env) == 600.0
        assert settings.bf16_gemm(env) is None and settings.int8_engine(env) is None
        assert settings.buffer_cache_mb(env) is None
        assert settings.threads(env) is None and settings.wait_policy(env) == "passive"
        assert settings.isa(env) == "native" and settings.apply_isa(dict(env)) == {}


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("ON", True), ("yes", True), ("0", False),
                                       ("false", False), ("OFF", False), ("no", False)])  # fmt: skip
def test_switches(value, on):
    for name, read in [("SUBLAYER_KERNELS", settings.kernels_enabled), ("SUBLAYER_DECODING", settings.decoding_enabled),
                       ("SUBLAYER_KERNELS_VERBOSE", settings.kernels_verbose),
                       ("SUBLAYER_FIT_THREADS", settings.fit_threads)]:  # fmt: skip
        assert read({name: value}) is on


def test_values(tmp_path):
    assert settings.kernels_cache_root({"SUBLAYER_KERNELS_CACHE": str(tmp_path)}) == tmp_path
    assert settings.kernels_lock_timeout({"SUBLAYER_KERNELS_LOCK_TIMEOUT": "0.3"}) == 0.3
    assert settings.bf16_gemm({"SUBLAYER_BF16_GEMM": "FP32"}) == "fp32"
    assert settings.int8_engine({"SUBLAYER_INT8_ENGINE": "onednn"}) == "onednn"
    assert settings.buffer_cache_mb({"SUBLAYER_BUFFER_CACHE_MB": "0"}) == 0.0
    assert settings.buffer_cache_mb({"SUBLAYER_BUFFER_CACHE_MB": "64.5"}) == 64.5
    assert settings.threads({"SUBLAYER_THREADS": "3"}) == 3 and settings.threads({"SUBLAYER_THREADS": "AUTO"}) is None
    assert settings.wait_policy({"SUBLAYER_WAIT_POLICY": "OpenMP"}) == "openmp"
    assert settings.isa({"SUBLAYER_ISA": "AVX2"}) == "avx2"


@pytest.mark.parametrize(
    "read, name, value, match",
    [
        (settings.kernels_enabled, "SUBLAYER_KERNELS", "maybe", r"SUBLAYER_KERNELS='maybe' is not a switch: use one of 1,"),
        (settings.decoding_enabled, "SUBLAYER_DECODING", "2", r"SUBLAYER_DECODING='2' is not a switch"),
        (settings.kernels_lock_timeout, "SUBLAYER_KERNELS_LOCK_TIMEOUT", "-1", r"SUBLAYER_KERNELS_LOCK_TIMEOUT='-1' must be a number > 0"),
        (settings.kernels_lock_timeout, "SUBLAYER_KERNELS_LOCK_TIMEOUT", "soon", r"'soon' must be a number > 0"),
        (settings.buffer_cache_mb, "SUBLAYER_BUFFER_CACHE_MB", "-5", r"SUBLAYER_BUFFER_CACHE_MB='-5' must be a number >= 0"),
        (settings.buffer_cache_mb, "SUBLAYER_BUFFER_CACHE_MB", "nan", r"must be a number >= 0"),
        (settings.bf16_gemm, "SUBLAYER_BF16_GEMM", "amx", r"SUBLAYER_BF16_GEMM='amx' is not one of native, fp32"),
        (settings.int8_engine, "SUBLAYER_INT8_ENGINE", "qnnpack", r"SUBLAYER_INT8_ENGINE='qnnpack' is not one of fbgemm, onednn"),
        (settings.threads, "SUBLAYER_THREADS", "0", r"SUBLAYER_THREADS='0' must be auto or an integer >= 1"),
        (settings.threads, "SUBLAYER_THREADS", "2.5", r"SUBLAYER_THREADS='2.5' must be auto or an integer >= 1"),
        (settings.threads, "SUBLAYER_THREADS", "-1", r"SUBLAYER_THREADS='-1' must be auto"),
        (settings.wait_policy, "SUBLAYER_WAIT_POLICY", "spin", r"SUBLAYER_WAIT_POLICY='spin' is not one of passive, openmp"),
        (settings.isa, "SUBLAYER_ISA", "avx512", r"SUBLAYER_ISA='avx512' is not one of native, avx2"),
        (settings.apply_isa, "SUBLAYER_ISA", "sse", r"SUBLAYER_ISA='sse' is not one of native, avx2"),
    ],
)  # fmt: skip
def test_bad_values_name_the_variable_and_the_rule(read, name, value, match):
    with pytest.raises(ValueError, match=match):
        read({name: value})


def test_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv("SUBLAYER_BUFFER_CACHE_MB", "12")
    assert settings.buffer_cache_mb() == 12.0
    monkeypatch.delenv("SUBLAYER_BUFFER_CACHE_MB")
    assert settings.buffer_cache_mb() is None


@pytest.mark.parametrize(
    "env, loaded, after, says",
    [
        ({}, False, "PASSIVE", "OMP_WAIT_POLICY=PASSIVE (sublayer's default"),
        ({}, True, None, "torch was imported before sublayer"),
        ({"SUBLAYER_WAIT_POLICY": "openmp"}, False, None, "SUBLAYER_WAIT_POLICY=openmp"),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, False, "ACTIVE", "OMP_WAIT_POLICY=ACTIVE (set by the user)"),
        ({"GOMP_SPINCOUNT": "1000"}, False, None, "GOMP_SPINCOUNT=1000 (set by the user)"),
    ],
)  # fmt: skip
def test_apply_wait_policy_only_where_unset_and_in_time(env, loaded, after, says):
    env = dict(env)
    assert says in settings.apply_wait_policy(env, torch_loaded=loaded)
    assert env.get("OMP_WAIT_POLICY") == after


def test_apply_isa_caps_the_libraries_where_the_user_has_not():
    env = {"SUBLAYER_ISA": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX512"}
    set_now = settings.apply_isa(env)
    assert set_now == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "CT2_FORCE_CPU_ISA": "AVX2"}
    assert env["MKL_ENABLE_INSTRUCTIONS"] == "AVX512"  # the user's own cap stays
    assert {k: env[k] for k in set_now} == set_now


def test_apply_wait_policy_rejects_a_bad_policy():
    with pytest.raises(ValueError, match="SUBLAYER_WAIT_POLICY='busy' is not one of passive, openmp"):
        settings.apply_wait_policy({"SUBLAYER_WAIT_POLICY": "busy"}, torch_loaded=False)


@pytest.mark.parametrize(
    "argv, cli",
    [
        (["python", "/venv/bin/sublayer", "demo"], True),
        (["/venv/bin/python3", "-X", "utf8", "/venv/bin/sublayer"], True),
        (["python", "-m", "sublayer.cli", "info"], True),
        (["python", "-msublayer.cli"], True),
        (["python", "-m", "pytest", "sublayer"], False),
        (["python", "-c", "import sublayer", "sublayer"], False),
        (["python", "train.py", "sublayer"], False),
        (["python"], False),
    ],
)  # fmt: skip
def test_command_line_process(argv, cli):
    assert settings.command_line_process(argv) is cli


def _info(env: dict[str, str]) -> str:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | env
    proc = subprocess.run([sys.executable, "-m", "sublayer.cli", "info"], capture_output=True, text=True, timeout=300,
                          env=env | {"SUBLAYER_KERNELS": "0"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_command_line_sets_the_wait_policy_before_torch_only_when_unset():
    rows = {line[:16].strip(): line[17:] for line in _info({}).splitlines()}  # "{name:16s} {value}"
    assert rows["openmp waits"].startswith("OMP_WAIT_POLICY=PASSIVE (sublayer's default")  # torch not yet imported
    assert re.fullmatch(r"\d+ \(.+\)", rows["threads"].strip())
    # switched off: what runs without the kernels (no int8 or bf16 panels, no buffer cache)
    assert rows["int8"].startswith("decoding weight-only (int8 weights to float32 for torch's GEMMs, no kernels); "
                                   "BERT on torch's linear_dynamic")  # fmt: skip
    assert rows["bf16 decoding"] in ("bf16 weights through torch's bf16 GEMMs, no kernels",
                                     "bf16-rounded weights through torch's float32 GEMMs, no kernels")  # fmt: skip
    assert "panels" not in rows["int8"] + rows["bf16 decoding"]
    assert rows["fp32 GEMMs"] == "torch's BLAS"
    assert rows["buffer cache"] == "0 MiB: Add & Norm's kernels are not in use"
    assert "OMP_WAIT_POLICY=active (set by the user)" in _info({"OMP_WAIT_POLICY": "active"})
    assert "GOMP_SPINCOUNT=5000 (set by the user)" in _info({"GOMP_SPINCOUNT": "5000"})
    assert "OpenMP's default (SUBLAYER_WAIT_POLICY=openmp)" in _info({"SUBLAYER_WAIT_POLICY": "openmp"})
    assert "threads          3 (SUBLAYER_THREADS)" in _info({"SUBLAYER_THREADS": "3"})


def test_the_command_line_reports_a_bad_wait_policy_in_one_line():
    import os
    import subprocess
    import sys

    env = os.environ | {"SUBLAYER_WAIT_POLICY": "spin", "SUBLAYER_KERNELS": "0"}
    proc = subprocess.run([sys.executable, "-m", "sublayer.cli", "info"], capture_output=True, text=True, timeout=300,
                          env=env)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr == "error: SUBLAYER_WAIT_POLICY='spin' is not one of passive, openmp\n"


def test_importing_the_library_leaves_the_wait_policy_alone():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = "import os, sublayer; print(os.environ.get('OMP_WAIT_POLICY'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env).stdout
    assert out.strip() == "None"


@pytest.mark.parametrize(
    "name, value, match",
    [("SUBLAYER_KERNELS", "maybe", "is not a switch"), ("SUBLAYER_DECODING", "nope", "is not a switch"),
     ("SUBLAYER_ISA", "avx512", "is not one of native, avx2")],
)  # fmt: skip
def test_the_command_line_reports_a_bad_switch_in_one_line(name, value, match):
    """Read at first use, not at import: the command's handler reports it (no traceback, exit 2)."""
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "sublayer.cli", "info"], capture_output=True, text=True,
                          timeout=300, env=os.environ | {name: value})  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: {name}={value!r} {match}") and proc.stderr.count("\n") == 1
