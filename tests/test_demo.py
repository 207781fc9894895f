"""``sublayer demo``: the task generator, a few-step training run in a temp folder (files, checkpoint, resume,
Ctrl-C), the data-parallel loss normalisation and the CLI's errors."""

from __future__ import annotations

import json
import random
import re
import sys

import pytest
import torch
from torch.testing import assert_close

from sublayer import demo as D
from sublayer.checkpoints.io import CheckpointError, atomic_write

TINY = {"batch_size": 8, "d_model": 16, "n_heads": 2, "d_ff": 24, "n_layers": 1, "eval_every": 2, "n_val": 16,
        "n_test": 20, "quiet": True, "threads": 1, "warmup": 2}  # fmt: skip


# ---- the task --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, words",
    [(0, "zero"), (13, "thirteen"), (40, "forty"), (105, "one hundred five"), (1000, "one thousand"),
     (342006, "three hundred forty-two thousand six"), (100010, "one hundred thousand ten"),
     (999999, "nine hundred ninety-nine thousand nine hundred ninety-nine")],
)  # fmt: skip
def test_number_to_words(n, words):
    assert D.number_to_words(n) == words
    assert D.words_to_number(words) == n


def test_words_round_trip_and_bad_numbers():
    rng = random.Random(0)
    for n in [rng.randrange(10**6) for _ in range(2000)]:
        assert D.words_to_number(D.number_to_words(n)) == n
    with pytest.raises(ValueError, match=r"n must be an int in \[0, 999999\], got 1000000"):
        D.number_to_words(1_000_000)
    with pytest.raises(ValueError, match="direction must be one of"):
        D.make_pair(5, "<to-roman>")


def test_pairs_and_vocab():
    src, tgt = D.make_pair(2021, D.TO_DIGITS)
    assert src == ["<to-digits>", "two", "thousand", "twenty", "-", "one"] and tgt == list("2021")
    src, tgt = D.make_pair(2021, D.TO_WORDS)
    assert src == ["<to-words>", *"2021"] and tgt == ["two", "thousand", "twenty", "-", "one"]
    v = D.Vocab.default()
    assert v.decode(v.encode(tgt) + [v.eos, 7]) == tgt
    assert v.pad == 0
    with pytest.raises(ValueError, match="must come first"):
        D.Vocab(["<bos>", "<pad>", "<eos>", "<unk>"])


def test_held_out_numbers_never_trained_on():
    v = D.Vocab.default()
    seen = set()
    for step in range(20):
        b = D.train_batch(3, step, 64, v)
        for row in b.src.tolist():
            toks = v.decode(row)
            seen.add(int("".join(toks[1:])) if toks[0] == D.TO_WORDS else D.words_to_number(D.detokenize(toks[1:])))
    assert not any(D.is_held_out(n) for n in seen)
    assert len(seen) > 1000
    held = D.held_out_pairs(0, 50, salt=2)
    assert all(D.is_held_out(int("".join(x[1:] if x[0] == D.TO_WORDS else y))) for x, y in held)
    assert 0.09 < sum(map(D.is_held_out, range(1000, 101000))) / 100000 < 0.11


def test_train_batch_is_a_function_of_seed_and_step():
    v = D.Vocab.default()
    a, b = D.train_batch(0, 5, 16, v), D.train_batch(0, 5, 16, v)
    assert torch.equal(a.src, b.src) and torch.equal(a.tgt_out, b.tgt_out)
    assert not torch.equal(D.train_batch(0, 6, 16, v).tgt_out, a.tgt_out)
    assert not torch.equal(D.train_batch(1, 5, 16, v).tgt_out, a.tgt_out)
    assert a.src.shape[0] == 16 and torch.equal(a.src_mask, a.src == v.pad)
    tokens = (a.tgt_out[:, :-1] != v.pad) & (a.tgt_out[:, :-1] != v.eos)  # tgt_in is tgt_out shifted right
    assert torch.equal(a.tgt_in[:, 1:][tokens], a.tgt_out[:, :-1][tokens])
    assert (a.tgt_in[:, 0] == v.bos).all() and ((a.tgt_out == v.eos).sum(1) == 1).all()


