"""``sublayer train``: documents packed into rows (no cross-document attention), a few-step run on the built-in
text (loss decreases, HF loads the folder with equal logits), resume after an interrupt bit for bit, the CLI's
errors, and the README's round trip. Its ``--nproc 2`` equivalence runs in tests/_dist_worker.py (train_ddp)."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.testing import assert_close

pytest.importorskip("tokenizers")

from sublayer import train as T  # noqa: E402
from sublayer.checkpoints.io import CheckpointError  # noqa: E402
from sublayer.models import GPT2, GPT2Config, Llama, LlamaConfig  # noqa: E402
from sublayer.train import loop as L  # noqa: E402
from sublayer.train.starter import save_tokenizer  # noqa: E402
from sublayer.text import causal_lm_class  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model": "builtin:gpt2-tiny", "data": "builtin:numbers", "batch_size": 4, "seq_len": 32, "quiet": True,
        "threads": 1}  # fmt: skip


# ---- packing ---------------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 13), min_size=1, max_size=7), st.integers(2, 11))
def test_packing_keeps_every_token_restarts_positions_and_ignores_document_starts(lengths, seq_len):
    docs, nxt = [], 0
    for n in lengths:
        docs.append(list(range(nxt, nxt + n)))
        nxt += n
    rows = T.pack_documents(docs, seq_len, pad_id=0)
    total = sum(lengths)
    assert rows.input_ids.shape == (-(-total // seq_len), seq_len)
    flat = rows.input_ids.reshape(-1)[: total]
    assert flat.tolist() == list(range(total))  # laid end to end, nothing lost
    assert rows.n_tokens == total and not rows.attention_mask.reshape(-1)[total:].any()
    first = {d[0] for d in docs}
    pos = rows.position_ids.reshape(-1)
    lab = rows.labels.reshape(-1)
    for i in range(total):
        starts = i in first or i % seq_len == 0
        assert pos[i] == (0 if starts else pos[i - 1] + 1)
        assert lab[i] == (T.IGNORE if i in first else i)  # a document's first token is never a target
    assert (lab[total:] == T.IGNORE).all()


def _tiny(kind: str):
    torch.manual_seed(0)
    if kind == "gpt2":
        return GPT2(GPT2Config(vocab_size=29, max_positions=16, d_model=20, n_layers=2, n_heads=4, dropout=0.0,
                               embd_dropout=0.0, attn_dropout=0.0))  # fmt: skip
    return Llama(LlamaConfig(vocab_size=29, max_positions=16, d_model=20, n_layers=2, n_heads=2, n_kv_heads=1,
                             d_ff=22, eos_token_id=2))  # fmt: skip


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@torch.no_grad()
def test_a_packed_row_gives_each_document_its_own_logits_and_loss(kind):
    """Documents of 5, 3 and 9 tokens in rows of 11: logits at every position equal the document (or, for the
    one cut at a row's end, its piece) run alone; the packed loss equals the token-weighted loss of the pieces."""
    model = _tiny(kind).eval()
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(3, 29, (n,), generator=g).tolist() for n in (5, 3, 9)]
    rows = T.pack_documents(docs, 11)
    logits = model(rows.input_ids, position_ids=rows.position_ids, attention_mask=rows.attention_mask)
    pieces = [(0, 0, 5), (0, 5, 8), (0, 8, 11), (1, 0, 6)]  # (row, start, end): the third document is cut
    stream = torch.tensor([i for d in docs for i in d])
    for r, a, b in pieces:
        alone = model(rows.input_ids[r : r + 1, a:b])
        assert_close(logits[r, a:b], alone[0], msg=f"{kind} row {r} [{a}:{b}]")
    assert torch.equal(rows.input_ids.reshape(-1)[:17], stream)
    loss = model.loss(rows.input_ids, **rows.loss_kwargs())
    total, count = 0.0, 0
    for r, a, b in pieces:
        ids, lab = rows.input_ids[r : r + 1, a:b], rows.labels[r : r + 1, a:b]
        n = int((lab[:, 1:] != T.IGNORE).sum())
        if n:
            total += float(model.loss(ids, labels=lab)) * n
            count += n
    assert count == rows.n_targets
    assert_close(float(loss), total / count, rtol=1e-5, atol=1e-6)


