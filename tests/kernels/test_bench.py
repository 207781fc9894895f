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