def test_config_errors():
    with pytest.raises(ValueError, match="steps must be a positive int, got 0"):
        D.DemoConfig(steps=0)
    with pytest.raises(ValueError, match=r"d_model \(30\) must be divisible by n_heads \(4\)"):
        D.DemoConfig(d_model=30)
    with pytest.raises(ValueError, match="lr must be a positive number, got -1"):
        D.DemoConfig(lr=-1)
    with pytest.raises(ValueError, match=r"batch_size \(9\) must be divisible by world_size \(2\)"):
        D.train(D.DemoConfig(batch_size=9), rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\), got 2"):
        D.train(D.DemoConfig(batch_size=8), rank=2, world_size=2)


def test_lr_schedule():
    c = D.DemoConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert c.lr_at(0) == pytest.approx(0.1) and c.lr_at(9) == pytest.approx(1.0)
    assert c.lr_at(100) == pytest.approx(0.1)
    assert all(c.lr_at(s) >= c.lr_at(s + 1) for s in range(10, 100))


def test_rank_shards_average_to_the_global_gradient():
    """Each rank's loss is its token sum / global tokens · world_size, so the mean of the ranks' gradients
    (what DDP computes) equals one process's gradient on the whole batch."""
    v = D.Vocab.default()
    cfg = D.DemoConfig(**TINY)
    torch.manual_seed(0)
    m = D.Transformer.from_config(cfg.model_config(len(v)))
    batch = D.train_batch(0, 0, 8, v)
    n = batch.n_target_tokens
    net = D.TransformerLoss(m)
    (D.batch_loss(net, batch, 0.0) / n).backward()
    full = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    for rank in range(2):
        (D.batch_loss(net, batch.rows(slice(rank, None, 2)), 0.0) * (2 / n) / 2).backward()  # / 2: DDP's average
    for g, p in zip(full, m.parameters()):
        assert_close(p.grad, g)


