"""sublayer.kernels: build once and cache; without a compiler ONE warning and the reference path everywhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from torch.testing import assert_close

import sublayer
import sublayer.functional as SF
from sublayer import kernels
from sublayer.kernels import _loader
from sublayer.functional import fused


@pytest.fixture(autouse=True)
def _switched_on():
    """The loader's tests build on purpose: switched on, also in a SUBLAYER_KERNELS=0 run (conftest restores it)."""
    kernels.set_enabled(True)


def test_builds_here_and_is_cached():
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.fail("no C++ compiler on this machine: the fast path cannot be tested")
    assert kernels.available(), kernels.build_error()
    assert kernels.enabled()
    assert list(kernels.cache_dir().glob("sublayer_kernels*.so")), "no cached shared library"
    assert kernels.status().startswith("active")


@pytest.fixture
def no_compiler(monkeypatch):
    """Simulate a machine where the build fails, then restore the real state."""
    was_ok = kernels.available()

    def fail():
        raise RuntimeError("Error building extension 'sublayer_kernels': c++: error: command not found")

    monkeypatch.setattr(kernels, "_build", fail)
    monkeypatch.setattr(kernels, "_registered", lambda: False)
    kernels._reset_for_tests()
    yield
    monkeypatch.undo()
    kernels._reset_for_tests()
    assert kernels.available() == was_ok


def test_fallback_warns_once_and_modules_use_the_reference(no_compiler):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not kernels.available()
        assert not kernels.available()
        ffn = sublayer.PositionWiseFFN(6, 10, dropout=0.1)
        an = sublayer.AddNorm(6, dropout=0.1)
        x = torch.randn(2, 3, 6, requires_grad=True)
        torch.manual_seed(1)
        out = an(x, ffn(x))
        out.sum().backward()
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "reference path" in msgs[0] and "command not found" in msgs[0]
    assert "unavailable" in kernels.status()
    # the reference results exactly (same torch RNG draws: F.dropout's masks)
    torch.manual_seed(1)
    h = SF.feed_forward(x, ffn.fc1.weight, ffn.fc1.bias, ffn.fc2.weight, ffn.fc2.bias, dropout=0.1)
    ref = SF.add_norm(x, h, 6, an.norm.weight, an.norm.bias, dropout=0.1)
    assert torch.equal(out, ref)
    with pytest.raises(RuntimeError, match="impl='fused' cannot run"):
        fused.add_norm(x, x, 6, impl="fused")


def test_switch_off_never_builds(monkeypatch):
    kernels.set_enabled(False)
    try:
        monkeypatch.setattr(kernels, "available", lambda: pytest.fail("built although switched off"))
        x = torch.randn(3, 5)
        assert_close(sublayer.AddNorm(5)(x, x), SF.add_norm(x, x, 5, torch.ones(5), torch.zeros(5)))
        assert kernels.status().startswith("off")
    finally:
        kernels.set_enabled(True)


