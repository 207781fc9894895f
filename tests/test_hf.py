"""sublayer.hf.patch: a patched HF model equals the unpatched one (outputs, loss, every gradient), in train and eval
mode, fp32 and bf16 autocast; Trainer, save_pretrained and unpatch stay HF's; what cannot be patched is reported."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from sublayer import hf  # noqa: E402

V, T, B = 97, 11, 3


def _bert(head: str = "mlm", **kw):
    cfg = transformers.BertConfig(
        vocab_size=V, hidden_size=14, num_hidden_layers=2, num_attention_heads=2, intermediate_size=23,
        max_position_embeddings=31, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3, **kw,
    )  # fmt: skip
    cls = {"mlm": transformers.BertForMaskedLM, "cls": transformers.BertForSequenceClassification,
           "base": transformers.BertModel}[head]  # fmt: skip
    return cls(cfg)


def _gpt2(**kw):
    cfg = transformers.GPT2Config(
        vocab_size=V, n_embd=14, n_layer=2, n_head=2, n_positions=31, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, **kw,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _llama(kind: str = "llama", **kw):
    cfg_cls, cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    cfg = cfg_cls(
        vocab_size=V, hidden_size=12, intermediate_size=23, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=31, **kw,
    )  # fmt: skip
    return cls(cfg)


MODELS = {"bert_mlm": _bert, "bert_cls": lambda: _bert("cls"), "gpt2": _gpt2, "llama": _llama,
          "qwen2": lambda: _llama("qwen2")}  # fmt: skip
EXPECTED = {  # (HF class, how many) every build above must have replaced
    "bert_mlm": {"BertLayer": 2, "BertSelfOutput": 2},
    "bert_cls": {"BertLayer": 2, "BertSelfOutput": 2, "BertModel": 1},
    "gpt2": {"GPT2MLP": 2, "LayerNorm": 5, "GPT2LMHeadModel": 1},
    "llama": {"LlamaMLP": 2, "LlamaRMSNorm": 5, "LlamaForCausalLM": 1},
    "qwen2": {"Qwen2MLP": 2, "Qwen2RMSNorm": 5, "Qwen2ForCausalLM": 1},
}


def _batch(name: str):
    ids = torch.randint(0, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 7:] = 0  # a padded row
    mask[2, 9:] = 0
    if name == "bert_cls":
        labels = torch.tensor([0, 2, 1])
    else:
        labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _run(model, batch, *, labels: bool):
    kw = dict(batch) if labels else {k: v for k, v in batch.items() if k != "labels"}
    out = model(**kw)
    loss = out.loss if labels else out.logits.float().square().mean()
    model.zero_grad(set_to_none=True)
    loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _counts(report):
    counts: dict[str, int] = {}
    for _, what in report.replaced:
        cls = what.split(" ->")[0]
        counts[cls] = counts.get(cls, 0) + 1
    return counts


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_patched_equals_hf(name, mode):
    ref = MODELS[name]()
    model = copy.deepcopy(ref)
    report = hf.patch(model)
    assert _counts(report) == EXPECTED[name], str(report)
    assert not report.skipped, str(report)
    batch = _batch(name)
    for m in (ref, model):
        m.train(mode == "train")
    for labels in (True, False):
        want, want_g = _run(ref, batch, labels=labels)
        got, got_g = _run(model, batch, labels=labels)
        if labels:
            torch.testing.assert_close(got.loss, want.loss)
        lm_train = labels and mode == "train" and name in ("gpt2", "llama", "qwen2")
        if lm_train:  # the fused loss made no logits
            assert got.logits is None
        else:
            torch.testing.assert_close(got.logits, want.logits)
        assert got_g.keys() == want_g.keys()
        for n in want_g:
            torch.testing.assert_close(got_g[n], want_g[n], msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("name", ["bert_cls", "gpt2", "llama"])
def test_bf16_autocast_within_bf16_rounding(name):
    ref = MODELS[name]()
    model = copy.deepcopy(ref)
    hf.patch(model)
    batch = _batch(name)
    losses, grads = [], []
    for m in (ref, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(**batch)
        m.zero_grad()
        out.loss.backward()
        losses.append(out.loss)
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-2, atol=2e-2)
    for n in grads[0]:
        scale = grads[0][n].abs().max().item() + 1e-6
        torch.testing.assert_close(
            grads[1][n], grads[0][n], rtol=0.0, atol=3e-2 * scale, msg=lambda m, n=n: f"{n}: {m}"
        )


@pytest.mark.parametrize("grad", [True, False])
def test_bf16_weights_equal_hf_within_bf16_rounding(grad):
    """A model cast to bfloat16 (no autocast), in eval mode with and without autograd: HF's bf16 logits."""
    ref = _bert("cls").to(torch.bfloat16).eval()
    model = copy.deepcopy(ref)
    assert "BertModel" in _counts(hf.patch(model))
    kw = batch_inputs(_batch("bert_cls"))
    with torch.set_grad_enabled(grad):
        torch.testing.assert_close(model(**kw).logits, ref(**kw).logits, rtol=2e-2, atol=2e-2)