def test_documents_are_paragraphs_or_files(tmp_path):
    (tmp_path / "a.txt").write_text("one\n\ntwo\n  \nthree\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("four\nfive")
    (tmp_path / "c.json").write_text("{}")  # not text: skipped
    assert T.read_documents(tmp_path) == ["one", "two", "three", "four\nfive"]
    assert T.read_documents(tmp_path, split="files") == ["one\n\ntwo\n  \nthree", "four\nfive"]
    assert T.read_documents(tmp_path / "a.txt") == ["one", "two", "three"]
    docs = T.read_documents("builtin:numbers")
    assert len(docs) == 3000 and re.fullmatch(r"\d+ is [a-z -]+\.", docs[0].splitlines()[0])
    tok = T.byte_tokenizer()
    ids = T.tokenize(tok, ["é 12", "x"], eos=256)
    assert ids == [[*"é 12".encode(), 256], [ord("x"), 256]] and tok.decode(ids[0][:-1]) == "é 12"
    from tests.models.conftest import word_tokenizer

    cls_sep = word_tokenizer(bert=True)  # a tokenizer that adds its own special tokens (as Llama's adds bos)
    ids = T.tokenize(cls_sep, ["the"], eos=3)[0]
    assert ids == [2, cls_sep.token_to_id("the"), 3]  # [CLS] the [SEP]: [SEP] is the eos, not added twice


def test_held_out_documents_and_batches_are_pure_functions():
    held = T.held_out(100, 0.05, 3)
    assert len(held) == 5 and held == T.held_out(100, 0.05, 3) and held != T.held_out(100, 0.05, 4)
    assert T.held_out(3, 0.01, 0) != [] and T.held_out(1, 0.5, 0) == [] and T.held_out(10, 0.0, 0) == []
    a = T.batch_index(0, 7, 10, 3)
    assert torch.equal(a, T.batch_index(0, 7, 10, 3)) and len(a) == 3
    epoch = torch.cat([T.batch_index(0, s, 10, 3) for s in range(3)])  # 3 steps per epoch: distinct rows
    assert len(set(epoch.tolist())) == 9
    assert not torch.equal(epoch, torch.cat([T.batch_index(0, s, 10, 3) for s in range(3, 6)]))


# ---- a real (tiny) run -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    metrics = T.train(T.TrainConfig(out=str(out), steps=24, eval_every=8, **TINY))
    return out, metrics


def test_loss_decreases_on_the_builtin_text(run):
    out, metrics = run
    state = json.loads((out / "trainer_state.json").read_text())
    train, val = state["history"]["train"], state["history"]["val"]
    assert [s for s, _ in val] == [8, 16, 24] and len(train) == 24
    assert train[0][1] > math.log(257) - 0.3  # starts near uniform over 257 byte ids
    assert sum(l for _, l in train[-4:]) / 4 < train[0][1] - 1.0
    assert val[-1][1] < val[0][1] and metrics["val_loss"] == val[-1][1]
    assert metrics["val_perplexity"] == pytest.approx(math.exp(val[-1][1]))
    from matplotlib.image import imread

    assert imread(out / "loss.png").shape[0] > 100


@pytest.mark.parametrize("kind", ["gpt2-tiny", "llama-tiny"])
def test_the_folder_loads_in_hf_with_equal_logits_and_tokens(run, tmp_path, kind):
    transformers = pytest.importorskip("transformers")
    out = run[0] if kind == "gpt2-tiny" else tmp_path
    if kind != "gpt2-tiny":
        T.train(T.TrainConfig(out=str(out), steps=2, **{**TINY, "model": f"builtin:{kind}"}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tok("4021 is four thousand twenty-one.").input_ids])
    assert ids[0].tolist() == list(b"4021 is four thousand twenty-one.") and tok.eos_token_id == 256
    ours = causal_lm_class(out).from_pretrained(out)
    assert type(ours).__name__ == ("GPT2" if kind == "gpt2-tiny" else "Llama")
    with torch.no_grad():
        assert_close(ours(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


# ---- resume after an interrupt: the uninterrupted run bit for bit -----------------------------------------------


@pytest.fixture(scope="module")
def droppy(tmp_path_factory):
    """A GPT-2 folder with dropout (the torch RNG state must be the step's on resume) and the byte tokenizer."""
    folder = tmp_path_factory.mktemp("droppy")
    torch.manual_seed(0)
    model = GPT2(GPT2Config(vocab_size=257, max_positions=32, d_model=16, n_layers=1, n_heads=2, dropout=0.1,
                            bos_token_id=256, eos_token_id=256))  # fmt: skip
    model.save_pretrained(folder)
    save_tokenizer(T.byte_tokenizer(), folder, 32)
    return folder


def _resume_cfg(droppy, out, **kw):
    return T.TrainConfig(**{**TINY, "model": str(droppy), "out": str(out), "steps": 4, "eval_every": 2, **kw})


def _saved(folder):
    from safetensors.torch import load_file

    state = json.loads((folder / "trainer_state.json").read_text())
    return load_file(folder / "model.safetensors"), load_file(folder / "optimizer.safetensors"), state["history"]


@pytest.mark.parametrize("where", ["after_step", "sigint_in_update"])
def test_interrupt_then_resume_equals_the_uninterrupted_run(droppy, tmp_path, monkeypatch, where):
    T.train(_resume_cfg(droppy, tmp_path / "straight"))
    calls = {"step": 0}
    real_step = torch.optim.AdamW.step

    def step(self, *a, **k):
        calls["step"] += 1
        if calls["step"] == 2 and where == "sigint_in_update":  # held until the update's bookkeeping is done
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(self, *a, **k)

    def on_step(s, info):
        if s == 3 and where == "after_step":
            raise KeyboardInterrupt

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    with pytest.raises(KeyboardInterrupt):
        T.train(_resume_cfg(droppy, tmp_path / "stopped"), on_step=on_step)
    monkeypatch.undo()
    state = json.loads((tmp_path / "stopped" / "trainer_state.json").read_text())
    assert state["step"] == {"after_step": 3, "sigint_in_update": 2}[where]
    assert not (tmp_path / "stopped" / "metrics.json").exists()
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the folder's tokenizer files, copied
        assert (tmp_path / "stopped" / name).read_bytes() == (droppy / name).read_bytes()
    seen = []
    T.train(_resume_cfg(droppy, tmp_path / "stopped", resume=True), on_step=lambda s, i: seen.append(s))
    assert seen == list(range(state["step"] + 1, 5))
    (w1, o1, h1), (w2, o2, h2) = _saved(tmp_path / "straight"), _saved(tmp_path / "stopped")
    assert h1 == h2
    for a, b in ((w1, w2), (o1, o2)):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_resume_refuses_other_data_or_data_order(droppy, tmp_path):
    T.train(_resume_cfg(droppy, tmp_path, steps=1))
    with pytest.raises(ValueError, match=r"seq_len \(16\) differs from the checkpoint's \(32\)"):
        T.train(_resume_cfg(droppy, tmp_path, resume=True, seq_len=16))
    with pytest.raises(ValueError, match=r"batch_size \(2\) differs from the checkpoint's \(4\)"):
        T.train(_resume_cfg(droppy, tmp_path, resume=True, batch_size=2))
    other = tmp_path / "other.txt"
    other.write_text("some other text\n\n" * 200)
    with pytest.raises(ValueError, match="does not give the rows the checkpoint in"):
        T.train(_resume_cfg(droppy, tmp_path, resume=True, data=str(other)))
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    del state["train_config"]  # e.g. the demo's checkpoint
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match="is not a checkpoint of sublayer train"):
        T.train(_resume_cfg(droppy, tmp_path, resume=True))


def test_resume_refuses_another_model_and_takes_the_same_folder_however_spelled(droppy, tmp_path, cli, monkeypatch):
    T.train(_resume_cfg(droppy, tmp_path, steps=1))
    with pytest.raises(ValueError, match=r"model \('builtin:gpt2-tiny'\) differs from the checkpoint's \("
                       + re.escape(repr(str(droppy))) + r"\) in .*: a resumed run continues the model it started with"):
        T.train(_resume_cfg(droppy, tmp_path, resume=True, model="builtin:gpt2-tiny"))
    code, _, err = cli("train", "--model", "builtin:llama-tiny", "--data", "builtin:numbers", "--out", str(tmp_path),
                       "--batch-size", "4", "--seq-len", "32", "--resume", "--quiet")  # fmt: skip
    assert code == 2 and err.startswith(f"error: --model ('builtin:llama-tiny') differs from the checkpoint's "
                                        f"({str(droppy)!r})"), err  # fmt: skip
    monkeypatch.chdir(droppy.parent)
    T.train(_resume_cfg(droppy, tmp_path, resume=True, steps=2, model=droppy.name + "/"))  # the same folder
    assert json.loads((tmp_path / "trainer_state.json").read_text())["step"] == 2


def test_resume_from_a_checkpoint_cut_short_before_its_trainer_state_is_refused(droppy, tmp_path, monkeypatch):
    from sublayer.demo import checkpoint as C

    T.train(_resume_cfg(droppy, tmp_path, steps=2))
    real = C.write_text

    def killed(path, text):  # the process dies before the trainer state of the step-3 checkpoint is written
        if path.name == "trainer_state.json":
            raise OSError("killed")
        real(path, text)

    monkeypatch.setattr(C, "write_text", killed)
    with pytest.raises(OSError, match="killed"):
        T.train(_resume_cfg(droppy, tmp_path, steps=3, resume=True))
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="has made 3 updates but trainer_state.json is at step 2"):
        T.train(_resume_cfg(droppy, tmp_path, resume=True))


@pytest.mark.parametrize("key", ["seq_len", "seed"])
def test_resume_from_a_train_config_without_a_data_order_setting_names_the_file(droppy, tmp_path, key):
    T.train(_resume_cfg(droppy, tmp_path, steps=1))
    path = tmp_path / "trainer_state.json"
    state = json.loads(path.read_text())
    del state["train_config"][key]
    path.write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=f"trainer state {re.escape(str(path))} is not valid: train_config "
                       f"lacks '{key}'"):  # fmt: skip
        T.train(_resume_cfg(droppy, tmp_path, resume=True))


