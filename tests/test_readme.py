"""Every Python snippet of README.md runs as written (docs that drift from the code fail here).

How it works — read this before adding a snippet to the README:

- Every fenced block tagged ```python is run, each in a fresh namespace (so each snippet carries its own
  imports). Blocks tagged ```bash / ```text are not run. An untagged block fails :func:`test_every_block_is_tagged`:
  tag it (``python`` if it is Python — it will then run).
- Model folders: a snippet names one of the placeholder folders of :data:`PLACEHOLDERS` (e.g.
  ``GPT2.from_pretrained("path/to/gpt2")``). The test replaces the quoted placeholder by a tiny random Hugging
  Face model of that architecture, saved in a temporary folder, with the real model's vocabulary size — so real
  token ids (GPT-2's 464 = "The") are valid. Nothing is downloaded. Add a placeholder here if you need another.
- A block that calls ``dist.init_process_group`` is a ``torchrun`` script: it runs in a subprocess as a
  one-process ``torchrun`` would (RANK=0, WORLD_SIZE=1, a free MASTER_PORT).
- A block passes when it runs without an exception and every floating-point tensor it leaves is finite.
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
README = ROOT / "README.md"
FENCES = re.findall(r"^```([^\n]*)\n(.*?)^```", README.read_text(), flags=re.S | re.M)
BLOCKS = [code for info, code in FENCES if info.split()[:1] == ["python"]]

# placeholder folder in the README -> (architecture, the real model's vocabulary size)
PLACEHOLDERS = {
    "path/to/gpt2": ("gpt2", 50257),
    "path/to/all-MiniLM-L6-v2": ("bert", 30522),
}


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory):
    """Lazily saved tiny HF folders, one per placeholder (only the snippets that name one need transformers)."""
    made: dict[str, Path] = {}

    def folder(placeholder: str) -> Path:
        if placeholder not in made:
            pytest.importorskip("transformers")
            from tests.models.conftest import make_hf_bert, make_hf_gpt2

            arch, vocab = PLACEHOLDERS[placeholder]
            model = make_hf_gpt2(vocab_size=vocab, n_positions=64) if arch == "gpt2" else make_hf_bert(vocab_size=vocab)
            made[placeholder] = tmp_path_factory.mktemp(arch)
            model.save_pretrained(made[placeholder])
        return made[placeholder]

    return folder


def test_readme_has_python_examples():
    assert BLOCKS, "README.md should carry at least the quickstart example"


def test_every_block_is_tagged():
    untagged = [code.splitlines()[0] if code.strip() else "" for info, code in FENCES if not info.strip()]
    assert not untagged, f"README code blocks without a language (```python, ```bash, ```text): {untagged}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code, model_folders, tmp_path):
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
    exec(compile(code, str(README), "exec"), ns)  # noqa: S102 - our own README
    tensors = [v for v in ns.values() if isinstance(v, torch.Tensor)]
    assert all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())
