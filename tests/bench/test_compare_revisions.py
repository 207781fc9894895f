"""benchmarks/compare_revisions.py: the before/after tool's rows from both revisions' runs, and one quick run of
the tool on the checkout's own HEAD against itself."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "benchmarks" / "compare_revisions.py"


def _tool():
    spec = importlib.util.spec_from_file_location("compare_revisions", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(ms: float, peer_ms: float, case: str = "decode") -> dict:
    return {"case": case, "shape": "3x5", "dtype": "fp32", "mode": "generate", "base": "peer", "work": 6.0,
            "unit": "tok", "times_ms": {"sublayer": ms, "peer": peer_ms}}  # fmt: skip


def test_compare_gives_medians_over_runs_b_against_a_and_the_peers_noise():
    results = {"A": [[_run(10, 20)], [_run(12, 20)], [_run(11, 21, "only in A")]],
               "B": [[_run(5, 22)], [_run(7, 22)]]}  # fmt: skip
    (row,) = _tool().compare(results)
    assert row.case == "decode" and row.base == "A"
    assert row.times_ms["A"] == 11 and row.times_ms["sublayer"] == 6  # the medians over runs
    assert row.ratio() == 11 / 6  # > 1: B is faster
    assert row.times_ms["peer (A run)"] == 20 and row.times_ms["peer (B run)"] == 22
    assert row.extra["peer B/A time (noise)"] == 1.1 and row.extra["runs"] == "2 + 2"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_quick_comparison_of_head_with_itself_writes_a_report(tmp_path):
    pytest.importorskip("transformers")
    if shutil.which("git") is None or subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"]).returncode:
        pytest.skip("needs the git checkout")
    path = _tool().main(["HEAD", "HEAD", "--quick", "--rounds", "1", "--reps", "1", "--only", "translate",
                         "--report", str(tmp_path), "--work", str(tmp_path / "work")])  # fmt: skip
    md = path.read_text()
    assert path.parent == tmp_path and path.name.startswith("compare-")
    assert "| notes | A = HEAD (" in md and "the sublayer column is B" in md
    rows = [ln for ln in md.splitlines() if ln.startswith("| Transformer.translate")]
    assert len(rows) == 2 and all("runs 1 + 1" in ln and "reference steps (B run)" in ln for ln in rows)
