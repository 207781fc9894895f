"""The benchmarks' shared harness: interleaved timing, rows, padded batches, the report and its file name."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import pytest
import torch

from sublayer.bench import harness
from sublayer.bench.harness import Row

XEON = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu sse avx avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu sse avx avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""
EPYC = "processor\t: 0\nmodel name\t: AMD EPYC 7R13 Processor\nflags\t\t: fpu avx avx2 fma\n"


def test_time_interleaved_runs_the_functions_in_turn_after_their_warmup():
    calls: list[str] = []
    res = harness.time_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3, 2)
    assert calls == ["a", "a", "b", "b"] + ["a", "b"] * 3
    assert set(res) == {"a", "b"} and all(t.ms >= 0 and t.spread >= 0 for t in res.values())


def test_cycled_gives_each_engine_the_same_new_input_at_each_call():
    seen: dict[str, list[int]] = {"a": [], "b": []}
    fns = {k: harness.cycled([10, 11, 12], lambda x, k=k: seen[k].append(x)) for k in seen}
    fns["a"](), fns["b"]()  # the warm-up
    harness.time_interleaved(fns, 4, 0)
    assert seen["a"] == seen["b"] == [10, 11, 12, 10, 11]


def test_set_clock_rejects_an_unknown_clock():
    with pytest.raises(ValueError, match="clock must be wall or cpu, got 'gpu'"):
        harness.set_clock("gpu")


def test_row_ratio_against_its_base_and_rate():
    r = Row("job", "3x5", "fp32", "forward", base="peer", work=30.0, unit="tok")
    r.fill({"sublayer": harness.Timing(10.0, 0.1, 2.0), "peer": harness.Timing(25.0, 0.0, 0.0)})
    assert r.ratio() == 2.5 and r.ratio(base="sublayer") == 1.0 and r.ratio(base="absent") is None
    assert r.rate("sublayer") == 3000.0 and r.faults["sublayer"] == 2.0
    assert Row("job", "", "", "").rate("sublayer") is None  # no work given


def test_padded_batch_is_right_padded_with_lengths_in_range():
    ids, mask = harness.padded_batch(7, 11, 3, 13, seed=5)
    lens = mask.sum(1)
    assert ids.shape == mask.shape == (7, 11)
    assert ((lens >= 3) & (lens <= 11)).all()
    assert torch.equal(mask, (torch.arange(11)[None] < lens[:, None]).long())
    assert (ids[mask == 0] == 0).all() and (ids[mask == 1] >= 1).all() and (ids < 13).all()


def test_cpu_info_reads_model_features_and_cores():
    info = harness.cpu_info(XEON)
    assert info["model"] == "Intel(R) Xeon(R) Platinum 8488C" and info["cores"] == 2
    assert info["features"]["AMX"] and info["features"]["AVX512_BF16"] and info["features"]["AVX2"]
    assert harness.cpu_kind(info) == "intel-xeon-amx"
    epyc = harness.cpu_info(EPYC)
    assert not epyc["features"]["AVX-512"] and harness.cpu_kind(epyc) == "amd-epyc-avx2"
    assert info["hidden"] == epyc["hidden"] == []  # a given text: every flag it lists is used


def test_cpu_info_names_the_features_sublayer_is_told_not_to_use(monkeypatch):
    monkeypatch.setattr(harness, "_used_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setattr(harness.Path, "read_text", lambda self: XEON)
    info = harness.cpu_info()
    assert not info["features"]["AVX-512"] and info["features"]["AVX2"] and harness.cpu_kind(info) == "intel-xeon-avx2"
    assert "AVX-512" in info["hidden"] and "AMX_INT8" in info["hidden"] and "AVX2" not in info["hidden"]
    md = harness.report_markdown("t", [], command="c", info={"cpu": info, "threads": 2, "versions": {}})
    assert "| not used | AVX-512, AVX512_BF16" in md and "SUBLAYER_ISA=avx2" in md


def test_report_path_names_a_file_in_a_folder_by_subject_cpu_and_date(tmp_path):
    day = datetime.date(2031, 2, 3)
    p = harness.report_path(tmp_path, "jobs", when=day)
    assert p.parent == tmp_path
    assert p.name == f"jobs-{harness.cpu_kind(harness.cpu_info())}-2031-02-03.md"
    assert harness.report_path(tmp_path / "mine.md", "jobs") == tmp_path / "mine.md"


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["/x/.venv/bin/sublayer", "bench", "--jobs"], "sublayer bench --jobs"),
        (["/r/src/sublayer/bench/__main__.py", "--jobs", "--notes", "a b"], "python -m sublayer.bench --jobs --notes 'a b'"),
        (["/r/src/sublayer/cli.py", "bench"], "python -m sublayer.cli bench"),
        (["benchmarks/run_bench.py", "--quick"], "python benchmarks/run_bench.py --quick"),
    ],
)
def test_command_line_as_typed(argv, want):
    assert harness.command_line(argv) == want


def test_report_has_machine_versions_command_and_every_row_with_its_ratios(tmp_path):
    rows = [
        Row("decode", "b1", "fp32", "generate", base="peer", work=8.0, unit="tok").fill(
            {"sublayer": harness.Timing(2.0, 0.05, 0), "peer": harness.Timing(3.0, 0.1, 0),
             "other": harness.Timing(8.0, 0.0, 0)}  # fmt: skip
        ),
        Row("train", "b2", "fp32", "training", base="HF", extra={"HF attn": "sdpa"}).fill(
            {"sublayer": harness.Timing(5.0, 0.0, 0)}
        ),
    ]
    path = harness.write_report(tmp_path / "out", "jobs", "Title", rows, command="sublayer bench --jobs",
                                notes="shared machine", reps=3)  # fmt: skip
    md = path.read_text()
    assert path.parent == tmp_path / "out" and path.name.startswith("jobs-")
    assert md.startswith("# Title\n")
    for want in ("| command | `sublayer bench --jobs` |", "| notes | shared machine |", f"torch {torch.__version__}",
                 f"{torch.get_num_threads()} threads", "| CPU features | AVX2 ", "median of 3 interleaved rounds"):  # fmt: skip
        assert want in md
    line = next(ln for ln in md.splitlines() if ln.startswith("| decode |"))
    assert "| 2.00 ms ±5%, 4,000.0 tok/s | peer 3.00 ms ±10%, 2,666.7 tok/s | x1.50 | other 8.00 ms ±0%" in line
    train = next(ln for ln in md.splitlines() if ln.startswith("| train |"))
    assert "| — |" in train and "HF attn sdpa" in train  # no reference timed: no ratio


def test_busy_neighbour_spins_during_the_block_only():
    with harness.busy_neighbour() as proc:
        assert proc.poll() is None
        stat = Path(f"/proc/{proc.pid}/stat")
        if stat.exists():  # Linux: the neighbour has used CPU time (utime, in clock ticks) by now
            assert int(stat.read_text().rsplit(")", 1)[1].split()[11]) > 0
    assert proc.poll() is not None


def test_side_env_start_runs_the_setup_or_says_why_not(tmp_path):
    class Peer(harness.Worker):
        WORKER, NAME = "ct2_worker.py", "test peer"  # its loop answers any op it does not know with an error

    side = harness.SideEnv(str(tmp_path / "env"), "none.sh", "test", "test environment")
    assert side.start(Peer, tmp_path / "peer.log", lambda peer, env: None, log=print) == (
        None, f"no test environment at {tmp_path / 'env'} (build it: benchmarks/none.sh {tmp_path / 'env'})")  # fmt: skip
    (tmp_path / "env" / "bin").mkdir(parents=True)
    (tmp_path / "env" / "bin" / "python").symlink_to(sys.executable)
    (tmp_path / "env" / ".built").touch()

    def failing(peer, env):
        assert env == tmp_path / "env"
        raise RuntimeError("no model here\nthe rest of the message")

    assert side.start(Peer, tmp_path / "peer.log", failing) == (None, "no model here")
    peer, note = side.start(Peer, tmp_path / "peer.log", lambda peer, env: None)
    with peer:
        assert note is None
        with pytest.raises(RuntimeError, match="test peer worker: unknown op 'nope'"):
            peer.ask(op="nope")
    assert peer.proc.poll() == 0  # closed at the block's end
