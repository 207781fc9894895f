"""Before/after: the whole-job benchmarks (``sublayer bench --jobs``) of two git revisions, interleaved on one machine.

    python benchmarks/compare_revisions.py REV_A REV_B [--rounds N] [--quick] [--only decode,translate,...]
        [--threads 2] [--model FOLDER] [--report benchmarks/results] [--notes TEXT]

Each revision's ``src/`` is exported (``git archive``) into a temporary folder. The jobs run through a driver made of
THIS checkout's ``sublayer/bench/harness.py`` and ``jobs.py``, copied into a package of their own, so both revisions
run the same benchmark code and only the library under it differs (the jobs use sublayer's public API:
``sublayer.models``' GPT2, Bert, Transformer, ``fast_inference``, ``to_hf``). Every run is a fresh subprocess with
``PYTHONPATH`` = the driver and that revision's ``src``; for each round, each job runs for A and B in turn (the order
flips every round). Each revision's kernels are built before the first round. The report gives per row the median
over rounds of A's and B's sublayer time, B's speed against A (A time / B time: > 1 is B faster), and the peer's time
in A's and B's runs, whose ratio shows the machine's noise. It is written to ``--report`` (a folder: named
``compare-<cpu kind>-<date>.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "src" / "sublayer" / "bench"
DRIVER_PACKAGE = "sublayer_jobs_driver"


def _child(args: argparse.Namespace) -> None:
    """In the subprocess: build the kernels (``--build``) or run the jobs and write their rows as JSON."""
    import torch

    torch.set_num_threads(args.threads)
    if args.build:
        try:
            import sublayer.kernels as kernels

            kernels.available()
        except (ImportError, AttributeError):
            pass
        return
    jobs = __import__(f"{DRIVER_PACKAGE}.jobs", fromlist=["run_jobs"])
    rows = jobs.run_jobs(quick=args.quick, reps=args.reps, only=args.only, model=args.model, work=args.work,
                         log=lambda line: print(line, flush=True))  # fmt: skip
    Path(args.json).write_text(json.dumps([asdict(r) for r in rows]))


def export(rev: str, dest: Path) -> str:
    """``rev``'s ``src/`` under ``dest`` (git archive); returns its short commit id."""
    sha = subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", "--short", f"{rev}^{{commit}}"], text=True)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return sha.strip()


def make_driver(dest: Path) -> Path:
    """This checkout's harness.py, jobs.py, ct2_worker.py and worker_loop.py (the CTranslate2 worker jobs.py starts
    and its loop) as the package ``sublayer_jobs_driver`` under ``dest``."""
    pkg = dest / DRIVER_PACKAGE
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for name in ("harness.py", "jobs.py", "ct2_worker.py", "worker_loop.py"):
        shutil.copy(BENCH / name, pkg / name)
    return dest