def test_lm_loss_hf_kwargs():
    """num_items_in_batch (Trainer's gradient-accumulation scaling), shift_labels, return_dict=False and
    positional labels all give HF's loss."""
    ref = _gpt2()
    model = copy.deepcopy(ref)
    hf.patch(model)
    batch = _batch("gpt2")
    shift = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[..., 1:].contiguous()
    for kw in ({"num_items_in_batch": torch.tensor(7)}, {"shift_labels": shift}, {"return_dict": False}):
        want, got = ref(**batch, **kw), model(**batch, **kw)
        torch.testing.assert_close(got[0], want[0])
    # all targets ignored: HF's own loss (NaN), no error
    ignored = dict(batch, labels=torch.full((B, T), -100))
    assert model(**ignored).loss.isnan() and ref(**ignored).loss.isnan()
    # eval or no grad: HF's logits are kept
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, ref(**batch).logits)


def test_loss_false_keeps_logits():
    model = _gpt2()
    report = hf.patch(model, loss=False)
    assert "GPT2LMHeadModel" not in _counts(report)
    assert model(**_batch("gpt2")).logits.shape == (B, T, V)


@pytest.mark.parametrize("side", ["right", "left", "mixed"])
@pytest.mark.parametrize("n_items", [None, 13])
@pytest.mark.parametrize("holes", [False, True])
def test_autocast_loss_is_hf_loss_on_target_rows(side, n_items, holes):
    """Under bf16 autocast the patched LM's loss (bf16 head GEMMs, float32 loss on the rows that have a target, no
    logits) gives HF's loss and every gradient, to bf16 rounding: any padding side, ``num_items_in_batch``, and
    ``ignore_index`` labels at real tokens too."""
    torch.manual_seed(3)
    ref = _gpt2().train()
    model = copy.deepcopy(ref)
    hf.patch(model)
    ids, mask = torch.randint(0, V, (B, T)), _masks()[side]
    labels = ids.masked_fill(mask == 0, -100)
    if holes:
        labels[1, 2:5] = -100
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if n_items is not None:
        batch["num_items_in_batch"] = torch.tensor(n_items)
    outs, grads = [], []
    for m in (ref, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(m(**batch))
        outs[-1].loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    assert outs[1].logits is None
    # left padding: HF's body attends in the padded layout, the patched one on real tokens (bf16 rounding apart)
    torch.testing.assert_close(outs[1].loss, outs[0].loss, rtol=1e-4, atol=1e-4)
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=2e-2, atol=2e-2 * g.abs().max().item() + 1e-6, msg=n)


def test_gpt2_packed_body_steps_aside_for_other_dropout():
    """The packed body draws its residual and embedding dropout from the fused kernel: where a dropout module is
    not ``nn.Dropout`` HF's body runs (it returns a cache), with HF's loss."""

    class MyDropout(torch.nn.Dropout):
        pass

    ref = _gpt2().train()
    for m in (ref.transformer.h[1].attn, ref.transformer):
        setattr(m, "resid_dropout" if m is not ref.transformer else "drop", MyDropout(0.0))
    model = copy.deepcopy(ref)
    hf.patch(model)
    ids, mask = torch.randint(0, V, (B, T)), _masks()["right"]
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    got, want = model(**batch), ref(**batch)
    assert got.past_key_values is not None and got.logits is None
    torch.testing.assert_close(got.loss, want.loss)