def test_switched_off_nothing_asks_for_the_extension(monkeypatch):
    # available() itself, buffer_cache and an explicit impl="fused": switched off, no build, no load, no warning
    built = []
    monkeypatch.setattr(kernels, "_build", lambda: built.append(1))
    monkeypatch.setattr(kernels, "_registered", lambda: False)  # as in a fresh process
    kernels._reset_for_tests()
    kernels.set_enabled(False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not kernels.available() and not kernels.enabled()
            assert sublayer.memory.buffer_cache()["limit_mb"] == 0.0
            x = torch.randn(3, 5)
            with pytest.raises(RuntimeError, match=r"impl='fused' cannot run: the kernels are switched off"):
                fused.add_norm(x, x, 5, impl="fused")
            assert kernels.status().startswith("off")
        assert built == [] and kernels.build_error() is None
    finally:  # the switch: restored by conftest's fixture
        monkeypatch.undo()
        kernels._reset_for_tests()


def test_real_missing_compiler_in_a_fresh_process(tmp_path):
    # A fresh process, an empty cache and a compiler that does not exist: one warning that names the cause and
    # points at the user's line (here the module call in the -c script), then the reference path.
    code = (
        "import warnings, torch, sublayer\n"
        "from sublayer import kernels\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    out = sublayer.AddNorm(4)(torch.ones(2, 4), torch.zeros(2, 4))\n"
        "    sublayer.PositionWiseFFN(4, 8)(torch.ones(2, 4))\n"
        "ws = [m for m in w if 'reference path' in str(m.message)]\n"
        "print(len(ws), kernels.available(), float(out.abs().sum()), ws[0].filename, ws[0].lineno)\n"
        "print(ws[0].message)\n"
    )
    cxx = tmp_path / "no-such-c++"
    env = dict(os.environ, SUBLAYER_KERNELS="1", CXX=str(cxx), SUBLAYER_KERNELS_CACHE=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    first, message = res.stdout.splitlines()
    assert first.split() == ["1", "False", "0.0", "<string>", "5"], (res.stdout, res.stderr)
    assert f"{cxx}: not found" in message and "-isystem" not in message, message
    assert "compiling" not in res.stderr  # nothing was started


# --- the build cache: keyed on what changes the binary, a lock the OS releases, a clear cause --------------------


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    """An empty cache in tmp_path and a 'compiler' that writes a dummy library; records compiles and loads."""
    calls = {"compile": 0, "load": [], "registered": False}  # registered: the ops exist in this "process"

    def compile_(build_dir):
        calls["compile"] += 1
        calls["registered"] = True
        assert not (build_dir / "lock").exists()  # a fresh folder: torch's own lock can never be a stale one
        lib = build_dir / "sublayer_kernels.so"
        lib.write_bytes(b"not really a library")
        return lib

    monkeypatch.setenv("SUBLAYER_KERNELS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(_loader, "_check_toolchain", lambda: None)
    monkeypatch.setattr(_loader, "_compile", compile_)
    monkeypatch.setattr(_loader, "_load_library", lambda path: calls.update(registered=True, load=[*calls["load"], path]))
    monkeypatch.setattr(kernels, "_registered", lambda: calls["registered"])
    kernels._reset_for_tests()
    yield calls
    monkeypatch.undo()
    kernels._reset_for_tests()
    assert kernels.available()  # the real extension (already loaded in this process)


def test_a_build_killed_midway_is_discarded_and_rebuilt(fake_build, capfd):
    # What a killed first build leaves: its half-built folder (with torch's lock in it) and our lock file, whose
    # flock the OS released when the process died.
    d = kernels.cache_dir()
    (d / "build-dead1").mkdir(parents=True)
    (d / "build-dead1" / "lock").touch()
    (d / "build-dead1" / "kernels.o").write_bytes(b"half")
    (d / "build.lock").write_text("pid 999999@elsewhere\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a rebuild is not a failure: no warning
        assert kernels.available()
    assert fake_build["compile"] == 1 and fake_build["load"] == []
    assert (d / "sublayer_kernels.so").is_file() and not list(d.glob("build-*"))
    err = capfd.readouterr().err
    assert "compiling sublayer's fused CPU kernels (once, ~50 s)" in err and "interrupted earlier build" in err
    assert (d.parent / "last_build_seconds").read_text().strip() == "0"  # the next estimate: this machine's time
    # the next process loads the cached library: no compile, no message
    kernels._reset_for_tests()
    fake_build["registered"] = False
    assert kernels.available()
    assert fake_build["compile"] == 1 and fake_build["load"] == [d / "sublayer_kernels.so"]
    assert "compiling" not in capfd.readouterr().err


def test_a_live_builder_is_waited_for_then_given_up_with_one_warning(fake_build, monkeypatch, tmp_path, capfd):
    d = kernels.cache_dir()
    d.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys, time\n"
         f"fd = os.open({str(d / 'build.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'pid 4242@builder'); print('held', flush=True)\n"
         "time.sleep(120)\n"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setenv("SUBLAYER_KERNELS_LOCK_TIMEOUT", "0.3")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert not kernels.available()
        msgs = [str(w.message) for w in caught]
        assert len(msgs) == 1 and "TimeoutError" in msgs[0] and "pid 4242@builder" in msgs[0], msgs
        assert caught[0].filename == __file__  # points at the caller's line, not at sublayer's
        assert "waiting for another process (pid 4242@builder)" in capfd.readouterr().err
        assert fake_build["compile"] == 0
    finally:
        holder.kill()
        holder.wait()
    # the holder died (SIGKILL: no clean-up at all): its lock is gone with it, the next attempt builds at once
    kernels._reset_for_tests()
    fake_build["registered"] = False
    assert kernels.available() and fake_build["compile"] == 1


def test_a_file_system_without_locks_still_builds(fake_build, monkeypatch):
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    d = kernels.cache_dir()
    (d / "build-other").mkdir(parents=True)  # without a lock it may be a live builder's: left alone
    assert kernels.available() and fake_build["compile"] == 1
    assert (d / "build-other").is_dir() and (d / "sublayer_kernels.so").is_file()


def test_cache_key_follows_the_binary_not_the_paths(monkeypatch, tmp_path):
    key = _loader.key_inputs()
    text = json.dumps(key)
    assert sys.prefix not in text and os.path.dirname(torch.__file__) not in text
    assert {"sources", "cflags", "torch", "cpu", "compiler", "python"} <= set(key)
    base = kernels.cache_dir()
    try:
        src = tmp_path / "kernels.cpp"
        src.write_bytes(kernels._SOURCES[0].read_bytes() + b"\n// changed\n")
        monkeypatch.setattr(kernels, "_SOURCES", [src, *kernels._SOURCES[1:]])
        _loader._key.clear()
        changed_source = kernels.cache_dir()
        monkeypatch.undo()
        flags = kernels.cflags()
        monkeypatch.setattr(kernels, "cflags", lambda: [*flags, "-DSOMETHING"])
        _loader._key.clear()
        changed_flags = kernels.cache_dir()
        monkeypatch.undo()
        monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
        _loader._key.clear()
        changed_compiler = kernels.cache_dir()
    finally:
        monkeypatch.undo()
        _loader._key.clear()
    assert len({base, changed_source, changed_flags, changed_compiler}) == 4
    assert kernels.cache_dir() == base
    assert changed_source.parent == base.parent  # same root, another key folder


def test_the_cause_of_a_failed_build_is_shown_not_the_command():
    cmd = "[1/2] c++ -MMD -MF kernels.o.d -DTORCH_EXTENSION_NAME=sublayer_kernels " + "-isystem /x " * 60 + "-c k.cpp -o k.o"
    e = RuntimeError(
        "Error building extension 'sublayer_kernels': " + cmd + "\nFAILED: kernels.o\n" + cmd.replace("[1/2] ", "")
        + "\n/src/kernels.cpp:12:5: error: 'foo' was not declared in this scope\nninja: build stopped: subcommand failed."
    )
    assert _loader.cause(e) == "RuntimeError: /src/kernels.cpp:12:5: error: 'foo' was not declared in this scope"
    assert _loader.cause(RuntimeError("Error building extension 'x':\n/bin/sh: 1: c++: not found")).endswith("c++: not found")


def test_build_ahead_of_time_command():
    # `python -m sublayer.kernels` (e.g. in a Dockerfile after pip install): builds or loads, prints the status
    env = dict(os.environ, SUBLAYER_KERNELS="1")
    res = subprocess.run([sys.executable, "-m", "sublayer.kernels"], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("active") and str(kernels.cache_dir()) in res.stdout


def test_ninja_of_an_unactivated_venv_is_found(monkeypatch, tmp_path):
    # `.venv/bin/python` run without activating the venv: PATH lacks the ninja that pip installed
    pytest.importorskip("ninja")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert shutil.which("ninja") is None
    with _loader._ninja_on_path():
        assert shutil.which("ninja") is not None
    assert os.environ["PATH"] == str(tmp_path)


# --- a damaged cache entry is detected before it is loaded: rebuilt, or the reference path with one warning ------


def _damage(lib, how):
    data = lib.read_bytes()
    if how == "truncated":
        lib.write_bytes(data[: len(data) // 2])
    elif how == "damaged header":
        lib.write_bytes(b"\0" * 16 + data[16:])
    elif how == "no manifest":  # a builder killed between writing the library and its manifest
        (lib.parent / _loader.MANIFEST).unlink()


@pytest.mark.parametrize("how", ["truncated", "damaged header", "no manifest"])
def test_a_damaged_cached_library_is_discarded_and_rebuilt(fake_build, capfd, how):
    assert kernels.available() and fake_build["compile"] == 1
    lib = kernels.cache_dir() / "sublayer_kernels.so"
    assert _loader.entry_problem(lib) is None
    _damage(lib, how)
    assert _loader.entry_problem(lib) is not None
    kernels._reset_for_tests()
    fake_build["registered"] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a rebuild is not a failure: no warning
        assert kernels.available()
    assert fake_build["compile"] == 2 and fake_build["load"] == []  # the damaged file was never loaded
    assert f"discarded the damaged cached library {lib}" in capfd.readouterr().err
    assert _loader.entry_problem(lib) is None


def test_a_cached_library_that_does_not_load_is_rebuilt(fake_build, monkeypatch):
    assert kernels.available() and fake_build["compile"] == 1
    kernels._reset_for_tests()
    fake_build["registered"] = False

    def fails(path):
        fake_build["load"].append(path)
        raise OSError(f"{path}: invalid ELF header")

    monkeypatch.setattr(_loader, "_load_library", fails)
    assert kernels.available()
    assert fake_build["compile"] == 2 and len(fake_build["load"]) == 1


def test_a_damaged_library_that_cannot_be_rebuilt_warns_once_naming_it(fake_build, monkeypatch):
    assert kernels.available()
    lib = kernels.cache_dir() / "sublayer_kernels.so"
    _damage(lib, "truncated")
    kernels._reset_for_tests()
    fake_build["registered"] = False
    monkeypatch.setattr(_loader, "_check_toolchain", lambda: (_ for _ in ()).throw(RuntimeError("c++: not found")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not kernels.available() and not kernels.available()
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 1 and str(lib) in msgs[0] and "recorded at build" in msgs[0] and "c++: not found" in msgs[0]
    assert fake_build["load"] == []


@pytest.mark.parametrize("how", [None, "truncated"])
def test_the_real_library_truncated_in_the_cache_never_kills_the_process(tmp_path, monkeypatch, how):
    # The real library, copied into a fresh cache; truncated, loading it would be a SIGBUS (returncode -7). The
    # child cannot rebuild (no compiler): the reference path with one warning naming the file.
    assert kernels.available()
    key = kernels.cache_dir()
    env = dict(os.environ, SUBLAYER_KERNELS="1", CXX=str(tmp_path / "no-such-c++"), SUBLAYER_KERNELS_CACHE=str(tmp_path / "cache"))
    try:  # the child's cache folder (its key names the missing compiler)
        monkeypatch.setattr(os, "environ", env)
        _loader._key.clear()
        entry = kernels.cache_dir()
    finally:
        monkeypatch.undo()
        _loader._key.clear()
    entry.mkdir(parents=True)
    for name in ("sublayer_kernels.so", _loader.MANIFEST):
        shutil.copy(key / name, entry / name)
    if how:
        _damage(entry / "sublayer_kernels.so", how)
    code = (
        "import json, warnings, torch, sublayer\n"
        "from sublayer import kernels\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    out = sublayer.AddNorm(4)(torch.ones(2, 4), torch.zeros(2, 4))\n"
        "print(kernels.available(), kernels.cache_dir(), float(out.abs().sum()))\n"
        "print(json.dumps([str(m.message) for m in w if 'reference path' in str(m.message)]))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, (res.returncode, res.stderr)
    first, warned = res.stdout.splitlines()
    assert first.split() == ["True" if how is None else "False", str(entry), "0.0"], (res.stdout, res.stderr)
    if how is None:  # an intact entry loads as it is: nothing rebuilt, nothing said
        assert warned == "[]" and "compiling" not in res.stderr
    else:
        msgs = json.loads(warned)
        assert len(msgs) == 1 and str(entry / "sublayer_kernels.so") in msgs[0] and "not found" in msgs[0], msgs