def run_one(src: Path, driver: Path, argv: list[str], log) -> list[dict]:
    """One subprocess on revision ``src`` (PYTHONPATH = driver + src); its rows."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(driver), str(src)])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        proc = subprocess.run([sys.executable, __file__, "--child", "--json", str(out), *argv], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"the jobs on {src} failed:\n{proc.stdout[-3000:]}")
        for line in proc.stdout.splitlines():
            if line.startswith(("GPT-2", "BERT", "Transformer", "sentence")):
                log("    " + line)
        return json.loads(out.read_text()) if out.is_file() else []


def compare(results: dict[str, list[list[dict]]]) -> list:
    """The report's rows from each revision's runs (``results["A"]``, ``results["B"]``: one list of row dicts per
    run): times = {"sublayer": B's median ms over the runs, "A": A's, "<peer> (A run)", "<peer> (B run)"}."""
    sys.path.insert(0, str(ROOT / "src"))
    from sublayer.bench.harness import Row, summarize

    runs: dict[str, dict[tuple, list[dict]]] = {"A": {}, "B": {}}
    for label, by_key in runs.items():
        for run in results[label]:
            for r in run:
                by_key.setdefault((r["case"], r["shape"], r["dtype"]), []).append(r)
    rows = []
    for key, ra in runs["A"].items():
        rb = runs["B"].get(key)
        if not rb:
            continue
        peer = ra[0]["base"]
        series = {"sublayer": [r["times_ms"]["sublayer"] for r in rb], "A": [r["times_ms"]["sublayer"] for r in ra]}
        for label, rs in (("A", ra), ("B", rb)):
            if all(peer in r["times_ms"] for r in rs):
                series[f"{peer} ({label} run)"] = [r["times_ms"][peer] for r in rs]
        row = Row(*key, ra[0]["mode"], base="A", work=ra[0]["work"], unit=ra[0]["unit"])
        row.fill({name: summarize(ts) for name, ts in series.items()})
        pa, pb = row.times_ms.get(f"{peer} (A run)"), row.times_ms.get(f"{peer} (B run)")
        if pa and pb:
            row.extra["peer B/A time (noise)"] = round(pb / pa, 3)
        row.extra["runs"] = f"{len(ra)} + {len(rb)}"
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> Path | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev_a", nargs="?")
    ap.add_argument("rev_b", nargs="?")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default=None, help="comma-separated subset of decode,translate,train,int8,embed")
    ap.add_argument("--reps", type=int, default=None, help="interleaved repetitions inside each run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="BERT folder for the int8 and embed rows")
    ap.add_argument("--work", default=None, help="folder for the GPT-2 checkpoint and its conversions")
    ap.add_argument("--report", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--notes", default="")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--build", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args)
        return None
    if not (args.rev_a and args.rev_b):
        ap.error("REV_A and REV_B are required")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    jobs = [j.strip() for j in (args.only or "decode,translate,train,int8,embed").split(",") if j.strip()]
    with tempfile.TemporaryDirectory(prefix="sublayer-compare-") as tmp:
        tmp = Path(tmp)
        work = Path(args.work) if args.work else tmp / "work"
        driver = make_driver(tmp / "driver")
        revs = {"A": args.rev_a, "B": args.rev_b}
        shas = {label: export(rev, tmp / label) for label, rev in revs.items()}
        common = ["--threads", str(args.threads), "--work", str(work)] + (["--quick"] if args.quick else [])
        common += (["--model", args.model] if args.model else []) + (["--reps", str(args.reps)] if args.reps else [])
        for label in revs:
            print(f"building the kernels of {label} = {revs[label]} ({shas[label]})", flush=True)
            run_one(tmp / label / "src", driver, ["--build", *common], print)
        results: dict[str, list[list[dict]]] = {label: [] for label in revs}
        for i in range(args.rounds):
            for job in jobs:
                for label in ("A", "B") if i % 2 == 0 else ("B", "A"):
                    print(f"round {i + 1}/{args.rounds} {job}: {label} = {revs[label]} ({shas[label]})", flush=True)
                    results[label].append(run_one(tmp / label / "src", driver, ["--only", job, *common], print))
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    from sublayer.bench.harness import command_line, write_report

    torch.set_num_threads(args.threads)
    rows = compare(results)
    notes = (f"A = {args.rev_a} ({shas['A']}), B = {args.rev_b} ({shas['B']}); the sublayer column is B, "
             f"the reference column A; ratio = A's time / B's (> 1: B is faster); {args.rounds} rounds, each job "
             "in a fresh process per revision, A and B in turn" + (f"; {args.notes}" if args.notes else ""))  # fmt: skip
    title = f"Whole jobs, revision {args.rev_a} vs {args.rev_b}" + (" (quick: tiny shapes)" if args.quick else "")
    command = command_line(sys.argv if argv is None else [sys.argv[0], *argv])
    path = write_report(args.report, "compare", title, rows, command=command, notes=notes, reps=args.rounds)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