def test_unpatch_restores_exactly_and_patch_is_idempotent():
    ref = _gpt2()
    model = copy.deepcopy(ref)
    report = hf.patch(model)
    again = hf.patch(model)
    assert not again.replaced and "already patched" in again.notes[0]
    assert hf.unpatch(model) is True
    assert hf.unpatch(model) is False
    assert all("forward" not in m.__dict__ for m in model.modules()), report
    batch = _batch("gpt2")
    assert torch.equal(model(**batch).logits, ref(**batch).logits)
    with hf.patched(model) as r:
        assert r.replaced and model(**batch).logits is None
    assert model(**batch).logits is not None


def test_patching_a_submodule_first_is_noted():
    model = _bert("cls")
    hf.patch(model.bert)
    report = hf.patch(model)
    # 2 BertLayer + 2 BertSelfOutput already patched; the encoder under the head now runs padding-free
    assert _counts(report) == {"BertModel": 1} and len(report.notes) == 4, str(report)


def test_left_alone_and_reported():
    model = _bert("base", hidden_act="quick_gelu")
    model.encoder.layer[1].attention.output.dense.register_forward_hook(lambda *a: None)
    report = hf.patch(model)
    why = dict(report.skipped)
    assert "QuickGELUActivation" in why["encoder.layer.0"] and "QuickGELUActivation" in why["encoder.layer.1"]
    assert "hooks" in why["encoder.layer.1.attention.output"]
    assert dict(report.replaced).keys() == {
        "encoder.layer.0.attention.output", "encoder.layer.0.output", "encoder.layer.1.output",
    }  # fmt: skip
    assert "skipped" in str(report)
    half = _llama().half()
    assert all("float16" in why for _, why in hf.patch(half).skipped)


def test_not_an_hf_model():
    with pytest.raises(TypeError, match="model must be a transformers"):
        hf.patch(torch.nn.Linear(3, 5))
    with pytest.raises(TypeError, match="model must be"):
        hf.patch("bert-base-uncased")
    with pytest.raises(TypeError, match="loss must be a bool"):
        hf.patch(_gpt2(), loss="yes")


def test_save_pretrained_round_trips(tmp_path):
    model = _bert("cls")
    keys = set(model.state_dict())
    hf.patch(model)
    assert set(model.state_dict()) == keys
    model.save_pretrained(tmp_path)
    back = transformers.BertForSequenceClassification.from_pretrained(tmp_path)
    assert set(back.state_dict()) == keys
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


@pytest.mark.parametrize("name", ["bert_cls", "gpt2"])
def test_trainer_gives_the_same_weights(name, tmp_path):
    pytest.importorskip("accelerate")  # transformers.Trainer needs it
    from torch.utils.data import Dataset

    class Rows(Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(1)
            self.rows = []
            for _ in range(8):
                ids = torch.randint(0, V, (T,), generator=g)
                label = torch.tensor(int(ids[0]) % 3) if name == "bert_cls" else ids
                mask = torch.ones(T, dtype=torch.long)
                mask[T - len(self.rows) % 4 :] = 0  # padding in most batches (the padding-free encoder runs)
                self.rows.append({"input_ids": ids, "attention_mask": mask, "labels": label})

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return self.rows[i]

    ref = MODELS[name]()
    model = copy.deepcopy(ref)
    hf.patch(model)
    init = copy.deepcopy(ref.state_dict())
    out = []
    for m in (ref, model):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=3, learning_rate=1e-2,
            use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no", seed=0, disable_tqdm=True,
        )  # fmt: skip
        transformers.Trainer(model=m, args=args, train_dataset=Rows()).train()
        out.append(m.state_dict())
    for k in out[0]:
        torch.testing.assert_close(out[1][k], out[0][k], msg=lambda m, k=k: f"{k}: {m}")
    assert not all(torch.equal(out[0][k], v) for k, v in init.items())  # it trained


