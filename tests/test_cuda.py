"""On a CUDA device the modules run through PyTorch's own ops (SDPA, autocast) and give the CPU's numbers.

CI has no GPU, so these skip there (no GPU machine was lent to this task either: they were checked only with
the device swapped for "cpu").
"""

import copy

import pytest
import torch

import sublayer as sl
from sublayer.models import GPT2, GPT2Config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# TF32 would change fp32 GEMM numbers on the GPU; the comparison is of the math, so keep full fp32.
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

MODULES = {
    "ffn_relu": (lambda: sl.PositionWiseFFN(12, 20, dropout=0.0), lambda x: (x,)),
    "ffn_swiglu": (lambda: sl.PositionWiseFFN(12, 20, activation="swiglu"), lambda x: (x,)),
    "layer_norm": (lambda: sl.LayerNorm(12), lambda x: (x,)),
    "rms_norm": (lambda: sl.RMSNorm(12), lambda x: (x,)),
    "add_norm": (lambda: sl.AddNorm(12), lambda x: (x, x.flip(1))),
    "mha_causal": (lambda: sl.MultiHeadAttention(12, 3), lambda x: (x,)),
    "encoder_post": (lambda: sl.EncoderBlock(12, 3, 20), lambda x: (x,)),
    "encoder_pre_gelu": (lambda: sl.EncoderBlock(12, 3, 20, norm_first=True, activation="gelu"), lambda x: (x,)),
}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_cuda_equals_cpu_forward_and_backward(name):
    make, args = MODULES[name]
    torch.manual_seed(0)
    cpu = make()
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randn(3, 7, 12, requires_grad=True)
    xg = x.detach().cuda().requires_grad_()
    kw = {"is_causal": True} if name == "mha_causal" else {}
    out_c = cpu(*args(x), **kw)
    out_g = gpu(*args(xg), **kw)
    out_c = out_c[0] if isinstance(out_c, tuple) else out_c
    out_g = out_g[0] if isinstance(out_g, tuple) else out_g
    torch.testing.assert_close(out_g.cpu(), out_c, rtol=1e-5, atol=1e-5)  # different kernels, same fp32 math
    out_c.square().sum().backward()
    out_g.square().sum().backward()
    torch.testing.assert_close(xg.grad.cpu(), x.grad, rtol=1e-4, atol=1e-5)
    for (n, pc), pg in zip(cpu.named_parameters(), gpu.parameters()):
        torch.testing.assert_close(pg.grad.cpu(), pc.grad, rtol=1e-4, atol=1e-5, msg=n)


def test_cuda_bf16_autocast_trains():
    torch.manual_seed(0)
    block = sl.EncoderBlock(16, 4, 32, dropout=0.1).cuda()
    x = torch.randn(2, 9, 16, device="cuda")
    pad = torch.zeros(2, 9, dtype=torch.bool, device="cuda")
    pad[1, 5:] = True
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = block(x, key_padding_mask=pad)
    out.float().sum().backward()
    assert torch.isfinite(out.float()).all()
    assert all(torch.isfinite(p.grad).all() for p in block.parameters())


def test_cuda_gpt2_matches_cpu_and_generates_the_same():
    cfg = GPT2Config(vocab_size=53, max_positions=32, d_model=12, n_layers=2, n_heads=3, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    cpu = GPT2(cfg).eval()
    gpu = copy.deepcopy(cpu).cuda()
    ids = torch.randint(0, 53, (2, 6))
    torch.testing.assert_close(gpu(ids.cuda()).cpu(), cpu(ids), rtol=1e-5, atol=1e-5)
    assert torch.equal(gpu.generate(ids.cuda(), 8).cpu(), cpu.generate(ids, 8))
