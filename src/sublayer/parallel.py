"""Scale-out on PyTorch's own distributed engine: DTensor tensor parallelism and FSDP2.

Model code knows nothing of this module (torchtitan style): the plans live here and address sub-modules by
their fully qualified names.

Tensor parallelism (Megatron layout, built with ``parallelize_module``):

- :class:`~sublayer.nn.PositionWiseFFN`: ``fc1`` ``ColwiseParallel`` (for a gated activation a strided column
  shard, so that each rank holds ``[gate_r; up_r]`` — see below), ``fc2`` ``RowwiseParallel``.
- :class:`~sublayer.nn.MultiHeadAttention`: ``q_proj``/``k_proj``/``v_proj`` ``ColwiseParallel`` (each rank
  holds ``n_heads / tp`` whole query heads and, with grouped-query attention, ``n_kv_heads / tp`` whole key/value
  heads: the groups stay on one rank, so ``n_kv_heads`` must divide by the mesh size too), ``out_proj``
  ``RowwiseParallel``.
- With ``sequence_parallel=True`` the residual stream inside each block / stack is split along the sequence
  (dim 1) between the ranks; the norms (replicated parameters) run on the local slice, attention and FFN
  all-gather their input and reduce-scatter their output.
- Everything else (embeddings, output heads, norms without sequence parallelism) stays replicated: their
  gradients are the same full gradients on every rank.

Why an extra style on the parent modules. ``ColwiseParallel``/``RowwiseParallel`` turn the Linear's parameters
into DTensors and hook the Linear's *forward*. Our modules never call their Linears: they pass the weights to the
one functional reference (``sublayer.functional.feed_forward`` / ``multi_head_attention``). So the plan also puts
a style on each parent module (:class:`FFNParallel`, :class:`AttentionParallel`) which, for the duration of its
forward, shows the functional the *local* shards (``DTensor.to_local``: gradients flow back into the DTensor
parameters) and the local head count, and does the two Megatron collectives with DTensor redistributions:
identity forward / all-reduce backward on the input, all-reduce forward / identity backward on the output. The
row-parallel bias is added once, after the reduction (adding it on every rank would count it ``tp`` times), and so
is the FFN's output dropout.

Pitfalls handled here:

- Gated FFNs pack ``[gate; up]`` along ``fc1``'s output and split the hidden with ``chunk(2)``. A plain column
  shard would give rank 0 all of ``gate``. The plan shards ``fc1`` with ``_StridedShard(0, split_factor=2)``:
  rank r holds ``[gate_r; up_r]``, the local chunk(2) is right, and ``full_tensor()`` / checkpoints keep the
  original row order.
- GPT-2's fused ``c_attn`` (HF ``Conv1D``, q, k, v packed along the output): ``ColwiseParallel`` refuses a Conv1D,
  and a column shard of a fused q|k|v *runs but gives wrong numbers* (rank 0 would get all of q and part of k).
  :class:`sublayer.models.gpt2.GPT2` has separate ``q_proj``/``k_proj``/``v_proj`` — its checkpoint loader splits
  ``c_attn`` at load time — so the attention plan above applies unchanged (tested on a model loaded from an HF
  checkpoint).
- Dropout in training: activations outside the sharded regions are replicated, so every rank must draw the same
  masks — seed all ranks identically. Inside a region (hidden / attention dropout) each rank then draws its masks
  from the same generator state for its own shard: valid dropout, but masks repeat across shards; use dropout 0
  when you need bit-parity with one process.
- ``need_weights=True`` under TP: the per-head weights are all-gathered (averaged ones all-reduced), so the
  returned weights equal one process's.

- Saving: parameters are DTensors; ``save_pretrained`` needs plain tensors — gather a full state dict first
  (:func:`full_state_dict`, on every rank; :func:`full_tensor` for one tensor or gradient), or save shards with
  ``torch.distributed.checkpoint``. ``DTensor.full_tensor()`` itself raises for the strided shard of a gated
  ``fc1`` on some torch releases (2.11: "unable to be interpreted into a corresponding shard_order"); these two
  gather it themselves.

FSDP2: :func:`fully_shard` applies ``torch.distributed.fsdp.fully_shard`` to every block, then to the root. On a
2-D mesh, ``tensor_parallel(model, mesh["tp"])`` then ``fully_shard(model, mesh["dp"])`` trains like one process
(checked by hand on 4 processes; not in CI). Known limit there: for a *gated* FFN, torch gathers the nested strided
shard of ``fc1`` in the wrong row order in ``full_tensor()`` (training itself matched).

:func:`launch` runs a function on N local processes (or as one rank under ``torchrun``): ``sublayer demo
--nproc N`` uses it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2 + TP's strided shard (torch >= 2.5)

from .nn.attention import MultiHeadAttention
from .nn.blocks import DecoderBlock, EncoderBlock
from .nn.ffn import PositionWiseFFN
from .nn.norm import LayerNorm, RMSNorm
from .nn.residual import AddNorm
from .nn.stacks import TransformerDecoder, TransformerEncoder


__all__ = [
    "tensor_parallel",
    "tensor_parallel_plan",
    "fully_shard",
    "full_tensor",
    "full_state_dict",
    "launch",
    "FFNParallel",
    "AttentionParallel",
    "GatedColwiseParallel",
    "SequenceParallelNorm",
]

_TP_MARK = "_sublayer_tensor_parallel"

# ---------------------------------------------------------------------------------------------------------------
# The Megatron collectives, as DTensor redistributions (differentiable; gloo, NCCL and the fake backend).


def _copy_to_region(x: Tensor, mesh: DeviceMesh) -> Tensor:
    """Forward identity, backward all-reduce (Megatron's ``f``)."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _redistribute(x: Tensor, mesh: DeviceMesh, src: Placement, dst: Placement, grad: Placement | None = None) -> Tensor:
    """This rank's part of a tensor placed ``src`` -> its part placed ``dst`` (differentiable; the result's gradient
    is taken as placed ``grad``, default ``dst``). Partial -> Replicate: forward all-reduce, backward identity
    (Megatron's ``g``); Partial -> Shard(1): forward reduce-scatter along the sequence, backward all-gather;
    Replicate -> Shard(1): this rank's sequence slice, backward all-gather; Shard(1) -> Replicate: forward
    all-gather, backward slice (the grad is replicated) or, ``grad`` Partial, reduce-scatter of the partial grads."""
    grads = None if grad is None else [grad]
    return DTensor.from_local(x, mesh, [src], run_check=False).redistribute(mesh, [dst]).to_local(grad_placements=grads)


def _split_seq(x: Tensor, mesh: DeviceMesh) -> Tensor:
    """Replicated -> this rank's sequence slice: forward slice, backward all-gather."""
    if x.dim() < 2 or x.shape[1] % mesh.size() != 0:
        raise ValueError(
            f"sequence parallelism splits dim 1 of the input between the {mesh.size()} tensor-parallel ranks: "
            f"its length must be divisible by {mesh.size()}, got shape {tuple(x.shape)}"
        )
    return _redistribute(x, mesh, Replicate(), Shard(1))


# ---------------------------------------------------------------------------------------------------------------
# Showing a module's forward the local shards of DTensor parameters.


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _local_replicated(mesh: DeviceMesh) -> Callable[[Tensor], Tensor]:
    """A replicated parameter used on sequence-sharded activations: its local grad is partial -> all-reduce."""
    return lambda t: _copy_to_region(_local(t), mesh)


class _LocalView:
    """Forward pre-/post-hooks that shadow parameters (and plain attributes) of a module tree for one forward.

    ``shadows``: (owner module, attribute name, function of the current value -> value seen by the forward; a None
    parameter stays None). The shadow lives in the owner's instance ``__dict__`` (found before
    ``nn.Module.__getattr__``) and is removed after the forward, also on error, so ``parameters()``,
    ``state_dict()`` and optimizers only ever see the DTensor parameters. Parameters are read at forward time, so
    FSDP2's unsharded parameters are the ones shown when FSDP2 wraps the block.
    """

    def __init__(self, shadows: list[tuple[nn.Module, str, Callable]]):
        self.shadows = shadows
        self._saved: list[tuple[nn.Module, str, bool, Any]] = []

    def enter(self) -> None:
        saved = []
        for owner, name, fn in self.shadows:
            value = getattr(owner, name)
            saved.append((owner, name, name in owner.__dict__, owner.__dict__.get(name)))
            owner.__dict__[name] = None if value is None else fn(value)
        self._saved.append(saved)  # a stack: a module may be re-entered (activation checkpointing)

    def exit(self) -> bool:
        """Undo the latest :meth:`enter`; False when there is none to undo."""
        if not self._saved:
            return False
        for owner, name, had, old in reversed(self._saved.pop()):
            if had:
                owner.__dict__[name] = old
            else:
                owner.__dict__.pop(name, None)
        return True


def _install(
    module: nn.Module,
    view: _LocalView,
    prepare_args: Callable[[tuple, dict], tuple[tuple, dict]],
    finish_output: Callable[[Any], Any],
) -> nn.Module:
    def pre(mod, args, kwargs):
        args, kwargs = prepare_args(args, kwargs)
        view.enter()
        return args, kwargs

    def post(mod, args, kwargs, output):
        if not view.exit():  # the pre-hook itself raised (bad input): nothing to undo
            return output
        # output None: the forward raised (always_call); only the cleanup above was needed
        return output if output is None else finish_output(output)

    module.register_forward_pre_hook(pre, with_kwargs=True)
    # always_call: the shadow must go even when the forward raises
    module.register_forward_hook(post, with_kwargs=True, always_call=True)
    return module


def _check_divisible(what: str, n: int, tp: int, where: str) -> None:
    if n % tp != 0:
        raise ValueError(
            f"{where}: {what} ({n}) must be divisible by the tensor-parallel mesh size ({tp}) "
            f"to shard it between the ranks"
        )


# ---------------------------------------------------------------------------------------------------------------
# Parallel styles.


class GatedColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for a Linear whose output packs ``[gate; up]`` (gate first): the rows are sharded
    with ``_StridedShard(0, split_factor=2)``, so rank r holds ``[gate_r; up_r]`` — what a local ``chunk(2)``
    needs — while ``full_tensor()`` keeps the original order."""

    def _partition_linear_fn(self, name, module, device_mesh):
        for pname, param in module.named_parameters():
            dist_param = nn.Parameter(
                distribute_tensor(
                    param, device_mesh, [_StridedShard(0, split_factor=2)], src_data_rank=self.src_data_rank
                ),
                requires_grad=param.requires_grad,
            )
            module.register_parameter(pname, dist_param)


class _MegatronStyle(ParallelStyle):
    """What the FFN and attention styles share: the ``sequence_parallel`` option, the functional's view of the local
    shards and the row-sharded projection's output reduction (all-reduce, or reduce-scatter along the sequence)
    plus its bias, added once."""

    def __init__(self, *, sequence_parallel: bool = False) -> None:
        self.sequence_parallel = sequence_parallel

    @staticmethod
    def _view(cols: list[nn.Module], row: nn.Module, module: nn.Module, name: str, value: object) -> _LocalView:
        """What the functional sees: the local shards of the column-sharded projections ``cols`` and of the
        row-sharded ``row``'s weight, no bias of ``row`` (added once, after the reduction), ``module.name`` as
        ``value``."""
        shadows = [(p, n, _local) for p in cols for n in ("weight", "bias")]
        shadows += [(row, "weight", _local), (row, "bias", lambda _: None), (module, name, lambda _: value)]
        return _LocalView(shadows)

    def _reduce(self, out: Tensor, proj: nn.Module, mesh: DeviceMesh) -> Tensor:
        out = _redistribute(out, mesh, Partial(), Shard(1) if self.sequence_parallel else Replicate())
        # with sequence parallelism the bias meets only this rank's positions: its grad is partial
        bias_view = _local_replicated(mesh) if self.sequence_parallel else _local
        return out if proj.bias is None else out + bias_view(proj.bias)


class FFNParallel(_MegatronStyle):
    """Style for a :class:`~sublayer.nn.PositionWiseFFN` whose ``fc1``/``fc2`` are (or will be) column/row
    sharded: runs the functional on the local shards between the Megatron collectives.

    Args:
        sequence_parallel: the input arrives sequence-sharded (dim 1) and the output leaves so.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, PositionWiseFFN):
            raise TypeError(f"FFNParallel applies to a PositionWiseFFN, got {type(module).__name__}")
        mesh, sp = device_mesh, self.sequence_parallel
        # the output dropout too is applied once, after the reduction
        view = self._view([module.fc1], module.fc2, module, "output_dropout", 0.0)

        def prepare(args, kwargs):
            x = args[0] if args else kwargs.pop("x")
            x = _redistribute(x, mesh, Shard(1), Replicate(), Partial()) if sp else _copy_to_region(x, mesh)
            return (x, *args[1:]), kwargs

        def finish(out):
            return F.dropout(self._reduce(out, module.fc2, mesh), module.output_dropout, module.training)

        return _install(module, view, prepare, finish)


