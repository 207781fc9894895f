"""The module contract, for every public module: device/dtype factory kwargs, meta-device init, deepcopy, pickle,
state_dict round trip, non-contiguous input = contiguous input, batch 0 and sequence 0 give empty outputs,
gradcheck in float64 over the inputs and every parameter."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from ._weights import MODULE_CASES, ModuleCase, output, randomize_

B, T = 3, 4
cases = pytest.mark.parametrize("case", MODULE_CASES, ids=[c.name for c in MODULE_CASES])


def built(case: ModuleCase, **kw) -> torch.nn.Module:
    """A module with random (non-trivial) parameters, in eval mode (dropout is 0 anyway)."""
    return randomize_(case.build(**kw)).eval()


def run(module, case: ModuleCase, b=B, t=T, dtype=torch.float32, device="cpu"):
    args, kwargs = case.inputs(b, t, dtype, device)
    return output(module(*args, **kwargs))


def tensors(module):
    return list(module.parameters()) + list(module.buffers())


@cases
def test_dtype_kwarg(case):
    m64 = built(case, dtype=torch.float64)
    assert all(t.dtype == torch.float64 for t in tensors(m64))
    out64 = run(m64, case, dtype=torch.float64)
    assert out64.dtype == torch.float64 and out64.shape == (B, T, case.out_dim)
    m32 = case.build().eval()
    m32.load_state_dict(m64.state_dict())
    assert all(t.dtype == torch.float32 for t in tensors(m32))
    torch.testing.assert_close(run(m32, case), out64.float())


@cases
def test_device_kwarg_and_meta_init(case):
    cpu = case.build(device="cpu")
    assert all(t.device.type == "cpu" for t in tensors(cpu))
    meta = case.build(device="meta", dtype=torch.float64)
    assert all(t.device.type == "meta" and t.dtype == torch.float64 for t in tensors(meta))
    out = run(meta.eval(), case, dtype=torch.float64, device="meta")  # shape inference without memory
    assert out.device.type == "meta" and out.shape == (B, T, case.out_dim)
    # meta → real storage → load real weights: the path of loading a big checkpoint without a random init
    src = built(case)
    real = meta.to_empty(device="cpu").to(torch.float32)
    real.load_state_dict(src.state_dict())
    torch.testing.assert_close(run(real.eval(), case), run(src, case), rtol=0, atol=0)


@cases
def test_deepcopy(case):
    m = built(case)
    c = copy.deepcopy(m)
    ptrs = {p.data_ptr() for p in m.parameters()}
    assert all(p.data_ptr() not in ptrs for p in c.parameters())
    torch.testing.assert_close(run(c, case), run(m, case), rtol=0, atol=0)
    for p in c.parameters():  # the copy is independent of the original
        with torch.no_grad():
            p.add_(1.0)
    if ptrs:
        assert not torch.allclose(run(c, case), run(m, case))


@cases
def test_pickle(case):
    m = built(case)
    c = pickle.loads(pickle.dumps(m))
    assert type(c) is type(m)
    torch.testing.assert_close(run(c, case), run(m, case), rtol=0, atol=0)


@cases
def test_state_dict_round_trip(case):
    m = built(case)
    sd = m.state_dict()
    fresh = randomize_(case.build()).eval()  # different random values
    assert set(fresh.state_dict()) == set(sd)
    if sd:
        assert not torch.allclose(run(fresh, case), run(m, case))
    fresh.load_state_dict(sd, strict=True)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, sd[k]), k
    torch.testing.assert_close(run(fresh, case), run(m, case), rtol=0, atol=0)


@cases
def test_non_contiguous_input_equals_contiguous(case):
    m = built(case)
    args, kwargs = case.inputs(B, T, torch.float32, "cpu")
    # the same values through a (T, B, D) buffer seen transposed: strides differ, data equal
    nc = tuple(a.transpose(0, 1).contiguous().transpose(0, 1) if isinstance(a, torch.Tensor) else a for a in args)
    assert not nc[0].is_contiguous() and torch.equal(nc[0], args[0])
    torch.testing.assert_close(output(m(*nc, **kwargs)), output(m(*args, **kwargs)))


@cases
@pytest.mark.parametrize(("b", "t"), [(0, T), (B, 0)], ids=["batch0", "seq0"])
def test_empty_batch_or_sequence(case, b, t):
    m = built(case)
    args, kwargs = case.inputs(b, t, torch.float32, "cpu")
    args = tuple(a.requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    out = output(m(*args, **kwargs))
    assert out.shape == (b, t, case.out_dim)
    out.sum().backward()
    assert all(p.grad is None or (torch.isfinite(p.grad).all() and (p.grad == 0).all()) for p in m.parameters())


@cases
def test_gradcheck_float64_inputs_and_parameters(case):
    m = built(case, dtype=torch.float64)
    args, kwargs = case.inputs(2, 3, torch.float64, "cpu")
    slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    names, params = zip(*m.named_parameters()) if list(m.parameters()) else ((), ())
    leaves = [args[i].detach().clone().requires_grad_(True) for i in slots]
    leaves += [p.detach().clone().requires_grad_(True) for p in params]

    def f(*ts):
        a = list(args)
        for i, x in zip(slots, ts[: len(slots)]):
            a[i] = x
        state = dict(zip(names, ts[len(slots) :]))
        return output(torch.func.functional_call(m, state, tuple(a), kwargs))

    assert torch.autograd.gradcheck(f, tuple(leaves), fast_mode=True)  # a random projection: fast for big stacks
