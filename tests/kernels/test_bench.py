"""`sublayer bench` plumbing on a tiny shape (the timings themselves are not tested)."""

from __future__ import annotations

import json

import pytest

from sublayer import bench


def test_quick_bench_writes_json_markdown_and_png(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "QUICK_SHAPES", [bench.Shape("tiny", 1, 8, 16, 32, 2)])
    rows = bench.run_bench(tmp_path, quick=True, reps=1, log=lambda s: None)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert len(data["rows"]) == len(rows) > 0
    cases = {r["case"].split(" ")[0] for r in data["rows"]}
    assert {"Add&Norm", "FFN", "EncoderBlock"} <= cases
    for r in data["rows"]:
        assert r["times_ms"]["eager"] > 0 and r["times_ms"]["sublayer"] > 0
    ffn = next(r for r in data["rows"] if r["case"].startswith("FFN") and r["mode"] == "training")
    assert ffn["extra"]["saved ratio"] <= 0.6  # the input and one hidden tensor, no mask
    md = (tmp_path / "bench.md").read_text()
    assert "| case | shape | dtype | mode | eager ms | sublayer ms | ratio |" in md
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_bad_options():
    with pytest.raises(ValueError, match="matches none"):
        bench.run_bench("unused", quick=True, shapes="nope")
    with pytest.raises(ValueError, match="dtypes"):
        bench.run_bench("unused", quick=True, dtypes="fp16")


def test_bench_png_has_whole_labels_and_the_values():
    rows = [bench.Row("FFN vs nn.Sequential", "tiny 1x8 d16", "fp32", mode, {"eager": 2.0, "sublayer": t})
            for mode, t in (("forward", 1.0), ("training", 4.0))]  # fmt: skip
    fig = bench._figure(rows)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["FFN tiny fp32 forward", "FFN tiny fp32 training"]  # was cut to "forwa"
    assert [t.get_text() for t in ax.texts] == ["2.00×", "0.50×"]  # the ratio on each bar


def test_bench_without_transformers_says_it_skips_the_hf_rows(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    monkeypatch.setattr(bench, "QUICK_SHAPES", [bench.Shape("tiny", 1, 8, 16, 32, 2)])
    lines = []
    rows = bench.run_bench(tmp_path, quick=True, reps=1, dtypes="fp32", log=lines.append)
    assert any("transformers is not installed: skipping the Hugging Face rows" in s for s in lines)
    assert rows and not any("HF" in r.case or "BERT" in r.case for r in rows)
