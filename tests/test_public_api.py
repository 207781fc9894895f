"""The public API: names exported, documented, and with the signatures the README promises."""

from __future__ import annotations

import inspect

import pytest

import sublayer
import sublayer.functional as SF

PUBLIC = sorted(sublayer.__all__)
FUNCTIONAL = sorted(SF.__all__)
DOCUMENTED = lambda o: inspect.isclass(o) or inspect.isfunction(o) or inspect.ismodule(o)  # noqa: E731


@pytest.mark.parametrize("name", PUBLIC)
def test_top_level_name_exists_and_is_documented(name):
    obj = getattr(sublayer, name)  # AttributeError = a name in __all__ that does not exist
    if DOCUMENTED(obj):
        doc = inspect.getdoc(obj) if not inspect.isclass(obj) else obj.__doc__  # a class's own docstring only
        assert doc and doc.strip(), f"sublayer.{name} has no docstring"


@pytest.mark.parametrize("name", FUNCTIONAL)
def test_functional_name_exists_and_is_documented(name):
    obj = getattr(SF, name)
    if DOCUMENTED(obj):
        doc = obj.__doc__
        assert doc and doc.strip(), f"sublayer.functional.{name} has no docstring"


def test_top_level_exports():
    expected = {
        "PositionWiseFFN", "Conv1D", "LayerNorm", "RMSNorm", "AddNorm", "ResidualConnection", "PreNormResidual",
        "MultiHeadAttention", "EncoderBlock", "DecoderBlock", "TransformerEncoder", "TransformerDecoder",
        "functional",
    }  # fmt: skip
    assert expected <= set(sublayer.__all__)
    assert isinstance(sublayer.__version__, str) and sublayer.__version__


def test_functional_exports_the_op_references():
    expected = {"feed_forward", "layer_norm", "rms_norm", "add_norm", "multi_head_attention"}
    assert expected <= set(SF.__all__)
    assert sublayer.functional is SF
    for name in expected:
        assert callable(getattr(SF, name))


@pytest.mark.parametrize("name", ["feed_forward", "layer_norm", "rms_norm", "add_norm", "multi_head_attention"])
def test_functional_ops_document_args_returns(name):
    doc = getattr(SF, name).__doc__
    assert "Args:" in doc and "Returns:" in doc


@pytest.mark.parametrize("name", ["feed_forward", "layer_norm", "rms_norm", "add_norm"])
def test_functional_norm_ffn_document_raises(name):
    assert "Raises:" in getattr(SF, name).__doc__


@pytest.mark.parametrize(
    "name", ["PositionWiseFFN", "Conv1D", "LayerNorm", "RMSNorm", "AddNorm", "ResidualConnection", "PreNormResidual"]
)
def test_core_modules_document_shapes(name):
    assert "Shape:" in getattr(sublayer, name).__doc__


def _params(obj):
    return inspect.signature(obj).parameters


# name -> (positional-or-keyword params in order, keyword-only params that must exist) as issue 3 specifies
SIGNATURES = {
    "PositionWiseFFN": (["d_model", "d_ff"], ["d_out", "activation", "dropout", "output_dropout", "bias", "device",
                                              "dtype"]),
    "Conv1D": (["nf", "nx"], ["device", "dtype"]),
    "LayerNorm": (["normalized_shape", "eps"], ["elementwise_affine", "bias", "device", "dtype"]),
    "RMSNorm": (["normalized_shape", "eps"], ["elementwise_affine", "device", "dtype"]),
    "AddNorm": (["normalized_shape", "dropout"], ["norm", "eps", "device", "dtype"]),
    "ResidualConnection": (["dropout"], []),
    "PreNormResidual": (["normalized_shape", "dropout"], ["norm", "device", "dtype"]),
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_core_module_signatures(name):
    positional, keyword_only = SIGNATURES[name]
    params = _params(getattr(sublayer, name))
    pos = [n for n, p in params.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert pos == positional
    for n in keyword_only:
        assert n in params and params[n].kind is inspect.Parameter.KEYWORD_ONLY, n


def test_documented_defaults():
    p = _params(sublayer.PositionWiseFFN)
    assert p["d_ff"].default is None and p["d_out"].default is None and p["activation"].default == "relu"
    assert p["dropout"].default == 0.0 and p["bias"].default is True
    assert _params(sublayer.LayerNorm)["eps"].default == 1e-5
    assert _params(sublayer.RMSNorm)["eps"].default == 1e-6
    a = _params(sublayer.AddNorm)
    assert a["dropout"].default == 0.0 and a["norm"].default == "layer" and a["eps"].default is None


def test_activation_and_norm_choices():
    assert SF.ACTIVATIONS == ("relu", "gelu", "gelu_tanh", "silu", "relu2", "swiglu", "geglu", "reglu")
    assert SF.GATED_ACTIVATIONS == ("swiglu", "geglu", "reglu")
    assert SF.NORMS == ("layer", "rms")
