"""Scenarios run on each of 2 gloo processes spawned once by tests/test_parallel.py (start-up dominates, so one
spawn serves them all). Every scenario compares the sharded run with the unsharded module on the same rank and records
``None`` (passed) or the failure text; rank r writes ``results_{r}.json`` into the output folder."""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

from sublayer.models import padding_free
from sublayer.nn import DecoderBlock, EncoderBlock, PositionWiseFFN
from sublayer.parallel import full_state_dict, full_tensor, fully_shard, tensor_parallel

B, T, S, D, H, F = 3, 4, 6, 12, 2, 10  # small dims; T, S even (sequence parallelism over 2 ranks)


def _full(t):
    return None if t is None else full_tensor(t)  # DTensor.full_tensor() refuses a strided shard on torch 2.11


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(t.is_floating_point())


def compare_fwd_bwd(ref, tp, inputs, kwargs=None, *, seed=1):
    """Run ref and tp on copies of inputs, backprop the same random cotangent; compare outputs, input grads and
    every parameter grad (gathered to full)."""
    kwargs = kwargs or {}
    a = [_leaf(t) for t in inputs]
    b = [_leaf(t) for t in inputs]
    out_r, out_t = ref(*a, **kwargs), tp(*b, **kwargs)
    assert not isinstance(out_t, DTensor), "tensor_parallel output must be a plain (replicated) tensor"
    torch.manual_seed(seed)
    g = torch.randn_like(out_r)
    out_r.backward(g)
    out_t.backward(g)
    assert_close(out_t, out_r)
    for x, y in zip(b, a):
        if y.grad is not None:
            assert_close(x.grad, y.grad)
    ref_p = dict(ref.named_parameters())
    tp_p = dict(tp.named_parameters())
    assert ref_p.keys() == tp_p.keys(), (sorted(ref_p), sorted(tp_p))
    for name, p in tp_p.items():
        # Parameter gradients sum over every token, and the sharded model sums in another order (partial sums
        # all-reduced, other kernels on DTensors): float32 rounding then scales with the gradient's magnitude
        # (embedding rows reach ~30 here), so the absolute tolerance is the default's relative to that magnitude.
        # A wrongly sharded weight is off by O(1), far outside it.
        want = ref_p[name].grad
        atol = 1e-5 * max(1.0, want.abs().max().item() if want is not None else 0.0)
        assert_close(_full(p.grad), want, rtol=1.3e-6, atol=atol, msg=lambda m, name=name: f"grad of {name}: {m}")
    return tp