# ---- the CLI ---------------------------------------------------------------------------------------------------


@pytest.fixture
def cli(monkeypatch, capsys):
    from sublayer import cli as C

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        monkeypatch.setattr(sys, "argv", ["sublayer", *args])
        try:
            C.main()
            code = 0
        except SystemExit as e:
            code = e.code
        io = capsys.readouterr()
        return code, io.out, io.err

    return run


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("bert")
    transformers.BertConfig(vocab_size=11, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=8).save_pretrained(folder)  # fmt: skip
    return folder


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "0"], "--steps must be a positive int, got 0"),
        (["--steps", "3", "--epochs", "2"], r"--steps \(3\) and --epochs \(2\) exclude each other"),
        (["--batch-size", "-1"], "--batch-size must be a positive int, got -1"),
        (["--seq-len", "300"], r"--seq-len \(300\) must be at most the model's max_positions \(256\)"),
        (["--seq-len", "1"], r"--seq-len must be at least 2 \(a row's last token has no next one to predict\), got 1"),
        (["--batch-size", "4096"], r"--batch-size \(4096\) is more than the \d+ rows of 256 tokens that --data "
                                   "packs into"),
        (["--lr", "0"], "--lr must be a positive number, got 0"),
        (["--val-fraction", "1"], r"--val-fraction must be a number in \[0, 1\), got 1"),
        (["--split", "lines"], "--split must be one of paragraphs, files, got 'lines'"),
        (["--data", "builtin:poems"], "--data 'builtin:poems' is not a built-in text: use one of builtin:numbers"),
        (["--data", "no/such/file.txt"], "--data 'no/such/file.txt' does not exist"),
        (["--model", "builtin:gpt5"], "--model 'builtin:gpt5' is not a built-in model: use one of builtin:gpt2-tiny"),
        (["--model", "no/such/folder"], "--model 'no/such/folder': .*builtin:gpt2-tiny"),
        (["--nproc", "3"], r"--nproc must be >= 1 and divide --batch-size \(8\), got 3"),
        (["--seed", "-1"], r"--seed must be an int in \[0, 2\*\*63\), got -1"),
        (["--resume"], "--resume: no checkpoint in"),
    ],
)  # fmt: skip
def test_cli_errors_name_the_flag_its_value_and_the_rule(cli, tmp_path, args, message):
    base = {"--model": "builtin:gpt2-tiny", "--data": "builtin:numbers", "--out": str(tmp_path / "o")}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    flat = [x for kv in base.items() for x in kv] + [a for a in args if a == "--resume"]
    code, out, err = cli("train", *flat, "--quiet")
    assert code == 2 and err.count("\n") == 1, err
    assert re.fullmatch(f"error: {message}.*\n", err), err


