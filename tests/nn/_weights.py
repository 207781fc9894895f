"""Weight copying between sublayer modules and their torch.nn / HF references, for the parity tests.

Every helper works from a list of *pairs* ``(name, ours, ref, index)``: ``ours`` is one of our parameters, ``ref``
the reference parameter, ``index`` the slice of ``ref`` that corresponds (``nn.MultiheadAttention`` packs q, k, v
in one ``in_proj_weight``) or None. The same pairs copy the weights (:func:`copy_pairs`) and compare the gradients
(:func:`assert_grads_close`), so a mapping mistake shows up in both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

Pair = tuple[str, nn.Parameter, nn.Parameter, "slice | None"]


def randomize_(module: nn.Module, std: float = 0.3) -> nn.Module:
    """Fill every parameter with N(0, std²) noise — so biases and norm weights are not the trivial 0/1 of their
    initialisation and a mis-copied bias or a swapped norm cannot hide."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, std)
    return module


def _linear_pairs(prefix: str, ours: nn.Module, ref: nn.Module) -> list[Pair]:
    pairs: list[Pair] = [(f"{prefix}.weight", ours.weight, ref.weight, None)]
    if getattr(ours, "bias", None) is not None or getattr(ref, "bias", None) is not None:
        pairs.append((f"{prefix}.bias", ours.bias, ref.bias, None))
    return pairs


def mha_pairs(ours: nn.Module, ref: nn.MultiheadAttention, prefix: str = "attn") -> list[Pair]:
    """Our ``MultiHeadAttention`` (q/k/v/out_proj) <-> ``nn.MultiheadAttention`` (packed or separate in_proj)."""
    d = ref.embed_dim
    if ref.bias_k is not None or ref.bias_v is not None:
        raise NotImplementedError("add_bias_kv has no counterpart in MultiHeadAttention")
    pairs: list[Pair] = []
    names = ("q_proj", "k_proj", "v_proj")
    for i, name in enumerate(names):
        lin = getattr(ours, name)
        if ref._qkv_same_embed_dim:
            pairs.append((f"{prefix}.{name}.weight", lin.weight, ref.in_proj_weight, slice(i * d, (i + 1) * d)))
        else:
            pairs.append((f"{prefix}.{name}.weight", lin.weight, getattr(ref, f"{name}_weight"), None))
        if ref.in_proj_bias is not None:
            pairs.append((f"{prefix}.{name}.bias", lin.bias, ref.in_proj_bias, slice(i * d, (i + 1) * d)))
    pairs += _linear_pairs(f"{prefix}.out_proj", ours.out_proj, ref.out_proj)
    return pairs


def _norm_pairs(prefix: str, ours: nn.Module, ref: nn.Module) -> list[Pair]:
    return _linear_pairs(prefix, ours, ref)  # weight and (optional) bias, same layout


def encoder_layer_pairs(ours: nn.Module, ref: nn.TransformerEncoderLayer, prefix: str = "layer") -> list[Pair]:
    """``EncoderBlock`` <-> ``nn.TransformerEncoderLayer``."""
    return (
        mha_pairs(ours.self_attn, ref.self_attn, f"{prefix}.self_attn")
        + _linear_pairs(f"{prefix}.ffn.fc1", ours.ffn.fc1, ref.linear1)
        + _linear_pairs(f"{prefix}.ffn.fc2", ours.ffn.fc2, ref.linear2)
        + _norm_pairs(f"{prefix}.norm1", ours.attn_residual.norm, ref.norm1)
        + _norm_pairs(f"{prefix}.norm2", ours.ffn_residual.norm, ref.norm2)
    )


def decoder_layer_pairs(ours: nn.Module, ref: nn.TransformerDecoderLayer, prefix: str = "layer") -> list[Pair]:
    """``DecoderBlock`` <-> ``nn.TransformerDecoderLayer``."""
    return (
        mha_pairs(ours.self_attn, ref.self_attn, f"{prefix}.self_attn")
        + mha_pairs(ours.cross_attn, ref.multihead_attn, f"{prefix}.cross_attn")
        + _linear_pairs(f"{prefix}.ffn.fc1", ours.ffn.fc1, ref.linear1)
        + _linear_pairs(f"{prefix}.ffn.fc2", ours.ffn.fc2, ref.linear2)
        + _norm_pairs(f"{prefix}.norm1", ours.self_attn_residual.norm, ref.norm1)
        + _norm_pairs(f"{prefix}.norm2", ours.cross_attn_residual.norm, ref.norm2)
        + _norm_pairs(f"{prefix}.norm3", ours.ffn_residual.norm, ref.norm3)
    )


