"""The README's Python examples run as written (docs that drift from the code fail here)."""

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_examples():
    assert BLOCKS, "README.md should carry at least the quickstart example"


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code):
    torch.manual_seed(0)
    ns: dict = {}
    exec(compile(code, str(README), "exec"), ns)  # noqa: S102 - our own README
    tensors = [v for v in ns.values() if isinstance(v, torch.Tensor)]
    assert tensors and all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())