def test_atomic_write_leaves_no_partial_file(tmp_path):
    def bad(p):
        open(p, "w").write("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "x.json", bad)
    assert list(tmp_path.iterdir()) == []


# ---- a real (tiny) run -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    metrics = D.train(D.DemoConfig(out=str(out), steps=4, **TINY))
    return out, metrics


def test_run_writes_valid_outputs(run):
    out, metrics = run
    names = {p.name for p in out.iterdir()}
    assert names == {"metrics.json", "loss.png", "attention.png", "model.safetensors", "config.json", "vocab.json",
                     "optimizer.safetensors", "trainer_state.json"}  # fmt: skip
    saved = json.loads((out / "metrics.json").read_text())
    for key in ("exact_match", "steps", "train_seconds", "tokens_per_second", "final_train_loss", "final_val_loss",
                "exact_match_by_direction", "samples", "n_test"):  # fmt: skip
        assert key in saved, key
    assert saved["steps"] == 4 and saved["n_test"] == 20 and 0.0 <= saved["exact_match"] <= 1.0
    assert saved["exact_match"] == metrics["exact_match"]
    from matplotlib.image import imread

    for png in ("loss.png", "attention.png"):
        img = imread(out / png)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_checkpoint_loads_and_gives_the_same_outputs(run):
    out, metrics = run
    model, vocab, state = D.load_checkpoint(out)
    assert state["step"] == 4 and len(state["history"]["train"]) == 4
    acc, records = D.evaluate(model, vocab, D.held_out_pairs(0, 20, salt=2))
    assert acc == metrics["exact_match"]
    assert records[:12] == metrics["samples"]


def test_bench_times_the_checkpoints_evaluation(run, tmp_path):
    from sublayer.bench.decode import _demo_eval_row

    out, _ = run
    lines = []
    row = _demo_eval_row(out, 1, lines.append)
    assert row["same output"] and row["batch"] == 500 and "20 pairs" in row["case"]
    assert row["fast tok/s"] > 0 and row["reference tok/s"] > 0 and lines
    assert _demo_eval_row(tmp_path, 1, lines.append) is None  # no checkpoint there: no row


def test_resume_continues_exactly(tmp_path, run):
    out, _ = run
    D.train(D.DemoConfig(out=str(tmp_path), steps=2, **TINY))
    steps_seen = []
    D.train(D.DemoConfig(out=str(tmp_path), steps=4, resume=True, **TINY), on_step=lambda s, i: steps_seen.append(s))
    assert steps_seen == [3, 4]
    straight, _, _ = D.load_checkpoint(out)
    resumed, _, state = D.load_checkpoint(tmp_path)
    assert state["step"] == 4
    for (k, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert_close(a, b, msg=k)


def test_ctrl_c_saves_a_checkpoint(tmp_path):
    def stop(step, info):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        D.train(D.DemoConfig(out=str(tmp_path), steps=10, **TINY), on_step=stop)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert not (tmp_path / "metrics.json").exists()
    _, _, state = D.load_checkpoint(tmp_path)
    assert state["step"] == 3
    with pytest.raises(FileNotFoundError, match="--resume: no checkpoint in"):
        D.train(D.DemoConfig(out=str(tmp_path / "empty"), resume=True, **TINY))


# ---- the CLI ---------------------------------------------------------------------------------------------------


def _cli(monkeypatch, capsys, *args):
    from sublayer import cli

    monkeypatch.setattr(sys, "argv", ["sublayer", *args])
    with pytest.raises(SystemExit) as e:
        cli.main()
    return e.value.code, capsys.readouterr()


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_cli_bad_steps(monkeypatch, capsys, tmp_path, steps):
    code, io = _cli(monkeypatch, capsys, "demo", "--steps", steps, "--out", str(tmp_path / "o"))
    assert code == 2
    assert io.err == f"error: --steps must be a positive int, got {steps}\n"
    assert not (tmp_path / "o").exists()


def test_an_earlier_runs_checkpoint_is_replaced_only_with_overwrite(run, tmp_path, monkeypatch, capsys):
    import shutil

    out = tmp_path / "o"
    shutil.copytree(run[0], out)
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match=f"{out} holds the checkpoint of an earlier run \\(trainer_state.json\\): "
                       "continue it with --resume, replace it with --overwrite"):
        D.train(D.DemoConfig(out=str(out), steps=2, seed=1, **TINY))
    assert (out / "model.safetensors").read_bytes() == before
    code, io = _cli(monkeypatch, capsys, "demo", "--steps", "2", "--out", str(out))
    assert code == 2 and io.err.startswith(f"error: {out} holds the checkpoint of an earlier run")
    monkeypatch.undo()
    metrics = D.train(D.DemoConfig(out=str(out), steps=2, seed=1, overwrite=True, **TINY))
    assert metrics["steps"] == 2 and (out / "model.safetensors").read_bytes() != before


def test_one_thread_by_default_and_the_bar_shows_the_summarys_tokens_per_second(tmp_path, monkeypatch):
    from rich.progress import Progress

    shown, threads = [], []
    monkeypatch.setattr(Progress, "update", lambda self, task, **f: shown.append(f.get("tps")))
    kw = {**TINY, "quiet": False, "threads": None}
    metrics = D.train(D.DemoConfig(out=str(tmp_path), steps=3, **kw), on_step=lambda s, i: threads.append(
        torch.get_num_threads()))
    assert threads == [1, 1, 1]
    assert shown[-1] == pytest.approx(metrics["tokens_per_second"], abs=0.06)


def test_cli_resume_without_checkpoint(monkeypatch, capsys, tmp_path):
    code, io = _cli(monkeypatch, capsys, "demo", "--resume", "--out", str(tmp_path))
    assert code == 2 and io.err.count("\n") == 1 and "no checkpoint" in io.err


def test_cli_out_that_is_a_file(monkeypatch, capsys, tmp_path):
    (tmp_path / "f").write_text("")
    code, io = _cli(monkeypatch, capsys, "demo", "--out", str(tmp_path / "f"))
    assert code == 2 and io.err == f"error: --out {str(tmp_path / 'f')!r} is a file: give a folder, new or existing\n"


# ---- interrupts: wherever one lands, --resume gives the uninterrupted run bit for bit ---------------------------

DROPPY = {**TINY, "dropout": 0.1, "eval_every": 3}  # dropout: the torch RNG state must be the step's too


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    T = sys.modules[D.train.__module__]
    finish, T.finish_run = T.finish_run, lambda *a: None  # the final checkpoint is written before evaluation
    try:
        D.train(D.DemoConfig(out=str(out), steps=3, **DROPPY))
    finally:
        T.finish_run = finish
    return out


def _saved(folder):
    from safetensors.torch import load_file

    state = json.loads((folder / "trainer_state.json").read_text())
    return load_file(folder / "model.safetensors"), load_file(folder / "optimizer.safetensors"), state["history"]


@pytest.mark.parametrize(
    "where",
    ["forward", "before_update", "as_update_returns", "after_step", "after_validation", "sigint_in_update",
     "sigterm_in_update"],
)  # fmt: skip
def test_interrupt_anywhere_then_resume_equals_the_uninterrupted_run(where, straight, tmp_path, monkeypatch):
    import os
    import signal

    T = sys.modules[D.train.__module__]  # the training loop's module
    calls = {"step": 0, "loss": 0}
    real_step, real_loss = torch.optim.AdamW.step, T.batch_loss

    def step(self, *a, **k):
        calls["step"] += 1
        second = calls["step"] == 2
        if second and where == "before_update":
            raise KeyboardInterrupt
        if second and where.startswith("sig"):  # a real signal in the middle of the update: held until it ends
            os.kill(os.getpid(), signal.SIGINT if where == "sigint_in_update" else signal.SIGTERM)
        out = real_step(self, *a, **k)
        if second and where == "as_update_returns":
            raise KeyboardInterrupt
        return out

    def loss(model, batch, smoothing, reduction="sum"):
        out = real_loss(model, batch, smoothing, reduction)  # the forward draws dropout seeds
        if reduction == "sum":
            calls["loss"] += 1
            if calls["loss"] == 2 and where == "forward":
                raise KeyboardInterrupt
        return out

    def on_step(s, info):
        if s == 2 and where == "after_step":
            raise KeyboardInterrupt
        if s == 3 and where == "after_validation":  # eval_every=3: the step's validation loss is in the history
            raise KeyboardInterrupt

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    monkeypatch.setattr(T, "batch_loss", loss)
    with pytest.raises(KeyboardInterrupt):
        D.train(D.DemoConfig(out=str(tmp_path), steps=3, **DROPPY), on_step=on_step)
    monkeypatch.undo()
    done = json.loads((tmp_path / "trainer_state.json").read_text())["step"]
    assert done == {"forward": 1, "before_update": 1, "after_validation": 3}.get(where, 2)
    monkeypatch.setattr(T, "finish_run", lambda *a: None)  # the final checkpoint is written before evaluation
    D.train(D.DemoConfig(out=str(tmp_path), steps=3, resume=True, **DROPPY))
    (w1, o1, h1), (w2, o2, h2) = _saved(straight), _saved(tmp_path)
    assert h1 == h2
    for a, b in ((w1, w2), (o1, o2)):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_cli_interrupt_exits_130(monkeypatch, capsys, tmp_path):
    def interrupted(cfg, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(D, "train", interrupted)
    code, io = _cli(monkeypatch, capsys, "demo", "--out", str(tmp_path))
    assert code == 130 and io.err == "interrupted\n"


def test_cli_without_arguments_prints_help_and_no_error_line(monkeypatch, capsys):
    code, io = _cli(monkeypatch, capsys)
    assert code == 2 and "demo" in io.out and "error" not in io.err


# ---- bad checkpoints, bad settings, what is printed ------------------------------------------------------------


def _copy_run(run, tmp_path):
    import shutil

    out, _ = run
    dst = tmp_path / "ckpt"
    shutil.copytree(out, dst)
    return dst


@pytest.mark.parametrize(
    "state, what",
    [
        ("[]", "expected a JSON object, got list"),
        ('{"step": 4}', "'history' is missing"),
        ('{"step": "4", "history": {}, "train_seconds": 1, "tokens_seen": 1, "param_groups": []}',
         "'step' must be an int ≥ 0"),
        ('{"step": 4, "history": {"train": 3}, "train_seconds": 1, "tokens_seen": 1, "param_groups": []}',
         r"history\['train'\] must be a list of \[step, loss\] pairs"),
        ('{"step": 4, "history": {"train": [[1, "x"]], "val": []}, "train_seconds": 1, "tokens_seen": 1, '
         '"param_groups": []}', r"history\['train'\] must be a list of \[step, loss\] pairs"),
    ],
)  # fmt: skip
def test_resume_from_a_broken_trainer_state_names_the_file(run, tmp_path, state, what):
    ckpt = _copy_run(run, tmp_path)
    (ckpt / "trainer_state.json").write_text(state)
    with pytest.raises(ValueError, match=f"trainer state {ckpt / 'trainer_state.json'} is not valid: {what}"):
        D.train(D.DemoConfig(out=str(ckpt), steps=6, resume=True, **TINY))


@pytest.mark.parametrize("name, what", [("trainer_state.json", "trainer state"), ("vocab.json", "vocabulary file"),
                                        ("config.json", "config file")])  # fmt: skip
def test_resume_from_a_file_that_is_not_utf8_names_the_file(run, tmp_path, name, what):
    ckpt = _copy_run(run, tmp_path)
    (ckpt / name).write_bytes(b"\xff\xfe")
    with pytest.raises(CheckpointError, match=f"{what} {re.escape(str(ckpt / name))} is not valid JSON: 'utf-8'"):
        D.train(D.DemoConfig(out=str(ckpt), steps=6, resume=True, **TINY))


@pytest.mark.parametrize(
    "name, damage, rule",
    [("exp_avg", lambda t: t.flatten()[:3].clone(), r"of shape \((\d+, \d+)\), got torch.float32 of shape \(3,\)"),
     ("exp_avg", lambda t: t.to(torch.int32), r"of shape \((\d+, \d+)\), got torch.int32 of shape \(\1\)"),
     ("step", lambda t: t.to(torch.int64), r"of shape \((\d+, \d+)\), got torch.int64 of shape \(\)")],
)  # fmt: skip
def test_resume_with_an_optimizer_tensor_unlike_its_parameter_names_the_file_and_tensor(run, tmp_path, name, damage,
                                                                                        rule):  # fmt: skip
    from safetensors.torch import load_file, save_file

    ckpt = _copy_run(run, tmp_path)
    path = ckpt / "optimizer.safetensors"
    tensors = load_file(path)
    tensors[f"state.0.{name}"] = damage(tensors[f"state.0.{name}"])
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=f"optimizer state {re.escape(str(path))} does not fit .*: state.0."
                       f"{name} must be a floating-point scalar, or a tensor \\(dims may be 1\\) {rule}"):  # fmt: skip
        D.train(D.DemoConfig(out=str(ckpt), steps=6, resume=True, **TINY))


def test_resume_with_a_param_group_lacking_a_setting_names_the_file(run, tmp_path):
    ckpt = _copy_run(run, tmp_path)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    del state["param_groups"][0]["betas"]
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=r"optimizer state .* does not fit .*: param group 0 lacks \['betas'\]"):
        D.train(D.DemoConfig(out=str(ckpt), steps=6, resume=True, **TINY))


