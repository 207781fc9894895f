"""docs/architecture.md's table of model-specific lines per execution path: every count in it is recomputed here
from the source, so the table cannot drift from the code it describes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import sublayer

SRC = Path(sublayer.__file__).resolve().parent
DOC = SRC.parents[1] / "docs" / "architecture.md"


def lines(rel: str) -> int:
    return len((SRC / rel).read_text().splitlines())


def span(rel: str, *names: str) -> int:
    """Physical lines of the named top-level or class-level definitions of a Python file (decorators included)."""
    total, found = 0, set()
    for node in ast.walk(ast.parse((SRC / rel).read_text())):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            total += node.end_lineno - start + 1
            found.add(node.name)
    assert found == set(names), f"{rel}: {set(names) - found} not found"
    return total


def cpp_span(rel: str, name: str) -> int:
    """Lines of a C++ function from its signature to its closing brace at column 0."""
    text = (SRC / rel).read_text().splitlines()
    start = next(i for i, ln in enumerate(text) if re.match(rf"^\w[\w:<> ]* {name}\(", ln))
    end = next(i for i in range(start, len(text)) if text[i] == "}")
    return end - start + 1


def test_the_per_path_counts_are_the_sources():
    doc = DOC.read_text()
    transformer_step = span("models/decoding.py", "transformer_supports", "_build_transformer", "_flat_transformer",
                            "transformer_stepper")  # fmt: skip
    rows = [
        f"| definition (model file) | {lines('models/gpt2.py')} (`gpt2.py`) | {lines('models/llama.py')} (`llama.py`) | "
        f"{lines('models/bert.py')} (`bert.py`) | {lines('models/transformer.py')} (`transformer.py`, its own folders "
        "included) |",
        f"| checkpoint key map | {lines('checkpoints/gpt2.py')} | {lines('checkpoints/llama.py')} | "
        f"{lines('checkpoints/bert.py')} | — (own format) |",
        f"| model-level parts for the engine (`causal_parts()`) | {span('models/gpt2.py', 'causal_parts')} | "
        f"{span('models/llama.py', 'causal_parts')} | — | — |",
        f"| {transformer_step} (`decoding.py`'s Transformer functions) + {lines('models/fast_encode.py')} "
        f"(`fast_encode.py`) + {cpp_span('kernels/csrc/decode_step.cpp', 'transformer_decode_layers')} C++ "
        "(`decode_step.cpp`'s `transformer_decode_layers`) |",
        f"| {lines('models/prepared_bert.py')} (`prepared_bert.py`: the prepared forward, shared with int8) + "
        f"{span('models/fast.py', 'FastBert')} (`FastBert`);",
        f"| {span('models/quantized.py', 'QuantizedBert')} (`QuantizedBert`: calibration, smoothing, folders) |",
        f"| {span('hf.py', '_pack_bert_weights', '_qkv_weights')} (`hf.py`: HF's module names for "
        "`runtime/encoder.py`'s layer loop) |",
        f"`models/causal_lm.py` ({lines('models/causal_lm.py')} lines:",
        f"`runtime/causal.py` ({lines('runtime/causal.py')} lines)",
    ]
    for row in rows:
        assert row in " ".join(doc.split()), f"docs/architecture.md does not say: {row}"