class AttentionParallel(_MegatronStyle):
    """Style for a :class:`~sublayer.nn.MultiHeadAttention` whose q/k/v are column- and ``out_proj`` row-sharded:
    the functional sees the local shards and ``n_heads / tp`` heads.

    Args:
        sequence_parallel: the query arrives sequence-sharded (dim 1) and the output leaves so; key/value
            given explicitly (cross-attention memory) are taken as replicated.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, MultiHeadAttention):
            raise TypeError(f"AttentionParallel applies to a MultiHeadAttention, got {type(module).__name__}")
        mesh, sp = device_mesh, self.sequence_parallel
        projs = [getattr(module, f"{p}_proj") for p in "qkv"]
        view = self._view(projs, module.out_proj, module, "n_heads", module.n_heads // mesh.size())

        def prepare(args, kwargs):
            args = list(args)
            q = args[0] if args else kwargs.pop("query")
            args[:1] = [_redistribute(q, mesh, Shard(1), Replicate(), Partial()) if sp else _copy_to_region(q, mesh)]
            for i, name in ((1, "key"), (2, "value")):
                if len(args) > i and args[i] is not None:
                    args[i] = _copy_to_region(args[i], mesh)
                elif kwargs.get(name) is not None:
                    kwargs[name] = _copy_to_region(kwargs[name], mesh)
            return tuple(args), kwargs

        def finish(output):
            out, weights = output
            out = self._reduce(out, module.out_proj, mesh)
            if weights is not None:
                if weights.dim() == 3:  # averaged over the local heads: the mean of equal-size groups
                    weights = DTensor.from_local(weights, mesh, [Partial("avg")], run_check=False)
                else:  # (B, H_local, T_q, T_k)
                    weights = DTensor.from_local(weights, mesh, [Shard(1)], run_check=False)
                weights = weights.redistribute(mesh, [Replicate()]).to_local()
            return out, weights

        return _install(module, view, prepare, finish)


class SequenceParallelNorm(ParallelStyle):
    """Sequence parallelism for a norm's replicated parameters: they become ``Replicate`` DTensors and the forward
    sees local tensors whose gradients (partial: each rank saw its own positions) are all-reduced.

    Used instead of ``torch``'s ``SequenceParallel`` because :class:`~sublayer.nn.AddNorm` reads its norm's
    weights rather than calling the norm, so hooks on the norm alone would not fire. Apply it to a
    :class:`LayerNorm`/:class:`RMSNorm` called directly, or to an :class:`AddNorm` (it shards the norm inside).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        norm = module.norm if isinstance(module, AddNorm) else module
        if not isinstance(norm, (LayerNorm, RMSNorm)):
            raise TypeError(
                f"SequenceParallelNorm applies to LayerNorm, RMSNorm or AddNorm, got {type(module).__name__}"
            )
        params = []
        for name, p in list(norm.named_parameters(recurse=False)):
            replicated = distribute_tensor(p.detach(), device_mesh, [Replicate()])
            norm.register_parameter(name, nn.Parameter(replicated, requires_grad=p.requires_grad))
            params.append((norm, name, _local_replicated(device_mesh)))
        return _install(module, _LocalView(params), lambda a, k: (a, k), lambda o: o)