def randomized(module):
    """Random values in every parameter (biases are zero at init: a bias sharded wrongly would go unseen)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return module


def sharded_copy(ref, mesh, **kw):
    return tensor_parallel(copy.deepcopy(ref), mesh, **kw)


def scenario_encoder_block(mesh):
    torch.manual_seed(0)
    x = torch.randn(B, T, D)
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[0, -1] = True
    for kw in ({}, {"norm_first": True, "activation": "swiglu", "norm": "rms"}):
        ref = randomized(EncoderBlock(D, H, F, **kw))
        tp = compare_fwd_bwd(ref, sharded_copy(ref, mesh), [x], {"key_padding_mask": kpm})
        # the sharded parameters are DTensors holding the original values (gated fc1: original row order)
        w = tp.ffn.fc1.weight
        assert isinstance(w, DTensor) and w.to_local().shape == (ref.ffn.fc1.weight.shape[0] // 2, D)
        assert_close(full_tensor(w), ref.ffn.fc1.weight)
        if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13):  # torch's own gather agrees there
            assert_close(w.full_tensor(), ref.ffn.fc1.weight)
        full = full_state_dict(tp)  # plain tensors an unsharded model loads
        assert full.keys() == ref.state_dict().keys() and not any(isinstance(v, DTensor) for v in full.values())
        for k, v in ref.state_dict().items():
            assert_close(full[k], v, msg=lambda m, k=k: f"full_state_dict {k}: {m}")
        fresh = EncoderBlock(D, H, F, **kw)
        fresh.load_state_dict(full)
        assert_close(fresh(x, key_padding_mask=kpm), ref(x, key_padding_mask=kpm))
        assert tp.self_attn.n_heads == H  # the local head count is shown to the forward only


def scenario_decoder_block(mesh):
    torch.manual_seed(0)
    ref = randomized(DecoderBlock(D, H, F, memory_dim=7))
    x, memory = torch.randn(B, T, D), torch.randn(B, S, 7)
    mkpm = torch.zeros(B, S, dtype=torch.bool)
    mkpm[1, -2:] = True
    compare_fwd_bwd(ref, sharded_copy(ref, mesh), [x, memory], {"memory_key_padding_mask": mkpm})


def scenario_sequence_parallel(mesh):
    torch.manual_seed(0)
    x, memory = torch.randn(B, T, D), torch.randn(B, S, D)
    for block, inputs in (
        (EncoderBlock(D, H, F), [x]),
        (EncoderBlock(D, H, F, norm_first=True, activation="geglu"), [x]),
        (DecoderBlock(D, H, F, norm_first=True), [x, memory]),
    ):
        randomized(block)
        compare_fwd_bwd(block, sharded_copy(block, mesh, sequence_parallel=True), inputs)


def scenario_attention_weights(mesh):
    from sublayer.nn import MultiHeadAttention

    torch.manual_seed(0)
    ref = randomized(MultiHeadAttention(D, H))
    tp = sharded_copy(ref, mesh)
    x = torch.randn(B, T, D)
    for avg in (True, False):
        out_r, w_r = ref(x, need_weights=True, average_attn_weights=avg)
        out_t, w_t = tp(x, need_weights=True, average_attn_weights=avg)
        assert_close(out_t, out_r)
        assert_close(w_t, w_r)


def scenario_ffn_bare(mesh):
    torch.manual_seed(0)
    x = torch.randn(B, T, D)
    ref = randomized(PositionWiseFFN(D, F, activation="reglu"))
    compare_fwd_bwd(ref, sharded_copy(ref, mesh), [x])


def scenario_gpt2_from_hf(mesh, hf_dir):
    from sublayer.models.gpt2 import GPT2

    ref = GPT2.from_pretrained(hf_dir)
    torch.manual_seed(0)
    ids = torch.randint(0, ref.config.vocab_size, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[2, :1] = 0  # left padding
    hf_logits = torch.load(os.path.join(hf_dir, "logits.pt"), weights_only=True)
    hf_ids = torch.load(os.path.join(hf_dir, "ids.pt"), weights_only=True)
    for sp in (False, True):
        tp = sharded_copy(ref, mesh, sequence_parallel=sp)
        ref.zero_grad()
        with padding_free.disabled():  # a sharded model keeps the padded path (logits at padding too): compare alike
            compare_fwd_bwd(ref, tp, [ids], {"attention_mask": mask})
        with torch.no_grad():  # and the sharded model still gives the HF model's logits
            assert_close(tp(hf_ids), hf_logits)
        if not sp:  # q/k/v each sharded by whole heads: rank r holds heads [r·H/2, (r+1)·H/2)
            n = ref.config.d_model // 2
            assert tp.blocks[0].self_attn.q_proj.weight.to_local().shape == (n, ref.config.d_model)
            # KV-cache decoding with local heads: the same tokens
            prompt = hf_ids[:, :3]
            assert torch.equal(tp.generate(prompt, 5), ref.generate(prompt, 5))
    # training: 2 AdamW steps (DTensor and plain parameters in one optimizer) give the unsharded losses
    tp = sharded_copy(ref, mesh)
    losses = {}
    for name, model in (("ref", ref), ("tp", tp)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[name] = []
        for _ in range(2):
            logits = model(ids)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[name].append(loss.detach())
    assert_close(torch.stack(losses["tp"]), torch.stack(losses["ref"]))


def scenario_llama_gqa(mesh):
    """A Llama with grouped-query attention (4 query heads, 2 kv heads: one group per rank), rotary positions and
    a gated FFN: sharded forward/backward, sequence parallel too, and KV-cache decoding equal one process's."""
    from sublayer.models import Llama, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=19, d_model=D, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=F,
                      attention_bias=True, model_type="qwen2")  # fmt: skip
    ref = randomized(Llama(cfg))
    ids = torch.randint(0, 19, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[2, :1] = 0
    for sp in (False, True):
        ref.zero_grad()
        compare_fwd_bwd(ref, sharded_copy(ref, mesh, sequence_parallel=sp), [ids], {"attention_mask": mask})
    tp = sharded_copy(ref, mesh)
    assert tp.blocks[0].self_attn.k_proj.weight.to_local().shape == (4, D)  # one kv head of 4 per rank
    assert torch.equal(tp.generate(ids[:, :2], 4), ref.generate(ids[:, :2], 4))
    # FSDP2 (every block, then the root; Llama.loss registered as a forward method): each rank's half batch,
    # 2 SGD steps = the full batch
    x = torch.randint(0, 19, (4, T))
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = slice(rank * 4 // world, (rank + 1) * 4 // world)
    fsdp = fully_shard(copy.deepcopy(ref), mesh)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_f = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    for _ in range(2):
        loss = ref.loss(x)
        opt_r.zero_grad()
        loss.backward()
        opt_r.step()
        local = fsdp.loss(x[mine])
        opt_f.zero_grad()
        local.backward()
        opt_f.step()
        total = local.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        assert_close(total, loss.detach())
    for (n, p), q in zip(fsdp.named_parameters(), ref.parameters()):
        assert_close(p.full_tensor(), q, msg=lambda m, n=n: f"{n} after 2 steps: {m}")


def scenario_transformer_and_bert(mesh):
    from sublayer.models.bert import Bert, BertConfig
    from sublayer.models.transformer import Transformer

    torch.manual_seed(0)
    ref = Transformer(
        src_vocab_size=11, tgt_vocab_size=13, d_model=D, n_heads=H, d_ff=F, n_layers=2, dropout=0.0, max_len=16
    )
    src, tgt = torch.randint(0, 11, (B, S)), torch.randint(0, 13, (B, T))
    for sp in (False, True):
        ref.zero_grad()
        compare_fwd_bwd(ref, sharded_copy(ref, mesh, sequence_parallel=sp), [src, tgt])
    bert_cfg = BertConfig(
        vocab_size=17, d_model=D, n_heads=H, d_ff=F, n_layers=2, max_positions=16, dropout=0.0, attn_dropout=0.0
    )
    bert = Bert(bert_cfg)
    ids = torch.randint(0, 17, (B, T))
    compare_fwd_bwd(bert, sharded_copy(bert, mesh), [ids])


def scenario_fsdp(mesh):
    """FSDP2: each rank trains on its half of the batch; 3 SGD steps give the one-process full-batch losses."""
    from sublayer.nn import TransformerEncoder

    torch.manual_seed(0)
    ref = torch.nn.Sequential(TransformerEncoder(EncoderBlock(D, H, F, norm_first=True), 2), torch.nn.Linear(D, 5))
    model = fully_shard(copy.deepcopy(ref), mesh)
    assert isinstance(next(model.parameters()), DTensor)
    x, y = torch.randn(4, T, D), torch.randint(0, 5, (4, T))
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = slice(rank * 4 // world, (rank + 1) * 4 // world)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt_f = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_losses, fsdp_losses = [], []
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        opt_r.zero_grad()
        loss.backward()
        opt_r.step()
        ref_losses.append(loss.detach())
        local = torch.nn.functional.cross_entropy(model(x[mine]).flatten(0, 1), y[mine].flatten())
        opt_f.zero_grad()
        local.backward()  # FSDP2 averages the gradients over the ranks
        opt_f.step()
        global_loss = local.detach().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        fsdp_losses.append(global_loss)
    assert_close(torch.stack(fsdp_losses), torch.stack(ref_losses))
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.full_tensor(), q, msg=lambda m, n=n: f"{n} after 3 steps: {m}")


SCENARIOS = {
    "encoder_block": scenario_encoder_block,
    "decoder_block": scenario_decoder_block,
    "sequence_parallel": scenario_sequence_parallel,
    "attention_weights": scenario_attention_weights,
    "ffn_bare": scenario_ffn_bare,
    "gpt2_from_hf": scenario_gpt2_from_hf,
    "transformer_and_bert": scenario_transformer_and_bert,
    "llama_gqa": scenario_llama_gqa,
    "fsdp": scenario_fsdp,
}


def scenario_demo_ddp(mesh, out_dir):
    """``sublayer demo --nproc 2``'s rank function: each rank half of every batch, DDP-averaged gradients —
    the same weights and validation loss as one process on whole batches (run here on rank 0)."""
    from safetensors.torch import load_file

    from sublayer.demo import DemoConfig, train
    from sublayer.demo.training import run_rank

    two, one = Path(out_dir, "demo_two"), Path(out_dir, "demo_one")
    run_rank(train, dist.get_rank(), dist.get_world_size(), DemoConfig(out=str(two), **DEMO_TINY))
    if dist.get_rank() != 0:
        return
    ref = train(DemoConfig(out=str(one), **DEMO_TINY))
    got = json.loads((two / "metrics.json").read_text())
    assert got["steps"] == ref["steps"] == DEMO_TINY["steps"]
    w1, w2 = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert w1.keys() == w2.keys()
    for k in w1:  # 3 AdamW steps; the gradients differ only in summation order
        if k.endswith("k_proj.bias"):
            # a key bias has gradient exactly 0 (softmax is shift-invariant per query): both runs hold rounding
            # noise there, which Adam scales up to ±lr steps — not comparable, and irrelevant to the outputs
            continue
        assert_close(w2[k], w1[k], msg=lambda m, k=k: f"{k}: {m}")
    assert_close(got["final_val_loss"], ref["final_val_loss"])
    assert got["exact_match"] == ref["exact_match"]


DEMO_TINY = {"batch_size": 8, "d_model": 16, "n_heads": 2, "d_ff": 24, "n_layers": 1, "eval_every": 1, "n_val": 16,
             "n_test": 20, "quiet": True, "threads": 1, "warmup": 2, "steps": 3}  # fmt: skip

SCENARIOS["demo_ddp"] = scenario_demo_ddp


def scenario_train_ddp(mesh, out_dir):
    """``sublayer train --nproc 2``'s rank function: each rank half of every global batch's rows, DDP-averaged
    gradients — the weights and held-out loss of one process on whole batches (run here on rank 0)."""
    from safetensors.torch import load_file

    from sublayer.train import TrainConfig, rank_main, train

    kw = {"model": "builtin:gpt2-tiny", "data": "builtin:numbers", "steps": 3, "batch_size": 4, "seq_len": 32,
          "eval_every": 3, "quiet": True, "threads": 1}  # fmt: skip
    two, one = Path(out_dir, "train_two"), Path(out_dir, "train_one")
    rank_main(dist.get_rank(), dist.get_world_size(), TrainConfig(out=str(two), **kw))
    if dist.get_rank() != 0:
        return
    ref = train(TrainConfig(out=str(one), **kw))
    got = json.loads((two / "metrics.json").read_text())
    assert got["steps"] == ref["steps"] == 3
    w1, w2 = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert w1.keys() == w2.keys()
    for k in w1:  # the gradients differ only in summation order (key biases: see scenario_demo_ddp)
        if not k.endswith("c_attn.bias"):
            assert_close(w2[k], w1[k], msg=lambda m, k=k: f"{k}: {m}")
    assert_close(got["val_loss"], ref["val_loss"])


SCENARIOS["train_ddp"] = scenario_train_ddp


def worker(rank: int, world: int, out_dir: str, hf_dir: str) -> None:
    """Run by ``sublayer.parallel.launch`` (which set up the gloo process group) on every rank."""
    torch.set_num_threads(1)
    results: dict[str, str | None] = {}
    try:
        mesh = init_device_mesh("cpu", (world,))
        for name, fn in SCENARIOS.items():
            torch.manual_seed(1234)  # every rank starts each scenario from the same generator state
            try:
                extra = {"gpt2_from_hf": (hf_dir,), "demo_ddp": (out_dir,), "train_ddp": (out_dir,)}.get(name, ())
                fn(mesh, *extra)
                results[name] = None
            except Exception:  # record, keep going: each scenario is its own test
                results[name] = traceback.format_exc()
            dist.barrier()
    finally:
        Path(out_dir, f"results_{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":  # python -m tests._dist_worker OUT_DIR HF_DIR: the scenarios on 2 local processes
    from sublayer.parallel import launch

    launch(worker, 2, sys.argv[1], sys.argv[2], timeout_s=120)
