"""sublayer.parallel: tensor parallelism (DTensor plans) and FSDP2, on CPU.

- 2 real gloo processes (spawned once for the module; tests/_dist_worker.py holds the scenarios): sharded forward
  and backward equal one process's (default fp32 tolerances) for an EncoderBlock, a DecoderBlock, GPT-2 loaded
  from an HF checkpoint, the Transformer and BERT; FSDP2 training losses equal one process's.
- the ``fake`` backend: the plans' shard shapes for 8 ranks, in this process.
- bad input: clear errors.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from sublayer.models.gpt2 import GPT2, GPT2Config
from sublayer.nn import DecoderBlock, EncoderBlock, MultiHeadAttention, PositionWiseFFN, TransformerEncoder
from sublayer.parallel import fully_shard, launch, tensor_parallel, tensor_parallel_plan

from . import _dist_worker

WORLD = 2


@pytest.fixture(scope="module")
def hf_gpt2_dir(tmp_path_factory):
    """A tiny random HF GPT2LMHeadModel saved as safetensors, with its logits for fixed ids (nothing downloaded)."""
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("hf_gpt2")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=19, n_positions=16, n_embd=12, n_layer=2, n_head=2, bos_token_id=18, eos_token_id=18,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    hf.save_pretrained(d, safe_serialization=True)
    ids = torch.randint(0, 19, (3, 6))
    with torch.no_grad():
        torch.save(hf(ids).logits, d / "logits.pt")
    torch.save(ids, d / "ids.pt")
    return d


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory, hf_gpt2_dir):
    """Spawn 2 gloo processes once (``sublayer.parallel.launch``): {scenario: [failure text or None, per rank]}."""
    out = tmp_path_factory.mktemp("dist")
    with pytest.MonkeyPatch.context() as mp:
        for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):  # not under torchrun: spawn
            mp.delenv(var, raising=False)
        launch(_dist_worker.worker, WORLD, str(out), str(hf_gpt2_dir), timeout_s=120)
    per_rank = [json.loads((out / f"results_{r}.json").read_text()) for r in range(WORLD)]
    return {name: [res.get(name, "not run") for res in per_rank] for name in _dist_worker.SCENARIOS}


@pytest.mark.parametrize("scenario", list(_dist_worker.SCENARIOS))
def test_two_processes(dist_results, scenario):
    failures = [f"rank {r}:\n{err}" for r, err in enumerate(dist_results[scenario]) if err is not None]
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------------------------------------
# One process, the fake backend: 8 ranks' shapes (values meaningless).


@pytest.fixture
def fake_mesh():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.fail("a process group is already initialised in the test process")
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8, timeout=timedelta(seconds=30))
    try:
        yield init_device_mesh("cpu", (8,))
    finally:
        dist.destroy_process_group()


def _local_shape(p: torch.Tensor) -> tuple[int, ...]:
    assert isinstance(p, DTensor), type(p)
    return tuple(p.to_local().shape)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_fake_backend_gpt2_plan_shapes(fake_mesh, sequence_parallel):
    cfg = GPT2Config(vocab_size=23, max_positions=16, d_model=32, n_layers=2, n_heads=8, d_ff=48,
                     dropout=0.0, embd_dropout=0.0, attn_dropout=0.0)  # fmt: skip
    model = tensor_parallel(GPT2(cfg), fake_mesh, sequence_parallel=sequence_parallel)
    for block in model.blocks:
        a, f = block.self_attn, block.ffn
        for lin in (a.q_proj, a.k_proj, a.v_proj):
            assert _local_shape(lin.weight) == (4, 32) and _local_shape(lin.bias) == (4,)
        assert _local_shape(a.out_proj.weight) == (32, 4) and _local_shape(a.out_proj.bias) == (32,)
        assert _local_shape(f.fc1.weight) == (6, 32) and _local_shape(f.fc2.weight) == (32, 6)
        norm = block.attn_residual.norm.weight
        assert isinstance(norm, DTensor) == sequence_parallel
    assert not isinstance(model.wte.weight, DTensor)  # embeddings and the tied head stay replicated
    assert model.lm_head.weight is model.wte.weight
    logits = model(torch.randint(0, 23, (2, 8)))
    assert logits.shape == (2, 8, 23) and not isinstance(logits, DTensor)


def test_fake_backend_gated_ffn_and_decoder(fake_mesh):
    block = tensor_parallel(DecoderBlock(16, 8, 24, activation="swiglu"), fake_mesh)
    assert _local_shape(block.ffn.fc1.weight) == (6, 16)  # [gate_r; up_r]: 3 + 3 rows
    assert _local_shape(block.ffn.fc2.weight) == (16, 3)
    assert _local_shape(block.cross_attn.k_proj.weight) == (2, 16)
    out = block(torch.randn(2, 5, 16), torch.randn(2, 3, 16))
    assert out.shape == (2, 5, 16)


def test_fake_backend_llama_plan_shards_kv_heads(fake_mesh):
    from sublayer.models import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=23, d_model=32, n_layers=2, n_heads=16, n_kv_heads=8, head_dim=4, d_ff=40)
    model = tensor_parallel(Llama(cfg), fake_mesh)
    for block in model.blocks:
        a, f = block.self_attn, block.ffn
        assert _local_shape(a.q_proj.weight) == (8, 32)  # 2 query heads of 4
        assert _local_shape(a.k_proj.weight) == _local_shape(a.v_proj.weight) == (4, 32)  # 1 kv head of 4
        assert _local_shape(a.out_proj.weight) == (32, 8)
        assert _local_shape(f.fc1.weight) == (10, 32) and _local_shape(f.fc2.weight) == (32, 5)
    logits = model(torch.randint(0, 23, (2, 8)))
    assert logits.shape == (2, 8, 23) and not isinstance(logits, DTensor)
    cfg = LlamaConfig(vocab_size=23, d_model=32, n_layers=1, n_heads=16, n_kv_heads=2, head_dim=4, d_ff=40)
    with pytest.raises(ValueError, match=r"self_attn: n_kv_heads \(2\) must be divisible by the tensor-parallel mesh"):
        tensor_parallel(Llama(cfg), fake_mesh)


def test_plan_names_every_projection():
    plan = tensor_parallel_plan(TransformerEncoder(EncoderBlock(8, 2, 6), 2), 2)
    cls = {k: type(v).__name__ for k, v in plan.items()}
    for i in range(2):
        p = f"layers.{i}"
        assert cls[f"{p}.self_attn.q_proj"] == cls[f"{p}.self_attn.v_proj"] == "ColwiseParallel"
        assert cls[f"{p}.self_attn.out_proj"] == cls[f"{p}.ffn.fc2"] == "RowwiseParallel"
        assert cls[f"{p}.ffn.fc1"] == "ColwiseParallel"
        assert cls[f"{p}.self_attn"] == "AttentionParallel" and cls[f"{p}.ffn"] == "FFNParallel"
    sp = tensor_parallel_plan(TransformerEncoder(EncoderBlock(8, 2, 6, norm_first=True), 2), 2, sequence_parallel=True)
    assert type(sp[""]).__name__ == "_SequenceRegion"
    assert type(sp["layers.0.attn_residual.norm"]).__name__ == "SequenceParallelNorm"
    assert type(sp["norm"]).__name__ == "SequenceParallelNorm"  # the stack's final norm


# ----------------------------------------------------------------------------------------------------------------
# Bad input.


def test_indivisible_heads_and_hidden_name_both_numbers(fake_mesh):
    with pytest.raises(ValueError, match=r"n_heads \(4\) must be divisible by the tensor-parallel mesh size \(8\)"):
        tensor_parallel(EncoderBlock(8, 4, 16), fake_mesh)
    with pytest.raises(ValueError, match=r"d_ff \(12\) must be divisible by the tensor-parallel mesh size \(8\)"):
        tensor_parallel(EncoderBlock(16, 8, 12), fake_mesh)
    with pytest.raises(ValueError, match=r"ffn: d_ff \(20\)"):
        cfg = GPT2Config(vocab_size=5, max_positions=4, d_model=8, n_layers=1, n_heads=2, d_ff=20)
        tensor_parallel_plan(GPT2(cfg), 8)


def test_sequence_length_must_divide(fake_mesh):
    block = tensor_parallel(EncoderBlock(16, 8, 8), fake_mesh, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"divisible by 8, got shape \(2, 5, 16\)"):
        block(torch.randn(2, 5, 16))


def test_bad_mesh_and_modules(fake_mesh):
    with pytest.raises(TypeError, match="mesh must be a torch.distributed DeviceMesh, got str"):
        tensor_parallel(EncoderBlock(16, 8, 8), "cpu")
    mesh2d = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"mesh must be 1-D .* got 2-D mesh of shape \(2, 4\)"):
        tensor_parallel(EncoderBlock(16, 8, 8), mesh2d)
    with pytest.raises(ValueError, match="found no MultiHeadAttention or PositionWiseFFN to shard in Linear"):
        tensor_parallel(torch.nn.Linear(4, 4), fake_mesh)
    with pytest.raises(ValueError, match="LazyLinear not yet materialised"):
        tensor_parallel(PositionWiseFFN(None, 8, d_out=4), fake_mesh)
    with pytest.raises(ValueError, match="sequence_parallel=True needs an EncoderBlock"):
        tensor_parallel(MultiHeadAttention(16, 8), fake_mesh, sequence_parallel=True)
    block = tensor_parallel(EncoderBlock(16, 8, 8), fake_mesh)
    with pytest.raises(ValueError, match="already tensor-parallel"):
        tensor_parallel(block, fake_mesh)
    with pytest.raises(TypeError, match="mesh must be a torch.distributed DeviceMesh or None, got int"):
        fully_shard(EncoderBlock(16, 8, 8), 3)


def test_launch_one_process_runs_inline_and_checks_nproc(monkeypatch):
    from sublayer.parallel import launch

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    seen = []
    launch(lambda rank, world, tag: seen.append((rank, world, tag)), 1, "x")
    assert seen == [(0, 1, "x")] and not dist.is_initialized()
    for bad in (0, -2, True, 1.5):
        with pytest.raises(ValueError, match=r"nproc must be an int >= 1, got"):
            launch(print, bad)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ValueError, match=r"under torchrun .* \(WORLD_SIZE=2\); got nproc=3"):
        launch(print, 3)


# ----------------------------------------------------------------------------------------------------------------
# sublayer demo --nproc N (its training equivalence runs in the 2 processes above: scenario demo_ddp).


def test_demo_cli_nproc_checks(monkeypatch, capsys, tmp_path):
    import sys

    from sublayer import cli

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["sublayer", "demo", "--out", str(tmp_path / "o"), *args])
        with pytest.raises(SystemExit) as e:
            cli.main()
        return e.value.code, capsys.readouterr().err

    code, err = run("--nproc", "2", "--batch-size", "9")
    assert code == 2 and err == "error: --nproc must be >= 1 and divide --batch-size (9), got 2\n"
    code, err = run("--nproc", "0")
    assert code == 2 and err == "error: --nproc must be >= 1 and divide --batch-size (96), got 0\n"
    assert not (tmp_path / "o").exists()


def test_a_hook_on_a_sharded_linear_is_refused_by_name(fake_mesh):
    """The parent's style multiplies the local shards directly: a user's hook on the sharded linear could not run,
    so it is refused (torch's own tensor-parallel hooks on it do not count)."""
    x = torch.randn(2, 3, 32)
    tensor_parallel(PositionWiseFFN(32, 48), fake_mesh)(x)  # the plan's hooks alone: runs
    ffn = tensor_parallel(PositionWiseFFN(32, 48), fake_mesh)
    ffn.fc2.register_forward_hook(lambda m, a, o: None)
    with pytest.raises(ValueError, match="a hook on Linear cannot run: its parameters are tensor-parallel shards"):
        ffn(x)