def stack_pairs(ours: nn.Module, ref: nn.Module) -> list[Pair]:
    """``TransformerEncoder``/``TransformerDecoder`` <-> ``nn.TransformerEncoder``/``nn.TransformerDecoder``."""
    if len(ours.layers) != len(ref.layers):
        raise ValueError(f"layer counts differ: {len(ours.layers)} vs {len(ref.layers)}")
    if (ours.norm is None) != (ref.norm is None):
        raise ValueError(f"final norms differ: {ours.norm!r} vs {ref.norm!r}")
    pairs: list[Pair] = []
    for i, (a, b) in enumerate(zip(ours.layers, ref.layers, strict=True)):
        fn = encoder_layer_pairs if isinstance(b, nn.TransformerEncoderLayer) else decoder_layer_pairs
        pairs += fn(a, b, f"layers.{i}")
    if ours.norm is not None:
        pairs += _norm_pairs("norm", ours.norm, ref.norm)
    return pairs


def gpt2_block_pairs(ours: nn.Module, ref: nn.Module, *, grad: bool = False) -> list[tuple[str, nn.Parameter, Tensor]]:
    """A GPT-2-style block of ours (attn_residual, attn, ffn_residual, ffn) <-> HF ``GPT2Block``.

    Returns ``(name, ours, ref_view)`` where ``ref_view`` is the HF tensor (its ``.grad`` when ``grad``) already
    sliced and transposed to our layout: HF ``Conv1D`` stores (in, out) and ``c_attn`` packs q, k, v along its
    output dim.
    """
    d = ref.ln_1.normalized_shape[0]

    def get(p: nn.Parameter) -> Tensor:
        if grad and p.grad is None:
            raise AssertionError("a GPT2Block parameter got no gradient")
        return p.grad if grad else p

    w, b = get(ref.attn.c_attn.weight), get(ref.attn.c_attn.bias)  # (d, 3d), (3d,)
    out = [
        ("ln_1.weight", ours.attn_residual.norm.weight, get(ref.ln_1.weight)),
        ("ln_1.bias", ours.attn_residual.norm.bias, get(ref.ln_1.bias)),
        ("ln_2.weight", ours.ffn_residual.norm.weight, get(ref.ln_2.weight)),
        ("ln_2.bias", ours.ffn_residual.norm.bias, get(ref.ln_2.bias)),
        ("attn.c_proj.weight", ours.attn.out_proj.weight, get(ref.attn.c_proj.weight).t()),
        ("attn.c_proj.bias", ours.attn.out_proj.bias, get(ref.attn.c_proj.bias)),
        ("mlp.c_fc.weight", ours.ffn.fc1.weight, get(ref.mlp.c_fc.weight).t()),
        ("mlp.c_fc.bias", ours.ffn.fc1.bias, get(ref.mlp.c_fc.bias)),
        ("mlp.c_proj.weight", ours.ffn.fc2.weight, get(ref.mlp.c_proj.weight).t()),
        ("mlp.c_proj.bias", ours.ffn.fc2.bias, get(ref.mlp.c_proj.bias)),
    ]
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        lin = getattr(ours.attn, name)
        out.append((f"attn.c_attn[{name}].weight", lin.weight, w[:, i * d : (i + 1) * d].t()))
        out.append((f"attn.c_attn[{name}].bias", lin.bias, b[i * d : (i + 1) * d]))
    return out


