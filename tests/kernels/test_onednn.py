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


def test_bf16_weights_are_packed_only_where_torch_runs_onednn_bf16(monkeypatch):
    from sublayer.runtime.linear import OneDNNLinear

    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(7, 11, generator=g), torch.randn(5, 11, generator=g), torch.randn(5, generator=g)
    want = F.linear(x.bfloat16(), w.bfloat16(), b.bfloat16())
    onednn.available.cache_clear()
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)  # an AVX2 CPU
    try:
        assert onednn.available() and not onednn.available(torch.bfloat16)
        lin = OneDNNLinear(w, b, dtype=torch.bfloat16)
        assert lin.packed is None
        torch.testing.assert_close(lin(x), want)
        assert OneDNNLinear(w, b).packed is not None  # float32 keeps oneDNN
    finally:
        onednn.available.cache_clear()
