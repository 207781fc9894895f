"""The fused Add & Norm takes its big buffers from a bounded cache (csrc/buffer_cache.cpp): same numbers with the
cache on or off, buffers reused step after step, distinct dx / dy, the limit respected."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import sublayer
from sublayer import kernels, memory

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C++ kernels failed to build (see test_loader)")

N, D = 64, 1031  # 64 x 1031 fp32: 258 KiB, just above the cache's 256 KiB floor


@pytest.fixture
def cache_limit():
    old = memory.buffer_cache()["limit_mb"]
    yield memory.buffer_cache
    memory.buffer_cache(old)


def _step(seed=0, p=0.1):
    torch.manual_seed(seed)
    an = sublayer.AddNorm(D, p)
    x, y = torch.randn(N, D, requires_grad=True), torch.randn(N, D, requires_grad=True)
    out = an(x, y)
    out.backward(torch.randn(N, D))
    return out.detach(), x.grad, y.grad, an.norm.weight.grad, an.norm.bias.grad


def test_same_numbers_with_the_cache_on_and_off(cache_limit):
    cache_limit(0)
    off = _step()
    cache_limit(64)
    _step(seed=1)  # fill the cache with someone else's values
    on = _step()
    for a, b in zip(off, on):
        assert torch.equal(a, b)


def test_steps_reuse_cached_buffers_and_dx_dy_are_distinct(cache_limit):
    cache_limit(0)
    cache_limit(64)
    _step()
    before = memory.buffer_cache()
    out, dx, dy, _, _ = _step()
    after = memory.buffer_cache()
    # out, the saved block (sum | keep bits | mean | rstd) and dx, dy: all from blocks the first step freed
    assert after["hits"] - before["hits"] >= 3
    assert dx.untyped_storage().data_ptr() != dy.untyped_storage().data_ptr()
    assert out.untyped_storage().data_ptr() not in (dx.untyped_storage().data_ptr(), dy.untyped_storage().data_ptr())
    dx.add_(1)  # ordinary tensors: in-place ops and resizing work
    dy.resize_(2 * N, D)
    assert dy.shape == (2 * N, D)


def test_limit_bounds_what_is_kept(cache_limit):
    cache_limit(0)
    assert memory.buffer_cache()["cached_mb"] == 0 and memory.buffer_cache()["blocks"] == 0
    cache_limit(0.3)  # room for one 320 KiB block at most
    _step()
    st = memory.buffer_cache()
    assert st["limit_mb"] == pytest.approx(0.3, abs=1e-6)
    assert st["blocks"] <= 1 and st["cached_mb"] <= 0.3


def test_blocks_of_a_new_shape_push_out_the_longest_idle(cache_limit):
    # 1.5 MiB: the four 320 KiB blocks of a 64-row step, then those of a 128-row step (576 KiB each) take their
    # place, so that repeating the 128-row step reuses blocks instead of going to malloc every time.
    def step(rows):
        an = sublayer.AddNorm(D, 0.1)
        x, y = torch.randn(rows, D, requires_grad=True), torch.randn(rows, D, requires_grad=True)
        an(x, y).backward(torch.randn(rows, D))

    cache_limit(0)
    cache_limit(1.5)
    step(N)
    assert memory.buffer_cache()["blocks"] == 4
    step(2 * N)
    before = memory.buffer_cache()
    assert before["cached_mb"] <= 1.5
    step(2 * N)
    assert memory.buffer_cache()["hits"] - before["hits"] >= 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_big_buffers_streamed_out_give_the_same_rows(p, dtype):
    # >= 1 MiB buffers take the streaming-store path (saved sum, dx, dy); rows are independent, so rows computed in
    # small batches (plain stores) must match bit for bit: every row without dropout, the first rows with it (the
    # Philox counters follow the row index). d = 1031: rows start unaligned, with a tail.
    d = 1031
    n = (1 << 20) // (d * torch.finfo(dtype).bits // 8) + 7
    torch.manual_seed(3)
    x, y, g = (torch.randn(n, d).to(dtype) for _ in range(3))
    w, b = torch.randn(d, dtype=torch.float64 if dtype == torch.float64 else torch.float32), torch.randn(d)
    b = b.to(w.dtype)

    def run(r0, r1):
        xs, ys = x[r0:r1].clone().requires_grad_(), y[r0:r1].clone().requires_grad_()
        out = sublayer.functional.fused.add_norm(
            xs, ys, d, w, b, dropout=p, impl="fused", generator=torch.Generator().manual_seed(5)
        )
        out.backward(g[r0:r1])
        return out.detach(), xs.grad, ys.grad

    big = run(0, n)
    chunks = [(0, 7)] if p > 0 else [(r, min(n, r + 60)) for r in range(0, n, 60)]
    for r0, r1 in chunks:
        for a, s in zip(big, run(r0, r1)):
            assert torch.equal(a[r0:r1], s)
    if p > 0:  # (p = 0: one shared gradient today; the aliasing fix is a separate change)
        assert big[1].untyped_storage().data_ptr() != big[2].untyped_storage().data_ptr()


@pytest.mark.parametrize("value, limit", [(None, 256.0), ("3", 3.0), ("0", 0.0)])
def test_limit_from_the_environment_at_load(value, limit):
    # SUBLAYER_BUFFER_CACHE_MB (read by sublayer.settings) is applied when the kernels load in a fresh process
    env = {k: v for k, v in os.environ.items() if k != "SUBLAYER_BUFFER_CACHE_MB"}
    if value is not None:
        env["SUBLAYER_BUFFER_CACHE_MB"] = value
    code = "from sublayer import memory; print(memory.buffer_cache()['limit_mb'])"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert float(res.stdout) == limit


def test_a_bad_limit_is_an_error_not_a_failed_build():
    env = os.environ | {"SUBLAYER_BUFFER_CACHE_MB": "lots"}
    code = "import sublayer.kernels as k; k.available()"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    assert "ValueError: SUBLAYER_BUFFER_CACHE_MB='lots' must be a number >= 0" in res.stderr
    assert "unavailable" not in res.stderr
