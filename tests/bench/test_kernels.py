"""`sublayer bench` plumbing on a tiny shape (the timings themselves are not tested)."""

from __future__ import annotations

import json

import pytest

from sublayer import kernels, memory
from sublayer.bench import kernels as bench

TINY = bench.Shape("tiny", 1, 8, 16, 32, 2)


def _here() -> str:
    """The allocator setting this test process has (measured in-process: no child process)."""
    return "reuse" if memory.memory_reuse_active() else "default"


def test_quick_bench_writes_json_markdown_and_png(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "QUICK_SHAPES", [TINY])
    here = _here()
    rows = bench.run_bench(tmp_path, quick=True, reps=1, malloc=here, log=lambda s: None)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert len(data["rows"]) == len(rows) > 0
    assert {r["malloc"] for r in data["rows"]} == {here}
    assert data["meta"]["malloc"] == bench.MALLOC_SETTINGS[here]
    assert data["meta"]["allocator"][here] == memory.allocator_setting()
    assert all(set(r["faults"]) >= {r["base"], "sublayer"} for r in data["rows"])  # page faults counted per call
    cases = {r["case"].split(" ")[0] for r in data["rows"]}
    assert {"Add&Norm", "FFN", "EncoderBlock"} <= cases
    for r in data["rows"]:
        assert r["times_ms"][r["base"]] > 0 and r["times_ms"]["sublayer"] > 0
    ffn = next(r for r in data["rows"] if r["case"].startswith("FFN") and r["mode"] == "training")
    if kernels.available():
        assert ffn["extra"]["saved ratio"] <= 0.6  # the input and one hidden tensor, no mask
    else:  # switched off (SUBLAYER_KERNELS=0): the reference FFN saves what eager torch saves
        assert ffn["extra"]["saved ratio"] == 1.0
    bert = [r for r in data["rows"] if r["case"].startswith("BERT inference")]
    assert bert and bert[0]["times_ms"]["sublayer autocast"] > 0  # our plain Bert under HF's autocast
    assert bert[0]["extra"]["plain Bert autocast x vs HF autocast"] > 0
    md = (tmp_path / "bench.md").read_text()
    assert "| case | shape | dtype | mode | eager ms | sublayer ms | ratio | faults |" in md
    assert f"All columns: {bench.MALLOC_SETTINGS[here]}." in md  # the report states the allocator setting
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_both_allocator_settings_side_by_side_without_changing_this_process(tmp_path, monkeypatch):
    # the setting this process lacks runs in a child process; this process's own setting stays as it was
    monkeypatch.setattr(bench, "QUICK_SHAPES", [TINY])
    before = memory.memory_reuse_active()
    lines: list[str] = []
    bench.run_bench(tmp_path, quick=True, reps=1, dtypes="fp32", cases="addnorm", clock="cpu", log=lines.append)
    assert memory.memory_reuse_active() == before
    data = json.loads((tmp_path / "bench.json").read_text())
    by = {(r["malloc"], r["mode"]) for r in data["rows"]}
    assert by == {(m, mode) for m in ("default", "reuse") for mode in ("training", "forward")}
    assert data["meta"]["allocator"]["default"].startswith("glibc default")
    assert "memory reuse on" in data["meta"]["allocator"]["reuse"]
    md = (tmp_path / "bench.md").read_text()
    assert "| reuse: eager ms | reuse: sublayer ms | reuse: ratio | reuse: faults |" in md
    assert "Columns without a prefix: glibc default; 'reuse:' columns: memory reuse" in md
    assert "ms of CPU time" in md
    assert any(ln.startswith("[reuse  ] Add&Norm") for ln in lines)  # the child's rows are logged too
    assert any(ln.startswith("[default] Add&Norm") for ln in lines)


def test_bad_options():
    with pytest.raises(ValueError, match="matches none"):
        bench.run_bench("unused", quick=True, shapes="nope")
    with pytest.raises(ValueError, match="dtypes"):
        bench.run_bench("unused", quick=True, dtypes="fp16")
    with pytest.raises(ValueError, match="cases must be a comma-separated subset of addnorm,ffn"):
        bench.run_bench("unused", quick=True, cases="addnorm,gemm")
    with pytest.raises(ValueError, match="cases must be a comma-separated subset of addnorm,ffn.*, got ''"):
        bench.run_bench("unused", quick=True, cases="")
    with pytest.raises(ValueError, match="--shapes ' ' matches none"):
        bench.run_bench("unused", quick=True, shapes=" ")
    with pytest.raises(ValueError, match="malloc must be one of default, reuse, both, got 'jemalloc'"):
        bench.run_bench("unused", quick=True, malloc="jemalloc")
    with pytest.raises(ValueError, match="clock must be wall or cpu, got 'gpu'"):
        bench.run_bench("unused", quick=True, clock="gpu")


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
    from sublayer import memory

    here = "reuse" if memory.memory_reuse_active() else "default"  # in this process (a child would see transformers)
    rows = bench.run_bench(tmp_path, quick=True, reps=1, dtypes="fp32", malloc=here, log=lines.append)
    assert any("transformers is not installed: skipping the Hugging Face rows" in s for s in lines)
    assert rows and not [r.case for r in rows if "HF" in r.case or "BERT" in r.case]


def test_int8_dtype_adds_the_int8_bert_row_against_the_fp32_fast_path(tmp_path):
    rows = bench.run_bench(tmp_path, quick=True, reps=1, dtypes="int8", cases="addnorm", malloc=_here(),
                           report=tmp_path / "r.md", log=lambda s: None)  # fmt: skip
    row, vs_bf16 = rows
    assert row.case.startswith("BERT int8 inference") and row.base == "sublayer fp32" and row.ratio() > 0
    assert vs_bf16.case.startswith("BERT int8 inference vs our bf16") and vs_bf16.base == "sublayer bf16"
    assert "| BERT int8 inference (random tiny) |" in (tmp_path / "r.md").read_text()