@pytest.mark.parametrize("rng", [torch.zeros(3, dtype=torch.uint8), torch.zeros(5056)])
def test_resume_with_a_damaged_rng_state_names_the_file(run, tmp_path, rng):
    from safetensors.torch import load_file, save_file

    ckpt = _copy_run(run, tmp_path)
    path = ckpt / "optimizer.safetensors"
    tensors = load_file(path)
    tensors["torch_rng_state"] = rng
    save_file(tensors, path)
    before = torch.get_rng_state()
    with pytest.raises(CheckpointError, match=f"optimizer state {re.escape(str(path))} does not fit .*: "
                       r"torch_rng_state must be torch's RNG state \(uint8, \(5056,\)\), got torch"):  # fmt: skip
        D.train(D.DemoConfig(out=str(ckpt), steps=6, resume=True, **TINY))
    torch.set_rng_state(before)


def test_resume_with_a_mismatched_optimizer_state_names_the_file(run, tmp_path):
    ckpt = _copy_run(run, tmp_path)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["param_groups"] = state["param_groups"][:1]
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match=f"optimizer state {ckpt / 'optimizer.safetensors'} does not fit"):
        D.train(D.DemoConfig(out=str(ckpt), steps=6, resume=True, **TINY))


@pytest.mark.parametrize("name, value, saved", [("seed", 5, 0), ("batch_size", 4, 8), ("d_model", 32, 16),
                                                ("n_layers", 2, 1), ("dropout", 0.1, 0.0)])  # fmt: skip