def test_sentence_transformers_encode(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"the a cat dog sat ran on mat fast slow".split()]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    tok = transformers.BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt"))
    cfg = transformers.BertConfig(vocab_size=len(words), hidden_size=14, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=23, max_position_embeddings=31)  # fmt: skip
    bert = transformers.BertModel(cfg)
    bert.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    try:
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.models import Pooling, Transformer
    model = st.SentenceTransformer(modules=[Transformer(str(tmp_path)), Pooling(14)], device="cpu")
    texts = ["the cat sat on the mat", "a dog ran", "the dog ran fast on a mat", "slow"]
    want = model.encode(texts, convert_to_tensor=True)
    report = hf.patch(model)
    assert _counts(report) == {"BertLayer": 2, "BertSelfOutput": 2, "BertModel": 1}, str(report)
    torch.testing.assert_close(model.encode(texts, convert_to_tensor=True), want)


def _masks():
    """Right, left and mixed padding, and no padding, for B rows of T."""
    right = torch.ones(B, T, dtype=torch.long)
    right[0, 7:] = 0
    right[2, 5:] = 0
    left = right.flip(1)
    mixed = torch.stack([right[0], left[2], torch.ones(T, dtype=torch.long)])
    return {"right": right, "left": left, "mixed": mixed, "none": torch.ones(B, T, dtype=torch.long)}


@pytest.mark.parametrize("side", ["right", "left", "mixed", "none"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_padding_free_encoder_equals_hf(side, mode):
    """The padding-free encoder under a classification head: HF's logits, loss and every gradient, with grad and
    (eval) without; its hidden states at padded positions are zeros (the path ran)."""
    ref = _bert("cls")
    model = copy.deepcopy(ref)
    assert ("bert", "BertModel -> padding-free encoder (real tokens only, zeros at padding)") in hf.patch(model).replaced
    mask = _masks()[side]
    batch = {"input_ids": torch.randint(0, V, (B, T)), "attention_mask": mask, "labels": torch.tensor([0, 2, 1])}
    for m in (ref, model):
        m.train(mode == "train")
    want, want_g = _run(ref, batch, labels=True)
    got, got_g = _run(model, batch, labels=True)
    torch.testing.assert_close(got.loss, want.loss)
    torch.testing.assert_close(got.logits, want.logits)
    assert got_g.keys() == want_g.keys()
    for n in want_g:
        torch.testing.assert_close(got_g[n], want_g[n], msg=lambda m, n=n: f"{n}: {m}")
    with torch.no_grad():
        want_h, got_h = ref.bert(**batch_inputs(batch)), model.bert(**batch_inputs(batch))
        torch.testing.assert_close(model(**batch).logits, ref(**batch).logits)
    real = mask.bool()
    torch.testing.assert_close(got_h.last_hidden_state[real], want_h.last_hidden_state[real])
    torch.testing.assert_close(got_h.pooler_output, want_h.pooler_output)
    pads = (~real).clone()
    pads[:, 0] = False  # the pooler's position 0 runs, padding or not
    assert bool((got_h.last_hidden_state[pads] == 0).all())


def batch_inputs(batch):
    return {k: v for k, v in batch.items() if k != "labels"}


def test_padding_free_option():
    """A bare BertModel's hidden states at padding are an output: left HF's unless padding_free=True (then zeros
    there, HF's values at the real tokens); padding_free=False keeps HF's encoder everywhere."""
    ref = _bert("base").eval()
    ids, mask = torch.randint(0, V, (B, T)), _masks()["mixed"]
    want = ref(ids, attention_mask=mask).last_hidden_state
    auto = copy.deepcopy(ref)
    report = hf.patch(auto)
    assert "BertModel" not in _counts(report) and "padding_free=True" in report.notes[0], str(report)
    torch.testing.assert_close(auto(ids, attention_mask=mask).last_hidden_state, want)
    on = copy.deepcopy(ref)
    assert "BertModel" in _counts(hf.patch(on, padding_free=True))
    got = on(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()])
    pads = ~mask.bool()
    torch.testing.assert_close(got[pads[:, 0], 0], want[pads[:, 0], 0])  # the pooler's position 0 runs
    pads[:, 0] = False
    assert pads.any() and bool((got[pads] == 0).all())
    assert "BertModel" not in _counts(hf.patch(_bert("cls"), padding_free=False))
    with pytest.raises(TypeError, match="padding_free must be None or a bool"):
        hf.patch(_bert("cls"), padding_free="yes")


def test_padding_free_steps_aside():
    """A row of padding only, output_hidden_states / output_attentions and hooks inside the encoder run HF's
    encoder: HF's values everywhere, padded positions included."""
    ref = _bert("base").eval()
    model = copy.deepcopy(ref)
    hf.patch(model, padding_free=True)
    ids, mask = torch.randint(0, V, (B, T)), _masks()["right"]
    all_pad = mask.clone()
    all_pad[1] = 0
    for kw in ({"attention_mask": all_pad}, {"attention_mask": mask, "output_hidden_states": True},
               {"attention_mask": mask, "output_attentions": True}):  # fmt: skip
        want, got = ref(ids, **kw), model(ids, **kw)
        torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state)
        for name in ("hidden_states", "attentions"):
            if getattr(want, name) is not None:
                torch.testing.assert_close(getattr(got, name), getattr(want, name))
    seen = []
    model.encoder.layer[1].register_forward_hook(lambda mod, a, out: seen.append(out))
    torch.testing.assert_close(model(ids, attention_mask=mask).last_hidden_state,
                               ref(ids, attention_mask=mask).last_hidden_state)  # fmt: skip
    assert len(seen) == 1 and seen[0].shape == (B, T, 14)