def bert_layer_pairs(ours: nn.Module, ref: nn.Module) -> list[Pair]:
    """``EncoderBlock`` (post-norm) <-> HF ``BertLayer``."""
    att = ref.attention
    return (
        _linear_pairs("attention.self.query", ours.self_attn.q_proj, att.self.query)
        + _linear_pairs("attention.self.key", ours.self_attn.k_proj, att.self.key)
        + _linear_pairs("attention.self.value", ours.self_attn.v_proj, att.self.value)
        + _linear_pairs("attention.output.dense", ours.self_attn.out_proj, att.output.dense)
        + _norm_pairs("attention.output.LayerNorm", ours.attn_residual.norm, att.output.LayerNorm)
        + _linear_pairs("intermediate.dense", ours.ffn.fc1, ref.intermediate.dense)
        + _linear_pairs("output.dense", ours.ffn.fc2, ref.output.dense)
        + _norm_pairs("output.LayerNorm", ours.ffn_residual.norm, ref.output.LayerNorm)
    )


def _ref_view(ref: Tensor, index: slice | None) -> Tensor:
    return ref if index is None else ref[index]


def copy_pairs(pairs: Iterable[Pair]) -> None:
    """ours <- ref (the reference's weights into our module)."""
    with torch.no_grad():
        for name, ours, ref, index in pairs:
            src = _ref_view(ref, index)
            if ours.shape != src.shape:
                raise ValueError(f"{name}: shape {tuple(ours.shape)} vs reference {tuple(src.shape)}")
            ours.copy_(src)


def copy_views(pairs: Iterable[tuple[str, nn.Parameter, Tensor]]) -> None:
    """ours <- an already-sliced/transposed reference view (HF Conv1D layouts)."""
    with torch.no_grad():
        for name, ours, src in pairs:
            if ours.shape != src.shape:
                raise ValueError(f"{name}: shape {tuple(ours.shape)} vs reference {tuple(src.shape)}")
            ours.copy_(src)


def assert_grads_close(pairs: Iterable[Pair], **tol) -> None:
    """Each of our parameters' gradient equals the matching slice of the reference's."""
    pairs = list(pairs)
    assert pairs, "no parameter pairs to compare"
    for name, ours, ref, index in pairs:
        assert ours.grad is not None, f"{name}: our parameter got no gradient"
        assert ref.grad is not None, f"{name}: the reference parameter got no gradient"
        torch.testing.assert_close(ours.grad, _ref_view(ref.grad, index), msg=lambda m, n=name: f"{n}: {m}", **tol)


def leaf(t: Tensor) -> Tensor:
    """A fresh leaf copy of ``t`` that records its gradient."""
    return t.detach().clone().requires_grad_(True)


def backward_both(out: Tensor, ref_out: Tensor, inputs: Iterable[tuple[Tensor, Tensor]], pairs: Iterable[Pair]) -> None:
    """Backpropagate the same random cotangent through ours and the reference, then compare the input grads
    (``(ours, ref)`` pairs) and every parameter grad."""
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (ref_out * g).sum().backward()
    for a, b in inputs:
        torch.testing.assert_close(a.grad, b.grad)
    assert_grads_close(pairs)


def mha_from_torch(ref: nn.MultiheadAttention, **kw) -> nn.Module:
    """Our ``MultiHeadAttention`` carrying ``ref``'s weights (same sizes, dtype, device)."""
    from sublayer import MultiHeadAttention

    p = ref.out_proj.weight
    ours = MultiHeadAttention(
        ref.embed_dim,
        ref.num_heads,
        dropout=ref.dropout,
        bias=ref.in_proj_bias is not None,
        kdim=ref.kdim,
        vdim=ref.vdim,
        device=p.device,
        dtype=p.dtype,
        **kw,
    )
    copy_pairs(mha_pairs(ours, ref))
    return ours


# --------------------------------------------------------------------------- every public module, with inputs
# (shared by test_module_contract.py and test_compile.py)

CD, CH, CF, CS = 6, 2, 5, 3  # d_model, heads, d_ff, memory length: tiny on purpose


@dataclass(frozen=True)
class ModuleCase:
    """A public module: ``build(**factory_kw)`` and ``inputs(b, t, dtype, device)`` -> (args, kwargs)."""

    name: str
    build: Callable[..., nn.Module]
    inputs: Callable[..., tuple[tuple, dict]]
    out_dim: int = CD

    def __repr__(self) -> str:
        return self.name