def test_resume_with_another_model_or_data_order_setting_names_it(run, tmp_path, name, value, saved):
    ckpt = _copy_run(run, tmp_path)
    with pytest.raises(ValueError, match=rf"{name} \({value}\) differs from the checkpoint's \({saved}\)"):
        D.train(D.DemoConfig(out=str(ckpt), steps=6, resume=True, **{**TINY, name: value}))


@pytest.mark.parametrize("cut", ["trainer_state.json", "model.safetensors"])
def test_a_checkpoint_cut_short_between_its_files_is_refused(run, tmp_path, monkeypatch, cut):
    from sublayer.demo import checkpoint as C

    ckpt = _copy_run(run, tmp_path)  # at step 4
    real = C.atomic_write

    def killed(path, write):  # the process dies before this file is written: the files before it are new
        if path.name == cut:
            raise OSError("killed")
        real(path, write)

    monkeypatch.setattr(C, "atomic_write", killed)
    monkeypatch.setattr("sublayer.checkpoints.io.atomic_write", killed)
    with pytest.raises(OSError, match="killed"):
        D.train(D.DemoConfig(out=str(ckpt), steps=6, resume=True, **TINY))  # its last checkpoint, at step 6, dies
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=f"optimizer state {re.escape(str(ckpt / 'optimizer.safetensors'))} "
                       "has made 6 updates but trainer_state.json is at step 4: the checkpoint's files come from "
                       "different steps"):  # fmt: skip
        D.train(D.DemoConfig(out=str(ckpt), steps=8, resume=True, **TINY))