def test_cli_refuses_a_bert_folder_an_earlier_run_writing_over_the_model_or_a_file(cli, bert_dir, run, droppy,
                                                                                   tmp_path):  # fmt: skip
    code, _, err = cli("train", "--model", str(bert_dir), "--data", "builtin:numbers", "--out", str(tmp_path / "o"))
    assert code == 2 and err == (f"error: --model {str(bert_dir)!r} has model_type 'bert' in config.json: train "
                                 "supports gpt2, llama, qwen2\n")  # fmt: skip
    code, _, err = cli("train", "--model", "builtin:gpt2-tiny", "--data", "builtin:numbers", "--out", str(run[0]))
    assert code == 2 and err.startswith(f"error: {run[0]} holds the checkpoint of an earlier run")
    code, _, err = cli("train", "--model", str(droppy), "--data", "builtin:numbers", "--out", str(droppy))
    assert code == 2 and err == f"error: --out {str(droppy)!r} is the --model folder: give another folder for the " \
        "trained model\n"
    (tmp_path / "f").write_text("")
    code, _, err = cli("train", "--model", "builtin:gpt2-tiny", "--data", "builtin:numbers", "--out", f"{tmp_path}/f")
    assert code == 2 and err == f"error: --out '{tmp_path}/f' is a file: give a folder, new or existing\n"


def test_readme_round_trip_runs(cli, tmp_path, monkeypatch):
    """The README's ``bash`` block that trains: each ``sublayer`` line runs as written (``--steps`` cut to 3
    for time), in a temp folder; ``generate`` prints a continuation of the prompt."""
    text = (ROOT / "README.md").read_text()
    block = next(b for b in re.findall(r"^```bash\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)
                 if "sublayer train" in b)  # fmt: skip
    lines = [line.split("#")[0].strip() for line in block.splitlines() if line.startswith("sublayer ")]
    assert [shlex.split(line)[1] for line in lines] == ["train", "generate"]
    monkeypatch.chdir(tmp_path)
    for line in lines:
        args = shlex.split(re.sub(r"--steps \d+", "--steps 3", line))[1:]
        code, out, err = cli(*args)
        assert code == 0, err
    prompt = shlex.split(lines[1])[-1]
    assert out.startswith(prompt) and len(out) > len(prompt) + 1