def _x(b, t, d, dtype, device, seed=0):
    if torch.device(device).type == "meta":
        return torch.empty(b, t, d, dtype=dtype, device=device)
    return torch.randn(b, t, d, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def _kpm(b, t, device):
    kpm = torch.zeros(b, t, dtype=torch.bool)
    kpm[1::2, t // 2 + 1 :] = True  # odd rows padded at the end; key 0 always real
    return kpm.to(device)


def _one(b, t, dtype, device):
    return (_x(b, t, CD, dtype, device),), {}


def _two(b, t, dtype, device):
    return (_x(b, t, CD, dtype, device), _x(b, t, CD, dtype, device, seed=1)), {}


def _with_tanh(b, t, dtype, device):
    return (_x(b, t, CD, dtype, device), torch.tanh), {}


def _self_attn(b, t, dtype, device):
    return (_x(b, t, CD, dtype, device),), {"key_padding_mask": _kpm(b, t, device), "is_causal": True}


def _cross_attn(b, t, dtype, device):
    args = (_x(b, t, CD, dtype, device), _x(b, CS, 7, dtype, device, 1), _x(b, CS, 5, dtype, device, 2))
    return args, {"key_padding_mask": _kpm(b, CS, device), "need_weights": True}


def _encoder(b, t, dtype, device):
    return (_x(b, t, CD, dtype, device),), {"key_padding_mask": _kpm(b, t, device)}


def _decoder(b, t, dtype, device):
    args = (_x(b, t, CD, dtype, device), _x(b, CS, CD, dtype, device, 1))
    return args, {"tgt_key_padding_mask": _kpm(b, t, device), "memory_key_padding_mask": _kpm(b, CS, device)}


def _module_cases() -> list[ModuleCase]:
    import sublayer as S

    return [
        ModuleCase("PositionWiseFFN", lambda **kw: S.PositionWiseFFN(CD, CF, **kw), _one),
        ModuleCase(
            "PositionWiseFFN_swiglu",
            lambda **kw: S.PositionWiseFFN(CD, CF, d_out=7, activation="swiglu", **kw),
            _one,
            7,
        ),
        ModuleCase("Conv1D", lambda **kw: S.Conv1D(7, CD, **kw), _one, 7),
        ModuleCase("LayerNorm", lambda **kw: S.LayerNorm(CD, **kw), _one),
        ModuleCase("RMSNorm", lambda **kw: S.RMSNorm(CD, **kw), _one),
        ModuleCase("AddNorm", lambda **kw: S.AddNorm(CD, **kw), _two),
        ModuleCase("AddNorm_rms", lambda **kw: S.AddNorm(CD, norm="rms", **kw), _two),
        ModuleCase("ResidualConnection", lambda **kw: S.ResidualConnection(**kw), _with_tanh),
        ModuleCase("PreNormResidual", lambda **kw: S.PreNormResidual(CD, **kw), _with_tanh),
        ModuleCase("MultiHeadAttention", lambda **kw: S.MultiHeadAttention(CD, CH, **kw), _self_attn),
        ModuleCase(
            "MultiHeadAttention_cross", lambda **kw: S.MultiHeadAttention(CD, CH, kdim=7, vdim=5, **kw), _cross_attn
        ),
        ModuleCase("EncoderBlock", lambda **kw: S.EncoderBlock(CD, CH, CF, **kw), _encoder),
        ModuleCase(
            "EncoderBlock_prenorm_rms",
            lambda **kw: S.EncoderBlock(CD, CH, CF, norm_first=True, norm="rms", **kw),
            _encoder,
        ),
        ModuleCase("DecoderBlock", lambda **kw: S.DecoderBlock(CD, CH, CF, activation="gelu", **kw), _decoder),
        ModuleCase(
            "TransformerEncoder",
            lambda **kw: S.TransformerEncoder(S.EncoderBlock(CD, CH, CF, norm_first=True, **kw), 2),
            _encoder,
        ),
        ModuleCase(
            "TransformerDecoder",
            lambda **kw: S.TransformerDecoder(S.DecoderBlock(CD, CH, CF, norm_first=True, **kw), 2),
            _decoder,
        ),
    ]


MODULE_CASES = _module_cases()


def output(out) -> Tensor:
    """The tensor output of a module (MultiHeadAttention returns (out, weights))."""
    return out[0] if isinstance(out, tuple) else out
