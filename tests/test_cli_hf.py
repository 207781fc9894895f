"""``sublayer generate`` and ``sublayer embed`` on tiny HF-format folders (random weights, a WordLevel
``tokenizer.json`` built in the test): outputs equal the library calls; errors are one line with exit code 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from torch.testing import assert_close

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from sublayer.cli import CLIError, main  # noqa: E402
from sublayer.models import GPT2, Bert  # noqa: E402
from tests.models.conftest import MAX_POS, make_hf_bert, make_hf_gpt2, word_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli_gpt2")
    make_hf_gpt2().save_pretrained(folder)
    word_tokenizer().save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli_bert")
    make_hf_bert().save_pretrained(folder)
    word_tokenizer(bert=True).save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture
def cli(monkeypatch, capsys):
    """Run ``sublayer ARGS`` in-process through ``main()``: (exit code, stdout, stderr)."""

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()  # drop what the fixtures printed (HF progress bars)
        monkeypatch.setattr(sys, "argv", ["sublayer", *map(str, args)])
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def _one_line_error(code: int, err: str, match: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err
    assert match in lines[0], lines[0]
    assert match in lines[0], lines[0]


# ---- generate ------------------------------------------------------------------------------------------------


def test_generate_ids_equals_library_greedy(cli, gpt2_dir):
    code, out, err = cli("generate", "--model", gpt2_dir, "5 9 11", "--max-new-tokens", "6")
    assert code == 0 and re.fullmatch(r"6 new tokens in [0-9.]+ s: [0-9.]+ tokens/s\n", err)
    model = GPT2.from_pretrained(gpt2_dir).eval()
    want = model.generate(torch.tensor([[5, 9, 11]]), 6, eos_token_id=model.config.eos_token_id)[0].tolist()
    assert out.split() == [str(t) for t in want]
    code2, out2, _ = cli("generate", "-m", gpt2_dir, "5,9,11", "-n", "6")  # commas and short options
    assert (code2, out2) == (0, out)


def test_generate_text_uses_tokenizer_json(cli, gpt2_dir):
    code, out, _ = cli("generate", "--model", gpt2_dir, "the quick brown fox", "--max-new-tokens", "4")
    assert code == 0
    tok = word_tokenizer()
    model = GPT2.from_pretrained(gpt2_dir).eval()
    ids = torch.tensor([tok.encode("the quick brown fox").ids])
    want = tok.decode(model.generate(ids, 4, eos_token_id=model.config.eos_token_id)[0].tolist())
    assert out.strip() == want and out.startswith("the quick brown fox")


def test_generate_sampling_seeded(cli, gpt2_dir):
    args = ("generate", "--model", gpt2_dir, "5 9 11", "-n", "10", "--temperature", "1.5")
    a, b = cli(*args, "--seed", "1"), cli(*args, "--seed", "1")
    c = cli(*args, "--seed", "2")
    assert a[0] == 0 and a[:2] == b[:2] and a[1] != c[1]  # stderr carries the (varying) tokens/s
    greedy = cli("generate", "--model", gpt2_dir, "5 9 11", "-n", "10")
    assert cli("generate", "--model", gpt2_dir, "5 9 11", "-n", "10", "--sample", "--top-k", "1")[1] == greedy[1]
    assert cli(*args[:6], "--top-p", "0.9", "--seed", "3")[0] == 0


def test_generate_text_without_tokenizer(cli, tmp_path):
    make_hf_gpt2().save_pretrained(tmp_path)
    code, _, err = cli("generate", "--model", tmp_path, "hello world")
    _one_line_error(code, err, f"needs a tokenizer file, but {tmp_path / 'tokenizer.json'} does not exist")


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("--model", "{missing}", "1 2"), "error: --model: checkpoint folder not found: {missing}"),
        (("--model", "{gpt2}", "1 2", "-n", str(MAX_POS)),
         f"error: prompt length 2 + --max-new-tokens {MAX_POS} exceeds max_positions={MAX_POS}"),
        (("--model", "{gpt2}", "1 2", "--top-p", "2"), "error: --top-p must be in (0, 1], got 2.0"),
        (("--model", "{gpt2}", "1 2", "--temperature", "0"), "error: --temperature must be a float > 0 to sample, got 0.0"),
        (("--model", "{gpt2}", "1 2", "--top-k", "-2"), "error: --top-k must be a positive int, got -2"),
        (("--model", "{gpt2}", "1 2", "--seed", str(2**70)), f"error: --seed must be in [-2**63, 2**64), got {2**70}"),
        (("--model", "{gpt2}", "1 999"), "input_ids must lie in [0, vocab_size=53)"),
        (("--model", "{gpt2}", "1 " + str(2**64)), f"input_ids must lie in [0, vocab_size=53), got {2**64}"),
        (("--model", "{gpt2}", "   "), "the prompt is empty"),
        (("--model", "{bert}", "1 2"),
         "error: --model '{bert}' has model_type 'bert' in config.json: generate supports gpt2, llama, qwen2"),
    ],
)
def test_generate_errors_are_one_line(cli, gpt2_dir, bert_dir, tmp_path, args, match):
    fill = {k: str(v) for k, v in {"missing": tmp_path / "missing", "gpt2": gpt2_dir, "bert": bert_dir}.items()}
    code, _, err = cli("generate", *(a.format(**fill) for a in args))
    _one_line_error(code, err, match.format(**fill))


def test_embed_missing_folder_is_named_before_its_tokenizer(cli, tmp_path):
    code, _, err = cli("embed", "--model", tmp_path / "nope", "hello")
    _one_line_error(code, err, f"error: --model: checkpoint folder not found: {tmp_path / 'nope'} (a local folder")


def test_a_model_name_resolves_through_the_local_hub_cache(cli, gpt2_dir, tmp_path, monkeypatch):
    import shutil

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError, match=r"checkpoint folder not found: tiny/gpt2 \(a local folder .* "
                       r"`hf download MODEL --local-dir DIR`.* local Hugging Face cache .*hub\)"):
        GPT2.from_pretrained("tiny/gpt2")
    repo = tmp_path / "hub" / "models--tiny--gpt2"
    shutil.copytree(gpt2_dir, repo / "snapshots" / "abc123")
    shutil.copytree(gpt2_dir, repo / "snapshots" / "old999")
    (repo / "snapshots" / "old999" / "config.json").write_text("{}")  # not the one refs/main names
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    x = torch.tensor([[5, 6, 7]])
    assert torch.equal(GPT2.from_pretrained("tiny/gpt2")(x), GPT2.from_pretrained(gpt2_dir)(x))
    code, out, _ = cli("generate", "--model", "tiny/gpt2", "-n", "3", "5 6 7")
    assert code == 0 and out == cli("generate", "--model", gpt2_dir, "-n", "3", "5 6 7")[1]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_generate_picks_the_class_from_model_type(cli, tmp_path, kind):
    import transformers

    from sublayer.models import Llama, quantized

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    torch.manual_seed(0)
    config = config_cls(
        vocab_size=53, hidden_size=10, intermediate_size=7, num_hidden_layers=1, num_attention_heads=5,
        num_key_value_heads=1, eos_token_id=2,
    )  # fmt: skip
    model_cls(config).save_pretrained(tmp_path)
    code, out, _ = cli("generate", "--model", tmp_path, "5 9 11", "-n", "6")
    assert code == 0
    want = Llama.from_pretrained(tmp_path).generate(torch.tensor([[5, 9, 11]]), 6, eos_token_id=2)[0].tolist()
    assert out.split() == [str(i) for i in want]
    code, out8, _ = cli("generate", "--model", tmp_path, "5 9 11", "-n", "6", "--quantize", "int8")
    assert code == 0
    int8 = quantized.quantize(Llama.from_pretrained(tmp_path))
    assert out8.split() == [str(i) for i in int8.generate(torch.tensor([[5, 9, 11]]), 6, eos_token_id=2)[0].tolist()]


def test_bad_tokenizer_file(cli, tmp_path):
    make_hf_gpt2().save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    code, _, err = cli("generate", "--model", tmp_path, "hello")
    _one_line_error(code, err, f"cannot read tokenizer file {tmp_path / 'tokenizer.json'}")


def test_debug_shows_the_exception(cli, tmp_path):
    with pytest.raises(FileNotFoundError, match="needs a tokenizer file"):
        cli("--debug", "generate", "--model", tmp_path, "hello")
    with pytest.raises(CLIError, match="--quantize must be one of int8"):
        cli("--debug", "generate", "--model", tmp_path, "--quantize", "int4", "hello")


def test_real_entry_point_exit_code(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "sublayer.cli", "generate", "--model", str(tmp_path / "none"), "1 2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: --model: checkpoint folder not found: {tmp_path / 'none'} (a local folder")
    assert proc.stderr.count("\n") == 1


def _run_without(packages: tuple[str, ...], code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter where importing any of ``packages`` fails as if it were not installed."""
    block = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {packages!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    return subprocess.run([sys.executable, "-c", block + code], capture_output=True, text=True, timeout=120)


def test_info_without_the_cli_extra_prints_only_its_hint():
    proc = _run_without(("typer", "numpy"), "sys.argv = ['sublayer', 'info']\nfrom sublayer.cli import main\nmain()")
    assert proc.returncode == 2
    assert proc.stderr == "error: 'typer' is not installed (sublayer's cli extra): pip install typer rich matplotlib " \
        "tokenizers\n"


def test_commands_silence_transformers_notices_and_progress_bars(gpt2_dir):
    code = (
        "import sys\nsys.argv = ['sublayer', 'generate', '--model', sys.argv[1], '-n', '1', '5 6']\n"
        "from sublayer.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "import huggingface_hub.utils as u\nfrom transformers.utils import logging\n"
        "print(logging.get_verbosity(), u.are_progress_bars_disabled())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(gpt2_dir)], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if not k.startswith(("TRANSFORMERS_", "HF_HUB_D"))})
    assert proc.stdout.splitlines()[-1] == "40 True"  # logging.ERROR


# ---- embed ---------------------------------------------------------------------------------------------------


def test_embed_names_a_sentence_transformers_config_that_is_not_json(cli, bert_dir, tmp_path):
    import shutil

    folder = shutil.copytree(bert_dir, tmp_path / "b")
    (folder / "sentence_bert_config.json").write_bytes(b"\xff\xfe")
    code, _, err = cli("embed", "--model", folder, "hello")
    _one_line_error(code, err, f"sentence-transformers config {folder / 'sentence_bert_config.json'} is not valid JSON")


def test_embed_prints_json_vectors_equal_to_library(cli, bert_dir):
    texts = ["the cat sat on a mat", "hello world", "big dog"]
    code, out, _ = cli("embed", "--model", bert_dir, *texts)
    assert code == 0
    rows = json.loads(out)
    assert [r["text"] for r in rows] == texts
    got = torch.tensor([r["embedding"] for r in rows])
    tok = word_tokenizer(bert=True)
    model = Bert.from_pretrained(bert_dir).eval()
    with torch.no_grad():
        for text, vec in zip(texts, got):  # each text alone, no padding
            ids = torch.tensor([tok.encode(text).ids])
            assert ids[0, 0] == 2 and ids[0, -1] == 3  # [CLS] ... [SEP]
            assert_close(vec, model.embed(ids)[0])
    assert_close(got.norm(dim=-1), torch.ones(3))


def test_embed_truncates_long_text(cli, bert_dir):
    code, out, _ = cli("embed", "--model", bert_dir, " ".join(["sun"] * (MAX_POS + 9)))
    assert code == 0 and len(json.loads(out)[0]["embedding"]) == 15


def test_embed_quantize_int8(cli, bert_dir, tmp_path):
    import shutil

    from sublayer.models import quantized

    texts = ["the cat sat on a mat", "hello world"]
    _, out, _ = cli("embed", "--model", bert_dir, *texts)
    code, out8, _ = cli("embed", "--model", bert_dir, "--quantize", "int8", *texts)
    assert code == 0
    f32, i8 = (torch.tensor([r["embedding"] for r in json.loads(o)]) for o in (out, out8))
    assert not torch.equal(f32, i8) and float((f32 * i8).sum(-1).min()) > 0.99
    quantized.quantize(Bert.from_pretrained(bert_dir)).save_pretrained(tmp_path)  # a saved int8 folder loads as is
    shutil.copy(bert_dir / "tokenizer.json", tmp_path)
    code, saved, _ = cli("embed", "--model", tmp_path, *texts)
    assert code == 0 and torch.equal(torch.tensor([r["embedding"] for r in json.loads(saved)]), i8)
    code, _, err = cli("embed", "--model", bert_dir, "--quantize", "int4", "hello")
    _one_line_error(code, err, "error: --quantize must be one of int8, got 'int4'")


def test_generate_quantize_int8(cli, gpt2_dir, bert_dir, tmp_path):
    import shutil

    from sublayer.models import quantized

    code, out8, _ = cli("generate", "--model", gpt2_dir, "--quantize", "int8", "-n", "6", "5 6 7")
    assert code == 0
    want = quantized.quantize(GPT2.from_pretrained(gpt2_dir)).generate(torch.tensor([[5, 6, 7]]), 6, eos_token_id=2)
    assert out8.split() == [str(i) for i in want[0].tolist()]
    quantized.quantize(GPT2.from_pretrained(gpt2_dir)).save_pretrained(tmp_path / "g")  # a saved int8 folder
    shutil.copy(gpt2_dir / "tokenizer.json", tmp_path / "g")
    code, saved, _ = cli("generate", "--model", tmp_path / "g", "-n", "6", "5 6 7")
    assert code == 0 and saved == out8
    code, _, err = cli("generate", "--model", gpt2_dir, "--quantize", "int4", "5 6")
    _one_line_error(code, err, "error: --quantize must be one of int8, got 'int4'")
    quantized.quantize(Bert.from_pretrained(bert_dir)).save_pretrained(tmp_path / "b")
    code, _, err = cli("generate", "--model", tmp_path / "b", "5 6")
    _one_line_error(code, err, "holds a quantized QuantizedBert, not a causal LM")
    code, _, err = cli("embed", "--model", tmp_path / "g", "hello")
    _one_line_error(code, err, "holds a quantized QuantizedCausalLM, not a BERT")


def test_embed_errors(cli, bert_dir, gpt2_dir, tmp_path):
    make_hf_bert().save_pretrained(tmp_path)
    code, _, err = cli("embed", "--model", tmp_path, "hello")
    _one_line_error(code, err, "embed needs a tokenizer file")
    code, _, err = cli("embed", "--model", gpt2_dir, "hello")
    _one_line_error(code, err, "model_type must be 'bert' for BERT, got 'gpt2'")
    code, _, err = cli("embed", "--model", bert_dir)
    assert code == 2 and "Missing" in err and "texts" in err.lower()  # a usage error, exit 2


def test_generate_stream_prints_the_same_text(cli, gpt2_dir):
    code, out, _ = cli("generate", "--model", gpt2_dir, "the quick brown fox", "-n", "7")
    code2, streamed, err = cli("generate", "--model", gpt2_dir, "the quick brown fox", "-n", "7", "--stream")
    assert code == code2 == 0 and streamed == out and err == ""


def test_generate_errors_name_the_flags_not_the_library_arguments(cli, gpt2_dir, tmp_path):
    code, out, err = cli("generate", "--model", gpt2_dir, "the quick", "-n", str(MAX_POS), "--stream")
    _one_line_error(code, err, f"error: prompt length 2 + --max-new-tokens {MAX_POS} exceeds max_positions={MAX_POS}")
    assert out == ""  # the prompt is not printed before the error
    make_hf_gpt2().save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_length": 2}))
    code, _, err = cli("generate", "--model", tmp_path, "5 6 7")
    _one_line_error(code, err, "error: --max-new-tokens is not given and generation_config.max_length=2 leaves no "
                               "room after the prompt's 3 tokens: pass --max-new-tokens")


def test_generate_text_stops_at_eos(cli, gpt2_dir):
    tok = word_tokenizer()
    model = GPT2.from_pretrained(gpt2_dir)
    for prompt in ("the cat", "hello world", "big dog", "sun", "the quick brown fox", "a red ball"):
        ids = tok.encode(prompt).ids
        new = model.generate(torch.tensor([ids]), 12)[0, len(ids):].tolist()
        if 2 in new:  # the eos id (the tokenizer's [CLS]): the text ends before it
            code, out, _ = cli("generate", "--model", gpt2_dir, prompt, "-n", "12")
            assert code == 0 and out.strip() == tok.decode(ids + new[: new.index(2)])
            return
    pytest.skip("no prompt reaches the eos id")


def test_embed_batch_size_gives_the_same_vectors(cli, bert_dir):
    texts = ["the cat sat on a mat", "hello world", "big dog"]
    one = torch.tensor([r["embedding"] for r in json.loads(cli("embed", "--model", bert_dir, *texts)[1])])
    code, out, _ = cli("embed", "--model", bert_dir, "--batch-size", "1", *texts)
    assert code == 0
    assert_close(torch.tensor([r["embedding"] for r in json.loads(out)]), one)
    code, _, err = cli("embed", "--model", bert_dir, "--batch-size", "0", "hello")
    _one_line_error(code, err, "error: --batch-size must be a positive int, got 0")


def test_bench_contention_needs_jobs(cli):
    code, _, err = cli("bench", "--contention")
    _one_line_error(code, err, "--contention needs --jobs")


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("--decode", "--jobs"), "error: --decode and --jobs are two benchmarks: give one of them"),
        (("--only", "decode"), "error: --only needs --jobs"),
        (("--jobs", "--malloc", "reuse"), "error: --malloc applies to the kernel benchmark, not to --jobs"),
        (("--decode", "--cases", "ffn"), "error: --cases applies to the kernel benchmark, not to --decode"),
        (("--decode", "--model", "{tmp}"), "error: --model, --report and --notes do not apply to --decode"),
        (("--jobs", "--only", " "), "error: --only must name at least one job, got ''"),
        (("--jobs", "--model", "{tmp}/nope"), "error: --model: checkpoint folder not found: {tmp}/nope"),
        (("--dtypes", "int8", "--model", "{tmp}/nope"), "error: --model: checkpoint folder not found: {tmp}/nope"),
        (("--report", "/proc/nope/r.md"), "error: --report: cannot write /proc/nope/r.md"),
        (("--report", "{tmp}"), "error: --report: {tmp} is a folder; give a .md file"),
    ],
)
def test_bench_flags_are_checked_before_any_work(cli, tmp_path, args, match):
    tmp_path = tmp_path / "x.md"  # a folder named like a report file
    tmp_path.mkdir()
    code, _, err = cli("bench", *(a.format(tmp=tmp_path) for a in args))
    _one_line_error(code, err, match.format(tmp=tmp_path))
