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
        assert settings.kernels_cache_root(env) == Path.home() / ".cache" / "sublayer" / "kernels"
        assert settings.kernels_lock_timeout(env) == 600.0
        assert settings.bf16_gemm(env) is None and settings.int8_engine(env) is None
        assert settings.buffer_cache_mb(env) is None


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("ON", True), ("yes", True), ("0", False),
                                       ("false", False), ("OFF", False), ("no", False)])  # fmt: skip
def test_switches(value, on):
    for name, read in [("SUBLAYER_KERNELS", settings.kernels_enabled), ("SUBLAYER_DECODING", settings.decoding_enabled),
                       ("SUBLAYER_KERNELS_VERBOSE", settings.kernels_verbose)]:  # fmt: skip
        assert read({name: value}) is on


def test_values(tmp_path):
    assert settings.kernels_cache_root({"SUBLAYER_KERNELS_CACHE": str(tmp_path)}) == tmp_path
    assert settings.kernels_lock_timeout({"SUBLAYER_KERNELS_LOCK_TIMEOUT": "0.3"}) == 0.3
    assert settings.bf16_gemm({"SUBLAYER_BF16_GEMM": "FP32"}) == "fp32"
    assert settings.int8_engine({"SUBLAYER_INT8_ENGINE": "onednn"}) == "onednn"
    assert settings.buffer_cache_mb({"SUBLAYER_BUFFER_CACHE_MB": "0"}) == 0.0
    assert settings.buffer_cache_mb({"SUBLAYER_BUFFER_CACHE_MB": "64.5"}) == 64.5


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