class _SequenceRegion(ParallelStyle):
    """The boundary of a sequence-parallel region (a block or a stack of blocks): the first input (B, T, D) is
    split along T on entry and the output all-gathered on exit; everything else passes unchanged."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        mesh = device_mesh

        def prepare(args, kwargs):
            if args:
                return (_split_seq(args[0], mesh), *args[1:]), kwargs
            kwargs["x"] = _split_seq(kwargs["x"], mesh)
            return args, kwargs

        return _install(module, _LocalView([]), prepare, lambda out: _redistribute(out, mesh, Shard(1), Replicate()))


# ---------------------------------------------------------------------------------------------------------------
# Plans.

_STACKS = (TransformerEncoder, TransformerDecoder)
_BLOCKS = (EncoderBlock, DecoderBlock)


def _named(module: nn.Module, types) -> Iterator[tuple[str, nn.Module]]:
    return ((name, m) for name, m in module.named_modules() if isinstance(m, types))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_layer(m: nn.Module, parent: nn.Module | None) -> bool:
    """A block: EncoderBlock/DecoderBlock, or a layer of an nn.ModuleList that holds a MultiHeadAttention
    (model-specific blocks such as GPT-2's)."""
    if isinstance(m, _BLOCKS):
        return True
    return isinstance(parent, nn.ModuleList) and any(isinstance(x, MultiHeadAttention) for x in m.modules())


def _outermost(module: nn.Module, pick: Callable[[nn.Module, nn.Module | None], bool]) -> list[tuple[str, nn.Module]]:
    found: list[tuple[str, nn.Module]] = []

    def walk(name: str, m: nn.Module, parent: nn.Module | None) -> None:
        if pick(m, parent):
            found.append((name, m))
            return
        for child_name, child in m.named_children():
            walk(_join(name, child_name), child, m)

    walk("", module, None)
    return found


def tensor_parallel_plan(
    module: nn.Module, tp_size: int, *, sequence_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan for ``module``: fully qualified name -> style.

    Covers every :class:`~sublayer.nn.PositionWiseFFN` and :class:`~sublayer.nn.MultiHeadAttention` in the tree
    (so blocks, stacks, and the models built from them: Transformer, GPT2, Bert, Llama); embeddings and heads stay
    replicated. With ``sequence_parallel`` the outermost blocks/stacks become sequence-parallel regions and the
    norms inside them get :class:`SequenceParallelNorm`.

    Raises:
        ValueError: a ``n_heads``, ``n_kv_heads`` or ``d_ff`` not divisible by ``tp_size`` (naming both numbers
            and the module);
            an unmaterialised lazy FFN; no attention or FFN to shard; sequence parallelism without a block.
    """
    plan: dict[str, ParallelStyle] = {}
    sp = sequence_parallel
    # the outermost stacks/blocks (by name): each becomes one sequence-parallel region
    regions = [n for n, _ in _outermost(module, lambda m, p: isinstance(m, _STACKS) or _is_layer(m, p))] if sp else []
    if sp and not regions:
        raise ValueError(
            "sequence_parallel=True needs an EncoderBlock/DecoderBlock or a stack of them to split the sequence in; "
            f"got {type(module).__name__}"
        )

    def in_region(name: str) -> bool:
        return any(r == "" or name == r or name.startswith(r + ".") for r in regions)

    for name, ffn in _named(module, PositionWiseFFN):
        where = f"{type(ffn).__name__} {name or '<root>'}"
        if isinstance(ffn.fc1, nn.LazyLinear) or isinstance(ffn.fc1.weight, nn.parameter.UninitializedParameter):
            raise ValueError(f"{where}: fc1 is a LazyLinear not yet materialised; run one forward before sharding")
        _check_divisible("d_ff", ffn.d_ff, tp_size, where)
        plan[_join(name, "fc1")] = GatedColwiseParallel() if ffn.gated else ColwiseParallel()
        plan[_join(name, "fc2")] = RowwiseParallel()
        plan[name] = FFNParallel(sequence_parallel=sp and in_region(name))
    for name, attn in _named(module, MultiHeadAttention):
        where = f"{type(attn).__name__} {name or '<root>'}"
        _check_divisible("n_heads", attn.n_heads, tp_size, where)
        _check_divisible("n_kv_heads", attn.n_kv_heads, tp_size, where)  # grouped-query: kv heads sharded too
        for p in "qkv":
            plan[_join(name, f"{p}_proj")] = ColwiseParallel()
        plan[_join(name, "out_proj")] = RowwiseParallel()
        plan[name] = AttentionParallel(sequence_parallel=sp and in_region(name))
    if not plan:
        raise ValueError(
            f"tensor_parallel found no MultiHeadAttention or PositionWiseFFN to shard in {type(module).__name__}"
        )
    if sp:
        addnorm_children = {_join(n, "norm") for n, _ in _named(module, AddNorm)}
        for name, m in _named(module, (AddNorm, LayerNorm, RMSNorm)):
            if in_region(name) and name not in addnorm_children:
                plan[name] = SequenceParallelNorm()
        for r in regions:
            plan[r] = _SequenceRegion()
    return plan


def tensor_parallel(module: nn.Module, mesh: DeviceMesh, *, sequence_parallel: bool = False) -> nn.Module:
    """Shard ``module`` in place for tensor parallelism over the 1-D ``mesh`` (Megatron layout) and return it.

    Works on :class:`~sublayer.nn.PositionWiseFFN`, :class:`~sublayer.nn.MultiHeadAttention`,
    :class:`~sublayer.nn.EncoderBlock`, :class:`~sublayer.nn.DecoderBlock`, the stacks, and the models built from
    them. Outputs (and the gradients of the full parameters, ``param.grad.full_tensor()``) equal the unsharded
    module's. Inputs are replicated: every rank passes the same tensors (seed identically) and gets the same
    output. Parameters are taken from rank 0 (``src_data_rank=0``).

    Args:
        module: the model; its parameters must be on ``mesh``'s device type and materialised.
        mesh: a 1-D :class:`DeviceMesh` (for 2-D FSDP × TP pass ``mesh["tp"]``).
        sequence_parallel: also split the residual stream along the sequence inside each block / stack
            (saves activation memory; sequence lengths must divide by the mesh size; no incremental decoding).

    Returns:
        ``module`` (sharded in place).

    Raises:
        TypeError: ``mesh`` not a DeviceMesh. ValueError: see :func:`tensor_parallel_plan`; a 2-D mesh; a module
        already sharded.
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"mesh must be 1-D (the tensor-parallel dimension; pass mesh['tp'] of a 2-D mesh), got "
            f"{mesh.ndim}-D mesh of shape {tuple(mesh.shape)}"
        )
    if getattr(module, _TP_MARK, False):
        raise ValueError(f"{type(module).__name__} is already tensor-parallel; shard it once")
    plan = tensor_parallel_plan(module, mesh.size(), sequence_parallel=sequence_parallel)
    parallelize_module(module, mesh, plan)  # key "" = the module itself (a bare FFN, attention or block)
    setattr(module, _TP_MARK, True)
    return module


# ---------------------------------------------------------------------------------------------------------------
# FSDP2.


def full_tensor(t: Tensor) -> Tensor:
    """The whole value of ``t`` as a plain tensor, on every rank (a collective when ``t`` is a DTensor): ``t`` itself
    when it is not a DTensor, its ``full_tensor()`` otherwise, except a strided shard on a 1-D mesh (a gated FFN's
    ``fc1`` weight, bias or their gradients under :func:`tensor_parallel`), gathered here (rank r holds ``[gate_r;
    up_r]``; the result is ``[gate; up]``), which ``full_tensor()`` refuses on some torch releases (2.11). Detached."""
    if not isinstance(t, DTensor):
        return t.detach()
    (place, *more) = t.placements
    if more or not isinstance(place, _StridedShard):
        return t.full_tensor().detach()
    mesh, dim, sf = t.device_mesh, place.dim, place.split_factor
    local = t.to_local().detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(mesh.size())]
    torch.distributed.all_gather(parts, local, group=mesh.get_group())
    pieces = [p.chunk(sf, dim) for p in parts]  # rank r: its piece of each of the sf packed blocks
    return torch.cat([rank[i] for i in range(sf) for rank in pieces], dim)


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` with every DTensor gathered by :func:`full_tensor`: plain tensors that an unsharded
    model loads (then ``save_pretrained``). A collective: call it on every rank."""
    return {k: full_tensor(v) for k, v in model.state_dict().items()}


def fully_shard(model: nn.Module, mesh: DeviceMesh | None = None, **kwargs: Any) -> nn.Module:
    """FSDP2 (``torch.distributed.fsdp.fully_shard``) on every block, then on the root; returns ``model``.

    Data parallel with sharded parameters, gradients and optimizer state: each rank feeds its own batch slice;
    gradients are averaged across the mesh. Build the optimizer after this call. A model's ``loss`` and
    ``generate`` methods (GPT2, Llama) are registered as forward methods, so that they too gather the root's
    parameters (embeddings, final norm, head) before they run.

    Args:
        model: the model (a block, a stack or a full model). mesh: a 1-D DeviceMesh (None: the default world).
        **kwargs: passed to ``torch.distributed.fsdp.fully_shard`` (``reshard_after_forward``, ``mp_policy``...).

    Returns:
        ``model``, now an ``FSDPModule``.

    Raises:
        TypeError: ``mesh`` neither None nor a DeviceMesh.
    """
    from torch.distributed.fsdp import fully_shard as _fully_shard
    from torch.distributed.fsdp import register_fsdp_forward_method

    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed DeviceMesh or None, got {type(mesh).__name__}")
    # the outermost blocks (see _is_layer), not counting the model itself
    for _, unit in _outermost(model, lambda m, parent: parent is not None and _is_layer(m, parent)):
        _fully_shard(unit, mesh=mesh, **kwargs)
    _fully_shard(model, mesh=mesh, **kwargs)
    for method in ("loss", "generate"):
        if callable(getattr(model, method, None)):
            register_fsdp_forward_method(model, method)
    return model


# ---------------------------------------------------------------------------------------------------------------
# Launching.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_entry(rank: int, fn: Callable, nproc: int, port: int | None, backend: str, timeout, args: tuple) -> None:
    """One rank: ``fn(rank, nproc, *args)`` in the default process group, initialised from the environment (a
    spawned rank, ``port`` not None, first sets it for a rendezvous on 127.0.0.1:``port``)."""
    import torch.distributed as dist

    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nproc),
                          LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc))  # fmt: skip
    dist.init_process_group(backend, timeout=timeout)
    try:
        fn(rank, nproc, *args)
    finally:
        dist.destroy_process_group()


def launch(
    fn: Callable[..., Any], nproc: int, *args: Any, backend: str = "gloo", timeout_s: float | None = None
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes joined in a default process group.

    - Started by ``torchrun`` (``RANK``/``WORLD_SIZE`` in the environment, any number of machines): this process
      is one rank; the group is initialised from the environment (``env://``) and ``fn`` runs here.
    - Otherwise ``nproc`` > 1: spawns ``nproc`` local processes (``torch.multiprocessing``, rendezvous on
      127.0.0.1 at a free port) and waits for all; an exception in any of them is raised here.
    - Otherwise (``nproc`` == 1): ``fn(0, 1, *args)`` in this process, without a process group.

    ``fn`` must be a module-level function (it is pickled for the spawned processes). ``timeout_s``: how long a
    collective may wait for the other ranks (None: torch's default).

    Raises:
        ValueError: ``nproc`` < 1, or under ``torchrun`` a ``nproc`` other than 1 or ``WORLD_SIZE``.
    """
    import torch.multiprocessing as mp

    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be an int >= 1, got {nproc!r}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if nproc not in (1, world):
            raise ValueError(
                f"under torchrun the process count comes from torchrun (WORLD_SIZE={world}); got nproc={nproc}"
            )
        _launch_entry(rank, fn, world, None, backend, timeout, args)
        return
    if nproc == 1:
        fn(0, 1, *args)
        return
    mp.spawn(_launch_entry, args=(fn, nproc, _free_port(), backend, timeout, args), nprocs=nproc, join=True)
