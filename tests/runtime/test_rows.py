"""runtime.rows' norms on prepared rows against torch: add_norm and norm_rows, LayerNorm and RMSNorm, with and
without the kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from sublayer import kernels
from sublayer.runtime.rows import add_norm, norm_rows


@pytest.fixture(params=["kernels", "reference"])
def kernels_switch(request):
    was = kernels.enabled()
    kernels.set_enabled(request.param == "kernels")
    yield
    kernels.set_enabled(was)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("want_sum", [True, False])
def test_add_norm_and_norm_rows_match_torch(kernels_switch, rms, want_sum):
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(5, 23, generator=g), torch.randn(5, 23, generator=g)
    w, b = torch.randn(23, generator=g), None if rms else torch.randn(23, generator=g)
    s = x + y
    want = F.rms_norm(s, (23,), w, 1e-6) if rms else F.layer_norm(s, (23,), w, b, 1e-6)
    out, total = add_norm(x, y, w, b, 1e-6, rms, want_sum=want_sum)
    assert_close(out, want)
    if want_sum:
        assert_close(total, s)
    assert_close(norm_rows(s, w, b, 1e-6, rms), want)
