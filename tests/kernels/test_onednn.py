"""sublayer.kernels.onednn: torch's oneDNN linear, packed or not, with and without its GELU post-op."""

import pytest
import torch
import torch.nn.functional as F

from sublayer.kernels import onednn

pytestmark = pytest.mark.skipif(not onednn.available(), reason="torch without oneDNN's linear ops")


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(gelu, packed, bias):
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(11, 13, generator=g), torch.randn(5, 13, generator=g)
    b = torch.randn(5, generator=g) if bias else None
    want = F.linear(x, w, b)
    want = F.gelu(want) if gelu else want
    got = onednn.linear(x, onednn.pack(w) if packed else w, b, gelu=gelu)
    torch.testing.assert_close(got, want)
