"""``sublayer bench --jobs --quick``: every whole job's rows on tiny shapes, and the report they make (the timings
themselves are not tested)."""

from __future__ import annotations

import pytest

from sublayer.bench import harness, jobs

pytest.importorskip("transformers")  # the training and embedding rows' peer


@pytest.mark.filterwarnings("ignore")
def test_quick_jobs_time_each_row_against_its_peer_and_write_the_report(tmp_path):
    lines: list[str] = []
    rows = jobs.run_jobs(quick=True, reps=1, work=tmp_path / "work", report=tmp_path, notes="shared", log=lines.append)
    by_case = {r.case.split(" (")[0].split(",")[0]: r for r in rows}
    assert set(by_case) >= {"GPT-2 greedy decoding", "Transformer.translate demo d128 l2 pre-norm",
                            "BERT training step", "GPT-2 training step", "BERT int8 inference", "sentence embedding"}  # fmt: skip
    assert len(rows) == 4 + 2 + 2 + 1 + 1
    for r in rows:
        assert r.times_ms["sublayer"] > 0
        if not r.case.startswith("GPT-2 greedy"):  # the decoding peer (CTranslate2) is optional
            assert r.times_ms[r.base] > 0 and r.ratio() is not None
    for r in rows:
        if "same tokens as CTranslate2" in r.extra and r.dtype == "fp32":
            assert r.extra["same tokens as CTranslate2"]  # the same weights decode the same greedy tokens
        if r.case.startswith("Transformer.translate"):
            assert r.extra["same output as reference"]
    assert [r.dtype for r in rows[:4]] == ["fp32", "int8"] * 2
    (path,) = tmp_path.glob("jobs-*.md")
    md = path.read_text()
    assert "| notes | shared |" in md and md.count("\n| ") >= 9 + len(rows)  # header rows, then one per row
    assert path.name == harness.report_path(tmp_path, "jobs").name
    assert any(ln.startswith("wrote ") for ln in lines)


def test_bad_job_names_and_reps():
    with pytest.raises(ValueError, match="jobs must be a comma-separated subset of decode,translate,train,int8,embed,llama,llama-train, got 'decode,nope'"):
        jobs.run_jobs(only="decode,nope")
    with pytest.raises(ValueError, match="reps must be >= 1, got 0"):
        jobs.run_jobs(reps=0)
