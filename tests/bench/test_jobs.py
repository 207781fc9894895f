"""``sublayer bench --jobs --quick``: every whole job's rows on tiny shapes, and the report they make (the timings
themselves are not tested)."""

from __future__ import annotations

import re

import pytest

from sublayer.bench import harness, jobs

pytest.importorskip("transformers")  # the training and embedding rows' peer


@pytest.mark.filterwarnings("ignore")
def test_quick_jobs_time_each_row_against_its_peer_and_write_the_report(tmp_path):
    lines: list[str] = []
    rows = jobs.run_jobs(quick=True, reps=1, work=tmp_path / "work", report=tmp_path, notes="shared", log=lines.append)
    by_case = {r.case.split(" (")[0].split(",")[0]: r for r in rows}
    assert set(by_case) >= {"GPT-2 greedy decoding", "GPT-2 greedy decoding vs HF generate", "Transformer.translate demo d128 l2 pre-norm",
                            "BERT training step", "GPT-2 training step", "BERT int8 inference", "BERT int8 inference vs our bf16",
                            "sentence embedding",
                            "HF BertForSequenceClassification fine-tuning step", "HF GPT2LMHeadModel fine-tuning step",
                            "sublayer demo training"}  # fmt: skip
    from sublayer import kernels

    n_train = 2 * (2 if jobs.native_bf16() else 1)  # fp32, and bf16 autocast where the CPU multiplies bf16
    assert len(rows) == 12 + 2 + n_train + 2 + 1 + 2 * (2 if kernels.native_bf16_gemm() else 1) + 1 + 1  # int8: vs fp32, bf16
    for r in rows:
        assert r.times_ms["sublayer"] > 0
        if not r.case.startswith("GPT-2 greedy"):  # the decoding peer (CTranslate2) is optional
            assert r.times_ms[r.base] > 0 and r.ratio() is not None
    for r in rows:
        if "same tokens as CTranslate2" in r.extra and r.dtype == "fp32":
            assert r.extra["same tokens as CTranslate2"]  # the same weights decode the same greedy tokens
        if r.case.startswith("Transformer.translate"):
            assert r.extra["same output as reference"]
    assert [r.dtype for r in rows[:6]] == ["fp32", "int8", "bf16"] * 2
    vs_hf = [r for r in rows if r.case.startswith("GPT-2 greedy decoding vs HF")]
    want = [(b, dt, "HF fp32") for b in "18" for dt in ("fp32", "int8", "bf16")]
    assert [(r.case[-1], r.dtype, r.base) for r in vs_hf] == want
    assert all(r.ratio() > 0 for r in vs_hf)
    assert all(r.extra["same tokens as HF"] for r in vs_hf if r.dtype == "fp32")  # our fp32 decodes HF's tokens
    (path,) = tmp_path.glob("jobs-*.md")
    md = path.read_text()
    assert "| notes | shared |" in md and md.count("\n| ") >= 9 + len(rows)  # header rows, then one per row
    assert path.name == harness.report_path(tmp_path, "jobs").name
    assert any(ln.startswith("wrote ") for ln in lines)


def test_ct2_generator_in_its_own_process_decodes_as_in_process(tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2")
    import torch

    _, prompt, new, folder, _, _ = jobs.gpt2_decoding(True, tmp_path)
    gen = jobs.ct2_generator(folder, "int8")
    toks = [[f"t{i}" for i in row] for row in torch.randint(0, 500, (3, prompt)).tolist()]
    kw = {"max_length": new, "min_length": new, "include_prompt_in_result": False, "sampling_topk": 1}
    inline = ctranslate2.Generator(str(tmp_path / (folder.name + "-ct2-float32")), device="cpu", compute_type="int8")
    assert [r.sequences_ids for r in gen.generate_batch(toks, **kw)] == [
        r.sequences_ids for r in inline.generate_batch(toks, **kw)]  # fmt: skip
    with pytest.raises(RuntimeError, match="CTranslate2 worker"):
        gen.generate_batch(toks, no_such_option=1)
    with pytest.raises(RuntimeError, match="CTranslate2 worker"):
        jobs.Ct2Generator(tmp_path / "missing", "int8", 1)


def test_bad_job_names_and_reps():
    with pytest.raises(ValueError, match=r"only must name jobs of decode,translate,train,int8,embed,hf,demo,llama,llama-train,gpt2-llamacpp,ov-embed,ov-decode \(comma-separated\), got 'decode,nope'"):
        jobs.run_jobs(only="decode,nope")
    with pytest.raises(ValueError, match="reps must be >= 1, got 0"):
        jobs.run_jobs(reps=0)


@pytest.mark.filterwarnings("ignore")
def test_contention_runs_each_job_quiet_then_beside_a_busy_process(tmp_path, monkeypatch):
    started = []
    real = jobs.busy_neighbour

    def watched():
        started.append(1)
        return real()

    monkeypatch.setattr(jobs, "busy_neighbour", watched)
    rows = jobs.run_jobs(quick=True, reps=1, only="train,demo", work=tmp_path / "work", report=tmp_path,
                         contention=True, log=lambda line: None)  # fmt: skip
    assert len(started) == 2  # one neighbour per job
    n = 4 if jobs.native_bf16() else 2  # the training rows: fp32 (and bf16 autocast)
    assert [r.mode.rsplit(" ", 1)[1] for r in rows] == ["[quiet]"] * n + ["[busy]"] * n + ["[quiet]", "[busy]"]
    assert [r.dtype for r in rows[:n]] == (["fp32", "bf16 autocast"] * 2 if n == 4 else ["fp32"] * 2)
    demo = rows[-1]
    assert demo.base == "1 thread" and demo.times_ms["1 thread"] > 0 and demo.extra["threads"]
    (path,) = tmp_path.glob("jobs-contention-*.md")
    table = path.read_text().split("## Under a competing busy process")[1]
    assert table.count("\n| ") == 1 + n + 1  # the header, then one line a quiet/busy pair
    for q, b in zip(rows[:n], rows[n : 2 * n]):
        assert f"x{q.ratio():.2f} | x{b.ratio():.2f} | {b.ratio() / q.ratio():.2f} |" in table
    # the memory read rates measured quiet before each job, on the quiet rows and in the table
    one, all_, bound = re.fullmatch(r"([\d.]+) / ([\d.]+) \(([\d.]+)\)", rows[0].extra[jobs.READ]).groups()
    one, all_, bound = float(one), float(all_), float(bound)
    # the bound is rounded to 0.01 from the unrounded rates, which the table rounds to 0.1 GB/s
    assert one > 0 and all_ > 0 and abs(bound - one / all_) <= 0.005 + 0.05 * (1 + one / all_) / all_ + 1e-9
    assert jobs.READ not in rows[n].extra and table.count(f"| {rows[0].extra[jobs.READ]} |") == n
