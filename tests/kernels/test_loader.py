"""sublayer.kernels: build once and cache; without a compiler ONE warning and the reference path everywhere."""

from __future__ import annotations

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
from sublayer.functional import fused


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


def test_real_missing_compiler_in_a_fresh_process(tmp_path):
    # A fresh process, an empty cache and a compiler that does not exist: one warning, then the reference.
    code = (
        "import warnings, torch, sublayer\n"
        "from sublayer import kernels\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    out = sublayer.AddNorm(4)(torch.ones(2, 4), torch.zeros(2, 4))\n"
        "    sublayer.PositionWiseFFN(4, 8)(torch.ones(2, 4))\n"
        "print(len([m for m in w if 'reference path' in str(m.message)]), kernels.available(), float(out.abs().sum()))\n"
    )
    env = dict(os.environ, CXX=str(tmp_path / "no-such-c++"), SUBLAYER_KERNELS_CACHE=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["1", "False", "0.0"], (res.stdout, res.stderr)


def test_env_switch():
    assert kernels._env_enabled({}) and kernels._env_enabled({"SUBLAYER_KERNELS": "1"})
    for off in ("0", "false", "OFF", "no"):
        assert not kernels._env_enabled({"SUBLAYER_KERNELS": off})