def test_resume_with_fewer_steps_than_the_checkpoint_says_so(run, tmp_path):
    ckpt = _copy_run(run, tmp_path)
    msg = f"steps (3): the checkpoint in {ckpt} is at step 4 already: nothing to train (give a larger --steps to continue)"
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        D.train(D.DemoConfig(out=str(ckpt), steps=3, resume=True, **TINY))


def test_quiet_still_prints_the_final_accuracy(run, tmp_path, capsys):
    ckpt = _copy_run(run, tmp_path)
    metrics = D.train(D.DemoConfig(out=str(ckpt), steps=4, resume=True, **TINY))  # at step 4: evaluates only
    out = capsys.readouterr().out
    assert f"exact match on 20 held-out numbers: {metrics['exact_match']:.1%}" in out
    assert "held-out samples" not in out and "wrote" not in out  # no table, no file list


def test_cli_seed_out_of_range(monkeypatch, capsys, tmp_path):
    code, io = _cli(monkeypatch, capsys, "demo", "--seed", "99999999999999999999", "--out", str(tmp_path / "o"))
    assert code == 2 and io.err == r"error: --seed must be an int in [0, 2**63), got 99999999999999999999" + "\n"


def test_sample_table_shows_each_record_once_with_labelled_columns():
    recs = [{"direction": D.DIRECTIONS[i % 2], "source": str(i), "target": str(i), "prediction": "x",
             "correct": i % 3 != 0} for i in range(20)]  # fmt: skip
    rows = D.sample_rows(recs)
    assert len({id(r) for r in rows}) == len(rows) == 10  # 4 + 4 + 2 wrong ones not shown yet
    assert sum(not r["correct"] for r in rows[8:]) == 2
    table = D.sample_table(recs)
    assert [c.header for c in table.columns] == ["direction", "source", "prediction", "correct?"]


def test_loss_curve_smoothing_has_no_lag_and_ticks_are_plain_numbers():
    assert D.smooth(list(range(30))) == pytest.approx(list(range(30)))  # a trend is kept: no lag
    step = [4.0] * 15 + [1.0] * 15
    s = D.smooth(step, window=5)
    assert s[:13] == [4.0] * 13 and s[17:] == [1.0] * 13 and s[14] + s[15] == pytest.approx(5.0)  # centred
    # a short run spanning less than a decade (the case that read "4×10⁰")
    history = {"train": [[i + 1, 4.0 - 0.1 * i] for i in range(20)], "val": [[10, 3.5], [20, 2.5]]}
    fig = D.loss_figure(history)
    fig.canvas.draw()
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels(minor=False) + ax.get_yticklabels(minor=True)]
    shown = [t for t in labels if t]
    assert shown and all(float(t) > 0 for t in shown), labels  # plain numbers: float() parses each
    smoothed = ax.get_lines()[1].get_ydata()
    assert abs(smoothed[-5] - history["train"][-5][1]) < 1e-9  # on the straight line, not lagging above it


def test_resume_takes_scalar_and_factored_optimizer_state(tmp_path):
    """NAdam's ``mu_product`` is a scalar and a factored moment keeps 1 for its reduced dim: both fit."""
    from safetensors.torch import save_file

    from sublayer.demo.checkpoint import OPTIMIZER_NAME, load_optimizer

    p = torch.nn.Parameter(torch.zeros(3, 5))
    opt = torch.optim.NAdam([p])
    p.grad = torch.ones_like(p)
    opt.step()
    saved = opt.state_dict()
    tensors = {f"state.0.{k}": v for k, v in saved["state"][0].items()} | {"state.0.row_var": torch.zeros(3, 1)}
    save_file(tensors, str(tmp_path / OPTIMIZER_NAME))
    fresh = torch.optim.NAdam([torch.nn.Parameter(torch.zeros(3, 5))])
    load_optimizer(tmp_path, fresh, saved["param_groups"])
    assert torch.equal(fresh.state_dict()["state"][0]["mu_product"], saved["state"][0]["mu_product"])
