"""``GPT2.loss``: equal to HF ``GPT2LMHeadModel(..., labels=...).loss`` (value and every parameter's gradient) on
padded and unpadded batches; the edge cases where HF's mean is undefined raise; no logits kept for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from sublayer.bench.harness import saved_bytes as _saved_bytes
from sublayer.checkpoints import gpt2 as keymap
from sublayer.models import GPT2

from .conftest import N_LAYERS, VOCAB, make_hf_gpt2

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ours(gpt2_folder) -> GPT2:
    return GPT2.from_pretrained(gpt2_folder).eval()


def _ids(b: int = 3, t: int = 7, seed: int = 5) -> torch.Tensor:
    return torch.randint(3, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _right_padded() -> tuple[torch.Tensor, torch.Tensor]:
    x = _ids(4, 7)
    mask = torch.ones_like(x)
    mask[0, 5:] = 0
    mask[1, 2:] = 0
    mask[2, :] = 0  # a fully padded row
    return x, mask


def _grads_equal(model: GPT2, hf) -> None:
    ours_grads = keymap.to_hf({k: p.grad for k, p in model.named_parameters()} | {"lm_head.weight": None}, N_LAYERS)
    hf_grads = {k.removeprefix("transformer."): p.grad for k, p in hf.named_parameters()}
    assert set(ours_grads) == set(hf_grads)
    for k, g in ours_grads.items():
        assert_close(g, hf_grads[k], msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("padded", [False, True])
def test_loss_and_every_gradient_equal_hf(gpt2_folder, padded):
    model = GPT2.from_pretrained(gpt2_folder).eval()
    hf = make_hf_gpt2()
    if padded:  # default labels: input_ids with padding ignored; HF needs them spelled out
        x, mask = _right_padded()
        labels = x.masked_fill(mask == 0, -100)
        got = model.loss(x, attention_mask=mask)
        want = hf(x, attention_mask=mask, labels=labels).loss
    else:
        x = _ids()
        got = model.loss(x)
        want = hf(x, labels=x).loss
    assert_close(got, want, rtol=1e-4, atol=0)
    got.backward()
    want.backward()
    _grads_equal(model, hf)


def test_explicit_labels_and_ignore_index(ours, hf_gpt2):
    x = _ids()
    labels = _ids(seed=9)
    labels[0, 3:] = -1
    labels[2, 1] = -1
    got = ours.loss(x, labels=labels, ignore_index=-1)
    with torch.no_grad():
        logits = hf_gpt2(x).logits
        want = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-1)
        assert_close(got.detach(), want)
        assert_close(ours.loss(x, labels=labels.masked_fill(labels == -1, -100)), want)  # HF's default index


def test_equals_forward_logits_with_cross_entropy(ours):
    x = _ids(2, 11, seed=3)
    with torch.no_grad():
        want = F.cross_entropy(ours(x)[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        assert_close(ours.loss(x), want)


def test_no_target_raises_where_hf_gives_nan(ours, hf_gpt2):
    one = _ids(2, 1)
    with torch.no_grad():
        assert torch.isnan(hf_gpt2(one, labels=one).loss)
        with pytest.raises(ValueError, match=r"no position has a target \(seq_len=1.*HF returns nan"):
            ours.loss(one)
        x = _ids()
        ignored = torch.full_like(x, -100)
        ignored[:, 0] = 5  # labels at position 0 are never targets (shifted away)
        assert torch.isnan(hf_gpt2(x, labels=ignored).loss)
        with pytest.raises(ValueError, match="no position has a target"):
            ours.loss(x, labels=ignored)
        mask = torch.zeros_like(x)
        mask[:, 0] = 1  # every row a single real token
        with pytest.raises(ValueError, match="no position has a target"):
            ours.loss(x, attention_mask=mask)


def test_keeps_no_logits_for_backward(ours):
    x, mask = _right_padded()
    params = list(ours.parameters())
    fused = _saved_bytes(lambda: ours.loss(x, attention_mask=mask), params)
    eager = _saved_bytes(
        lambda: F.cross_entropy(
            ours(x, attention_mask=mask)[:, :-1].flatten(0, 1), x.masked_fill(mask == 0, -100)[:, 1:].flatten()
        ),
        params,
    )
    logits_bytes = x.shape[0] * (x.shape[1] - 1) * VOCAB * 4
    assert fused <= eager - 0.9 * logits_bytes


def test_bad_inputs(ours):
    x = _ids()
    with pytest.raises(ValueError, match=r"labels must have the shape of input_ids \(3, 7\), got \(3, 6\)"):
        ours.loss(x, labels=x[:, :6])
    with pytest.raises(TypeError, match="labels must hold integer class ids"):
        ours.loss(x, labels=x.float())
    with pytest.raises(ValueError, match=rf"labels must lie in \[0, vocab_size={VOCAB}\) or equal ignore_index=-100"):
        ours.loss(x, labels=x.masked_fill(x == x[0, 0], VOCAB))
    with pytest.raises(TypeError, match="ignore_index must be an int, got 0.5"):
        ours.loss(x, ignore_index=0.5)
    with pytest.raises(ValueError, match="attention_mask must have the shape of input_ids"):
        ours.loss(x, attention_mask=torch.ones(3, 6))
    with pytest.raises(TypeError, match="input_ids must hold integer token ids"):
        ours.loss(x.float())


def test_training_with_the_fused_loss_converges(gpt2_folder):
    torch.manual_seed(0)
    model = GPT2.from_pretrained(gpt2_folder).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    x, mask = _right_padded()
    first = None
    for _ in range(40):
        loss = model.loss(x, attention_mask=mask)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2 * first


def test_packed_documents_loss_equals_each_document_alone(ours):
    """position_ids restarting at 0 pack documents into one row: with the first token of each document ignored
    (it has no predecessor in its document), the loss and gradients equal those of the documents run alone."""
    docs = [_ids(1, 4, seed=1)[0], _ids(1, 5, seed=2)[0], _ids(1, 3, seed=3)[0]]
    x = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    labels = x.clone()
    start = 0
    for d in docs:
        labels[0, start] = -100  # HF's DataCollatorWithFlattening marks each document's first label ignored
        start += len(d)
    packed = ours.loss(x, labels=labels, position_ids=pos)
    packed.backward()
    g_packed = [p.grad.clone() for p in ours.parameters()]
    ours.zero_grad()
    # alone: sum of each document's token losses / total number of targets
    n = sum(len(d) - 1 for d in docs)
    alone = sum(ours.loss(d[None]) * (len(d) - 1) for d in docs) / n
    alone.backward()
    assert_close(packed, alone)
    for g, p in zip(g_packed, ours.parameters()):
        assert_close(g, p.grad)
    ours.zero_grad()


def test_uint8_labels_equal_int64_labels():
    """A byte-level model's uint8 labels: ignore_index=-100 is not 156, the byte value it wraps to."""
    from sublayer.models import GPT2Config

    torch.manual_seed(0)
    model = GPT2(GPT2Config(vocab_size=256, max_positions=11, d_model=15, n_layers=1, n_heads=3)).eval()
    ids = torch.tensor([[10, 156, 20, 156, 255, 3], [156, 156, 7, 156, 1, 2]])
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    for kw in ({}, {"attention_mask": mask}):
        assert_close(model.loss(ids, labels=ids.to(torch.uint8), **kw), model.loss(ids, labels=ids, **kw))


@pytest.mark.parametrize("padded", [False, True])
def test_a_hook_on_the_lm_head_sees_the_loss_and_shapes_it(gpt2_folder, padded):
    """The head's forward hooks run in loss as in forward (a hook that changes the logits changes both), on the
    padded layout, and the gradients follow the hooked logits."""
    model = GPT2.from_pretrained(gpt2_folder).eval()
    x, mask = _right_padded() if padded else (_ids(), None)
    calls = []
    model.lm_head.register_forward_hook(lambda mod, args, out: calls.append(tuple(out.shape)) or out * 2.0)
    got = model.loss(x, attention_mask=mask)
    assert calls == [(*x.shape, VOCAB)]
    logits = model(x, attention_mask=mask)
    labels = x if mask is None else x.masked_fill(mask == 0, -100)
    want = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert_close(got, want)
    (g_got,) = torch.autograd.grad(got, model.lm_head.weight)
    (g_want,) = torch.autograd.grad(want, model.lm_head.weight)
    assert_close(g_got, g_want)
