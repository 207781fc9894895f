"""Every Python snippet of README.md and docs/*.md runs as written (docs that drift from the code fail here).

How it works — read this before adding a snippet to the README or a guide:

- Every fenced block tagged ```python is run, each in a fresh namespace (so each snippet carries its own
  imports). Blocks tagged ```bash / ```text are not run. An untagged block fails :func:`test_every_block_is_tagged`:
  tag it (``python`` if it is Python — it will then run).
- Model folders: a snippet names one of the placeholder folders of :data:`PLACEHOLDERS` (e.g.
  ``GPT2.from_pretrained("path/to/gpt2")``). The test replaces the quoted placeholder by a tiny random Hugging
  Face model of that architecture, saved in a temporary folder, with the real model's vocabulary size — so real
  token ids (GPT-2's 464 = "The") are valid — and a small word-level tokenizer (``sublayer.text`` reads it). Nothing is downloaded. Add a placeholder here if you need another.
- A block that calls ``dist.init_process_group`` is a ``torchrun`` script: it runs in a subprocess as a
  one-process ``torchrun`` would (RANK=0, WORLD_SIZE=1, a free MASTER_PORT).
- A block passes when it runs without an exception and every floating-point tensor it leaves is finite.
- Keep snippets fast: tiny models, a few steps.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
FENCES = {doc: FENCE.findall(doc.read_text()) for doc in DOCS}
BLOCKS = [
    pytest.param(doc, code, id=f"{doc.stem}-block{i}")
    for doc, fences in FENCES.items()
    for i, code in enumerate(code for info, code in fences if info.split()[:1] == ["python"])
]

# placeholder folder in the docs -> (architecture, the real model's vocabulary size)
PLACEHOLDERS = {
    "path/to/gpt2": ("gpt2", 50257),
    "path/to/all-MiniLM-L6-v2": ("bert", 30522),
    "path/to/SmolLM2-135M": ("llama", 49152),
}


def _tiny_llama(vocab: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=30, intermediate_size=22, num_hidden_layers=2, num_attention_heads=5,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def _word_tokenizer(arch: str):
    """The tests' WordLevel tokenizer as an HF tokenizer folder would hold it (``tokenizer_config.json`` too)."""
    import transformers

    from tests.models.conftest import word_tokenizer

    specials = {"pad_token": "[PAD]", "unk_token": "[UNK]"}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=word_tokenizer(bert=arch == "bert"), **specials)


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory):
    """Lazily saved tiny HF folders, one per placeholder (only the snippets that name one need transformers)."""
    made: dict[str, Path] = {}

    def folder(placeholder: str) -> Path:
        if placeholder not in made:
            pytest.importorskip("transformers")
            from tests.models.conftest import make_hf_bert, make_hf_gpt2

            arch, vocab = PLACEHOLDERS[placeholder]
            if arch == "gpt2":
                model = make_hf_gpt2(vocab_size=vocab, n_positions=64)
            elif arch == "bert":
                model = make_hf_bert(vocab_size=vocab)
            else:
                model = _tiny_llama(vocab)
            made[placeholder] = tmp_path_factory.mktemp(arch)
            model.save_pretrained(made[placeholder])
            _word_tokenizer(arch).save_pretrained(made[placeholder])  # small ids: valid in every vocabulary
        return made[placeholder]

    return folder


def test_readme_has_python_examples():
    assert any(doc.name == "README.md" for doc, _ in (p.values[:2] for p in BLOCKS)), "README.md needs a quickstart"
    assert len(DOCS) > 1, "the guides live in docs/*.md"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.stem)
def test_every_block_is_tagged(doc):
    untagged = [code.splitlines()[0] if code.strip() else "" for info, code in FENCES[doc] if not info.strip()]
    assert not untagged, f"{doc.name}: code blocks without a language (```python, ```bash, ```text): {untagged}"


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub makes of a markdown file's headings (lower case, punctuation dropped, spaces -> '-')."""
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", path.read_text()), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.stem)
def test_relative_links_resolve(doc):
    """Every relative link ([text](path) or [text](path#anchor)) names a file or folder of the repository, and an
    anchor names a heading of that file."""
    text = FENCE.sub("", doc.read_text())
    links = re.findall(r"\]\((?!https?://|mailto:)([^)\s]*)\)", text)
    missing = []
    for link in links:
        path, _, anchor = link.partition("#")
        target = doc.parent / path if path else doc
        if not target.exists() or (anchor and target.suffix == ".md" and anchor not in _anchors(target)):
            missing.append(link)
    assert not missing, f"{doc.name}: links to missing files or headings: {missing}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("doc", "code"), BLOCKS)
def test_example_runs(doc, code, model_folders, tmp_path):
    for placeholder in PLACEHOLDERS:
        for quote in "\"'":
            if f"{quote}{placeholder}{quote}" in code:
                code = code.replace(f"{quote}{placeholder}{quote}", repr(str(model_folders(placeholder))))
    if "init_process_group" in code:  # a torchrun script: one process of it
        script = tmp_path / "snippet.py"
        script.write_text(code)
        env = dict(
            os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()), PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        )  # fmt: skip
        res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        return
    torch.manual_seed(0)
    ns: dict = {}
    cwd = os.getcwd()
    os.chdir(tmp_path)  # a snippet that writes a file writes it here
    try:
        exec(compile(code, str(doc), "exec"), ns)  # noqa: S102 - our own docs
    finally:
        os.chdir(cwd)
    tensors = [v for v in ns.values() if isinstance(v, torch.Tensor)]
    assert all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())