@pytest.mark.parametrize("side", ["right", "left", "mixed", "none"])
@pytest.mark.parametrize("ids_kw", ["default", "types", "positions", "batch-positions"])
def test_packed_embeddings_equal_hf(side, ids_kw):
    """In eval mode without autograd the embeddings run on the real tokens only (HF's embeddings forward is not
    called; with the kernels switched off that inference path steps aside for HF's or the differentiable one): HF's
    hidden states there, token types and positions given or left to HF's buffers; hooks on the embeddings and
    inputs_embeds run HF's embeddings (the hook fires), same values."""
    from unittest import mock

    from sublayer import kernels

    ref = _bert("base", type_vocab_size=3).eval()
    model = copy.deepcopy(ref)
    hf.patch(model, padding_free=True)
    g = torch.Generator().manual_seed(7)
    mask = _masks()[side]
    kw = {"input_ids": torch.randint(0, V, (B, T), generator=g), "attention_mask": mask}
    if ids_kw == "types":
        kw["token_type_ids"] = torch.randint(0, 3, (B, T), generator=g)
    elif ids_kw == "positions":
        kw["position_ids"] = torch.arange(3, 3 + T)[None]
    elif ids_kw == "batch-positions":
        kw["position_ids"] = torch.randint(0, 31, (B, T), generator=g)
    real = mask.bool()
    with torch.no_grad():
        want = ref(**kw).last_hidden_state
        if kernels.enabled() and bool(real[:, 0].all()):  # (else the pooler reads a padded position 0: the
            # differentiable path runs)
            with mock.patch.object(type(model.embeddings), "forward", side_effect=AssertionError("HF's ran")):
                got = model(**kw).last_hidden_state
        else:
            got = model(**kw).last_hidden_state
        torch.testing.assert_close(got[real], want[real])
        seen = []
        hook = model.embeddings.register_forward_hook(lambda mod, a, out: seen.append(out.shape))
        torch.testing.assert_close(model(**kw).last_hidden_state[real], want[real])
        hook.remove()
        assert seen == [(B, T, 14)]
        embeds = ref.embeddings.word_embeddings(kw["input_ids"])
        other = {k: v for k, v in kw.items() if k != "input_ids"}
        torch.testing.assert_close(model(inputs_embeds=embeds, **other).last_hidden_state[real], want[real])


def test_inference_path_sees_new_weights():
    """Without autograd in eval mode the encoder runs weights prepared once; after an optimizer step and after an
    in-place write they are HF's new ones."""
    ref = _bert("cls")
    model = copy.deepcopy(ref)
    hf.patch(model)
    batch = {"input_ids": torch.randint(0, V, (B, T)), "attention_mask": _masks()["right"]}
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
    for step in range(3):
        for m in (ref, model):
            m.eval()
        with torch.no_grad():
            torch.testing.assert_close(model.bert(**batch).pooler_output, ref.bert(**batch).pooler_output)
        for m, opt in zip((ref, model), opts):
            m.train()
            m(**batch, labels=torch.tensor([0, 2, 1])).loss.backward()
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        for m in (ref, model):
            m.bert.encoder.layer[0].intermediate.dense.weight.mul_(3.0)
            m.eval()
        torch.testing.assert_close(model.bert(**batch).pooler_output, ref.bert(**batch).pooler_output)


@pytest.mark.parametrize("side", ["right", "left", "mixed"])
@pytest.mark.parametrize("n_items", [None, 13])
def test_gpt2_packed_body_equals_hf(side, n_items):
    """GPT-2's body on the real tokens only (every target row real: labels -100 at padding, right padding) gives
    HF's loss and every gradient; where a padded position has a target (left padding: the last pad predicts the
    first token) HF's body runs, with the same result."""
    ref = _gpt2().train()
    model = copy.deepcopy(ref)
    hf.patch(model)
    ids, mask = torch.randint(0, V, (B, T)), _masks()[side]
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    if n_items is not None:
        batch["num_items_in_batch"] = torch.tensor(n_items)
    want, want_g = _run(ref, batch, labels=True)
    got, got_g = _run(model, batch, labels=True)
    torch.testing.assert_close(got.loss, want.loss)
    assert got_g.keys() == want_g.keys()
    for n in want_g:
        torch.testing.assert_close(got_g[n], want_g[n], msg=lambda m, n=n: f"{n}: {m}")
    assert (got.past_key_values is None) == (side == "right")  # the packed body returns no cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_keeps_hf_cast_order(dtype):
    """HF's RMSNorm rounds the normed input to its dtype before the weight multiplies it: in bfloat16 that is two
    roundings, which the patched norm keeps (fp32: the weight is fused)."""
    model = _llama().to(dtype)
    norm = model.model.norm
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 5, 12, dtype=dtype, requires_grad=True)
    want = norm(x)
    (gx_want,) = torch.autograd.grad(want.float().square().sum(), x)
    hf.patch(model)
    got = norm(x)
    (gx,) = torch.autograd.grad(got.float().square().sum(), x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(gx, gx_want)


@pytest.mark.parametrize(
    "name, part",
    [("llama", "model.layers.0.mlp.down_proj"), ("gpt2", "transformer.h.0.mlp.c_proj"),
     ("bert_mlm", "bert.encoder.layer.0.output.dense"), ("bert_mlm", "bert.encoder.layer.1.attention.output.dense")],
)  # fmt: skip
def test_a_hook_registered_after_patching_runs_hf_forward(name, part):
    """A patched forward steps aside for HF's while a part it skips has a hook, however late the hook came."""
    torch.manual_seed(0)
    ref = MODELS[name]().eval()
    model = copy.deepcopy(ref)
    hf.patch(model)
    batch = _batch(name)
    del batch["labels"]
    calls = {"hf": 0, "patched": 0}

    def steer(key):
        def hook(mod, args, out):
            calls[key] += 1
            return out * 1.5

        return hook

    handles = [ref.get_submodule(part).register_forward_hook(steer("hf")),
               model.get_submodule(part).register_forward_hook(steer("patched"))]  # fmt: skip
    with torch.no_grad():
        want, got = ref(**batch).logits, model(**batch).logits
    assert calls == {"hf": 1, "patched": 1}
    torch.testing.assert_close(got, want)
    for h in handles:
        h.remove()
    with torch.no_grad():
        assert not torch.allclose(model(**batch).logits, want)  # the patched path again, without the hook


class _Lora(torch.nn.Linear):
    """A linear plus a low-rank update (what peft's LoRA layers put in a linear's place)."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
        self.load_state_dict(base.state_dict())
        g = torch.Generator().manual_seed(5)
        self.a = torch.nn.Parameter(torch.randn(3, base.in_features, generator=g))
        self.b = torch.nn.Parameter(torch.randn(base.out_features, 3, generator=g))

    def forward(self, x):
        return super().forward(x) + x @ self.a.t() @ self.b.t()


class _LoRA(torch.nn.Module):
    """A peft-like adapter around a linear: its ``weight``/``bias`` are the base layer's, its forward adds more."""

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.base_layer = base
        self.A = torch.nn.Linear(base.weight.shape[1], 2, bias=False)
        self.B = torch.nn.Linear(2, base.weight.shape[0], bias=False)

    weight = property(lambda self: self.base_layer.weight)
    bias = property(lambda self: self.base_layer.bias)

    def forward(self, x):
        return self.base_layer(x) + self.B(self.A(x))


@pytest.mark.parametrize(
    "name, part",
    [("bert_cls", "bert.encoder.layer.0.intermediate.dense"), ("bert_cls", "bert.encoder.layer.1.attention.self.query"),
     ("bert_mlm", "bert.encoder.layer.1.attention.output.dense"), ("gpt2", "transformer.h.0.mlp.act"),
     ("llama", "model.layers.0.mlp.down_proj")],
)  # fmt: skip
@pytest.mark.parametrize("grad", [False, True])
def test_a_sub_module_replaced_after_patching_runs_as_the_new_one(name, part, grad):
    """A patched forward steps aside for HF's once a sub-module it reads was replaced (a LoRA layer, another
    activation), however late: it never computes with what the patch saw."""
    torch.manual_seed(0)
    ref = MODELS[name]().eval()
    model = copy.deepcopy(ref)
    hf.patch(model)
    batch = _batch(name)
    del batch["labels"]
    for m in (ref, model):
        parent, attr = part.rsplit(".", 1)
        old = m.get_submodule(part)
        new = torch.nn.ReLU() if attr == "act" else _Lora(old)
        setattr(m.get_submodule(parent), attr, new)
    with torch.set_grad_enabled(grad):
        torch.testing.assert_close(model(**batch).logits, ref(**batch).logits)


def test_unpatch_of_a_deep_copy_restores_hf_forwards():
    torch.manual_seed(0)
    ref = MODELS["bert_cls"]().eval()
    model = copy.deepcopy(ref)
    hf.patch(model)
    twin = copy.deepcopy(model)
    assert hf.unpatch(twin)
    assert not any("forward" in m.__dict__ or "feed_forward_chunk" in m.__dict__ for m in twin.modules())
    batch = _batch("bert_cls")
    del batch["labels"]
    with torch.no_grad():
        torch.testing.assert_close(twin(**batch).logits, ref(**batch).logits)


def test_a_head_replaced_after_patching_gives_the_new_heads_loss():
    torch.manual_seed(0)
    ref = MODELS["gpt2"]().train()
    model = copy.deepcopy(ref)
    hf.patch(model)
    batch = _batch("gpt2")
    for m in (ref, model):
        m.lm_head = _Lora(m.lm_head)
    torch.testing.assert_close(model(**batch).loss, ref(**batch).loss)


@pytest.mark.parametrize(
    "name, part",
    [("llama", "model.layers.0.mlp.down_proj"), ("llama", "lm_head"), ("bert_mlm", "bert.encoder.layer.0.output.dense"),
     ("bert_cls", "bert.encoder.layer.1.attention.self.value"), ("bert_cls", "bert.encoder.layer.0.intermediate.dense")],
)  # fmt: skip
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_module_wrapped_after_patching_runs_hf_forward(name, part, mode):
    """A patched forward reads its sub-modules' weights: one wrapped after patching (a LoRA adapter) makes it run
    HF's, so the adapter's forward runs and its parameters get their gradients."""
    torch.manual_seed(0)
    ref = MODELS[name]().train(mode == "train")
    model = copy.deepcopy(ref)
    hf.patch(model)
    parent, attr = part.rpartition(".")[::2]
    for m in (ref, model):
        torch.manual_seed(1)
        setattr(m.get_submodule(parent), attr, _LoRA(m.get_submodule(part)))
    batch = _batch(name)
    for labels in (True, False):
        want, want_g = _run(ref, batch, labels=labels)
        got, got_g = _run(model, batch, labels=labels)
        torch.testing.assert_close(got.loss if labels else got.logits, want.loss if labels else want.logits)
        assert got_g.keys() == want_g.keys()
        for n in want_g:
            torch.testing.assert_close(got_g[n], want_g[n], msg=lambda m, n=n: f"{n}: {m}")
    with torch.no_grad():
        batch.pop("labels")
        torch.testing.assert_close(model(**batch).logits, ref(**batch).logits)
