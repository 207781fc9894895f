"""The benchmarks' shared harness: interleaved timing, result rows, padded batches, the embedding rows' random BERT
and mean pooling, the AdamW training step, CTranslate2's greedy call, and the markdown report with the machine, the
versions, the date and the command that produced it.

At module level this imports the standard library and torch only, and sublayer only through its public API inside
functions: the whole-job driver of ``benchmarks/compare_revisions.py`` runs this file against other revisions.
"""

from __future__ import annotations

import datetime
import json
import os
import importlib.metadata
import itertools
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import torch

try:  # the features sublayer uses (SUBLAYER_ISA=avx2 hides AVX-512); compare_revisions.py runs this file with
    from sublayer.kernels.cpu import flags as _used_flags  # older revisions, which may lack the reader
except ImportError:
    _used_flags = None

__all__ = [
    "BERT_SIZES", "CLOCKS", "Row", "SideEnv", "Timing", "adamw_step", "bert_batch", "bert_model", "busy_neighbour",
    "command_line", "contention_table", "copy_gbps", "cpu_info", "cpu_kind", "ct2_greedy", "cycled", "machine",
    "mean_pool", "padded_batch", "report_markdown", "report_path", "saved_bytes", "set_clock", "summarize",
    "time_interleaved", "write_report", "Worker",
]  # fmt: skip

# what a timing measures: "wall" (time.perf_counter) or "cpu" (this process's CPU time, page faults included; with
# one thread it is the wall time minus the time other processes took the core: steadier on a shared machine)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = {"now": time.perf_counter}


def set_clock(name: str) -> None:
    """Time with ``CLOCKS[name]`` from now on.

    Raises:
        ValueError: ``name`` is not wall or cpu.
    """
    if name not in CLOCKS:
        raise ValueError(f"clock must be wall or cpu, got {name!r}")
    _clock["now"] = CLOCKS[name]


def _minor_faults() -> int:
    """Minor page faults of this process so far (0 where getrusage is unavailable)."""
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    except (ImportError, OSError):
        return 0


@dataclass(frozen=True)
class Timing:
    """One function's timings: median ms, spread = inter-quartile range / median, median minor page faults."""

    ms: float
    spread: float
    faults: float


def time_interleaved(fns: dict[str, Callable[[], object]], reps: int, warmup: int) -> dict[str, Timing]:
    """Run each fn ``warmup`` times, then ``reps`` rounds of all fns in turn (noise hits all alike)."""
    for f in fns.values():
        for _ in range(warmup):
            f()
    ts: dict[str, list[float]] = {k: [] for k in fns}
    flt: dict[str, list[int]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            f0, now = _minor_faults(), _clock["now"]
            t0 = now()
            f()
            ts[k].append(now() - t0)
            flt[k].append(_minor_faults() - f0)
    return {k: summarize([t * 1e3 for t in v], statistics.median(flt[k])) for k, v in ts.items()}


def cycled(inputs: list, fn: Callable[[object], object]) -> Callable[[], object]:
    """A no-argument function for :func:`time_interleaved`: ``fn(inputs[0])``, then ``fn(inputs[1])``, ... (cycling).
    Engines built from the same ``inputs`` see the same input at each call, and none sees one again until every
    other has been used: an engine that keeps earlier prompts' caches (OpenVINO GenAI's prefix cache) gains
    nothing from a benchmark that repeats its input."""
    calls = itertools.count()
    return lambda: fn(inputs[next(calls) % len(inputs)])


def summarize(ms: list[float], faults: float = 0.0) -> Timing:
    """The :class:`Timing` of the times ``ms``: their median and inter-quartile range / median."""
    med = statistics.median(ms)
    q = statistics.quantiles(ms, n=4) if len(ms) >= 2 else [med] * 3
    return Timing(med, (q[2] - q[0]) / med if med > 0 else 0.0, faults)


@dataclass
class Row:
    """One benchmark row: each implementation's median time (ms per call) and spread; ``base`` is the
    implementation the ratio compares ``sublayer`` with; ``work`` items (``unit``: tokens, sequences) per call
    give each implementation's rate."""

    case: str
    shape: str
    dtype: str
    mode: str  # "forward" (eval, no grad) or "training" (train mode, forward + backward)
    times_ms: dict[str, float] = field(default_factory=dict)  # impl -> median ms
    spread: dict[str, float] = field(default_factory=dict)  # impl -> (p75 - p25) / median
    extra: dict[str, float | str | None] = field(default_factory=dict)
    malloc: str = "default"  # the allocator setting it ran under (see sublayer.bench.kernels.MALLOC_SETTINGS)
    faults: dict[str, float] = field(default_factory=dict)  # impl -> median minor page faults per call
    base: str = "eager"
    work: float = 0.0
    unit: str = ""

    def ratio(self, impl: str = "sublayer", base: str | None = None) -> float | None:
        """``base``'s time / ``impl``'s (> 1: ``impl`` is faster); None when either is missing."""
        base = base or self.base
        if impl in self.times_ms and base in self.times_ms and self.times_ms[impl] > 0:
            return self.times_ms[base] / self.times_ms[impl]
        return None

    def fill(self, res: dict[str, Timing]) -> Row:
        """Times, spreads and page faults of a :func:`time_interleaved` result into this row."""
        for k, t in res.items():
            self.times_ms[k], self.spread[k], self.faults[k] = t.ms, t.spread, t.faults
        return self

    def rate(self, impl: str) -> float | None:
        """``work`` per second of ``impl`` (None without ``work``)."""
        return self.work / (self.times_ms[impl] * 1e-3) if self.work and self.times_ms.get(impl) else None


@contextmanager
def busy_neighbour() -> Iterator[subprocess.Popen]:
    """A competing busy process for the block's duration: a Python loop spinning on one core (as a browser tab, a
    CI neighbour or another user's job keeps a core busy), killed at the end."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)  # running before the timings start
        yield proc
    finally:
        proc.kill()
        proc.wait()


def saved_bytes(fn: Callable[[], object], params: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct non-parameter storages autograd saves during ``fn()``."""
    pptrs = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in pptrs:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


READ = "memory read GB/s, 1 / all threads"  # a row's extra under contention: :func:`read_rates` before its job


def read_rates(n_elem: int = 1 << 26, reps: int = 5) -> tuple[float, float]:
    """GB/s at which ``torch.sum`` reads ``n_elem`` float32 (256 MB: from memory) on one thread and on torch's
    threads: the rates a batch-1 decoding step, which reads every weight once, is bound by."""
    a, threads, rates = torch.randn(n_elem), torch.get_num_threads(), []
    try:
        for t in (1, threads):
            torch.set_num_threads(t)
            rates.append(a.nbytes / (time_interleaved({"read": lambda: a.sum()}, reps, 1)["read"].ms * 1e-3) / 1e9)
    finally:
        torch.set_num_threads(threads)
    return rates[0], rates[1]


def copy_gbps(n_elem: int, dtype: torch.dtype = torch.float32, reps: int = 5) -> float:
    """The machine's copy bandwidth (read + write, GB/s) on ``n_elem`` elements of ``dtype``."""
    a = torch.randn(n_elem).to(dtype)
    b = torch.empty_like(a)
    t = time_interleaved({"copy": lambda: b.copy_(a)}, reps, 1)["copy"].ms
    return 2 * a.numel() * a.element_size() / (t * 1e-3) / 1e9


def padded_batch(b: int, t: int, lo: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A right-padded batch: ids (B, T) in 1..vocab-1 (0 at padding) and attention mask (B, T) (1 = real), real
    lengths uniform in lo..t."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lens[:, None]).long()
    return torch.randint(1, vocab, (b, t), generator=g) * mask, mask


def bert_batch(quick: bool, vocab: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """The embedding rows' :func:`padded_batch` (64 x 128, lengths 32..128; ``quick``: 4 x 32, 8..32) and its shape
    label."""
    b, t, lo = (4, 32, 8) if quick else (64, 128, 32)
    return *padded_batch(b, t, lo, vocab), f"{b}x{t} (len {lo}..{t})"


# the random BERT's sizes (sublayer.models.BertConfig): MiniLM's shape (hidden 384, 6 layers, 12 heads, d_ff 1536),
# or (quick) a tiny one
BERT_SIZES = {False: dict(vocab_size=30522, d_model=384, n_layers=6, n_heads=12, d_ff=1536),
              True: dict(vocab_size=1000, d_model=96, n_layers=2, n_heads=12, d_ff=384)}  # fmt: skip


def bert_model(quick: bool, model: str | os.PathLike | None = None):
    """(our Bert in eval mode, its name) for the embedding rows: ``model``'s weights, or random ones (seed 0) of
    :data:`BERT_SIZES`."""
    from sublayer.models import Bert, BertConfig

    if model is not None:
        return Bert.from_pretrained(model).eval(), Path(model).name
    torch.manual_seed(0)
    return Bert(BertConfig(**BERT_SIZES[quick])).eval(), "random tiny" if quick else "random, MiniLM's shape"


def mean_pool(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sentence-transformers' pooling: the mean over real tokens, L2-normalised. (B, T, D), (B, T) -> (B, D)."""
    w = mask[..., None].to(h.dtype)
    return torch.nn.functional.normalize((h * w).sum(1) / w.sum(1), dim=-1)


def ct2_greedy(gen, toks: list[list[str]], new: int) -> list[list[int]]:
    """CTranslate2 ``Generator`` ``gen``'s greedy decoding of the prompts ``toks``: exactly ``new`` token ids a row."""
    res = gen.generate_batch(toks, max_length=new, min_length=new, include_prompt_in_result=False, sampling_topk=1)
    return [r.sequences_ids[0] for r in res]


def adamw_step(model: torch.nn.Module, loss: Callable[[], torch.Tensor], lr: float = 1e-4, *,
               bf16: bool = False) -> Callable[[], None]:  # fmt: skip
    """One training step: ``loss().backward()`` (``loss()`` under ``torch.autocast("cpu", dtype=torch.bfloat16,
    enabled=bf16)``, the backward outside it), an AdamW step (``lr``, its own optimizer), ``zero_grad``.

    The optimizer is ``torch.optim.AdamW(..., fused=True)``, what HF's ``Trainer`` uses by default
    (``optim="adamw_torch_fused"``), on every side of a comparison."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            value = loss()
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


class SideEnv:
    """A peers' side environment: a folder that ``benchmarks/<script>`` builds (``bin/python``, ``.built``,
    ``versions.txt``), where peers that are not sublayer's dependencies run in worker processes. ``default`` is used
    unless :meth:`use` names another folder, which :meth:`build` then builds on first use.

    Args:
        default: the folder used when none is named. script: the build script's name under ``benchmarks/``.
        prefix: the versions' prefix in reports. what: the environment's name in log lines. hint: appended to the
            build's log line.
    """

    def __init__(self, default: str, script: str, prefix: str, what: str, hint: str = "") -> None:
        self.default, self.script, self.prefix, self.what, self.hint = Path(default), script, prefix, what, hint
        self.named: Path | None = None

    def use(self, folder: str | os.PathLike | None) -> None:
        """Use ``folder`` (built there first when not built yet); None: the default, if built, never built."""
        self.named = None if folder is None else Path(folder)

    def path(self) -> Path:
        """The folder named by :meth:`use`, else the default."""
        return self.named or self.default

    @staticmethod
    def ready(env: Path) -> bool:
        """Whether ``env`` is a built environment."""
        return (env / ".built").is_file() and (env / "bin" / "python").is_file()

    def versions(self, env: Path | None = None) -> dict[str, str]:
        """The environment's ``versions.txt`` (package==version lines), each name prefixed; empty without it."""
        path = (env or self.path()) / "versions.txt"
        if not path.is_file():
            return {}
        pairs = (ln.split("==", 1) for ln in path.read_text().splitlines() if "==" in ln)
        return {f"{self.prefix} {k}": v for k, v in pairs}

    def build(self, log: Callable[[str], None]) -> tuple[Path, str | None]:
        """(:meth:`path`, None where it is ready, else a note saying how to build it), built first by the script (in
        a checkout that has it) where :meth:`use` named a folder; a failed build is logged with the end of its
        output."""
        env, script = self.path(), Path(__file__).resolve().parents[3] / "benchmarks" / self.script
        if not self.ready(env) and self.named is not None and script.is_file():
            log(f"building the {self.what} in {env} ({script}{self.hint})")
            done = subprocess.run(["bash", str(script), str(env)], capture_output=True, text=True)
            if done.returncode != 0:
                log(f"{self.what} build failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        return env, None if self.ready(env) else f"no {self.what} at {env} (build it: benchmarks/{self.script} {env})"

    def start(self, worker: type[Worker], log_file: Path, setup: Callable[[Worker, Path], None],
              log: Callable[[str], None] = print) -> tuple[Worker | None, str | None]:  # fmt: skip
        """(a ``worker`` run by the environment's python, its stderr to ``log_file``, once ``setup(worker, env)``
        is done; None), or (None, why not): the environment is not built (:meth:`build`'s note), or ``setup`` raised
        RuntimeError (the first line of its message; the worker closed)."""
        env, missing = self.build(log)
        if missing:
            return None, missing
        peer = worker(env / "bin" / "python", log_file)
        try:
            setup(peer, env)
        except RuntimeError as e:
            peer.close()
            return None, str(e).splitlines()[0]
        return peer, None


class Worker:
    """A peer in a worker process of its own: ``python`` runs the script ``WORKER`` beside this file, which answers
    the JSON lines of :mod:`sublayer.bench.worker_loop`; its stderr goes to ``log_file`` (None: this process's).
    ``NAME`` is the peer's name in errors. As a context manager, it is closed at the block's end."""

    WORKER = NAME = ""

    def __init__(self, python: str | os.PathLike, log_file: Path | None = None) -> None:
        self._err = None if log_file is None else open(log_file, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([str(python), str(Path(__file__).with_name(self.WORKER))], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, text=True)  # fmt: skip

    def ask(self, **req) -> dict:
        """The worker's answer to ``req``; RuntimeError where it answers an error or has exited."""
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.NAME} worker exited (see {getattr(self._err, 'name', 'its stderr')})")
        ans = json.loads(line)
        if "error" in ans:
            raise RuntimeError(f"{self.NAME} worker: {ans['error']}")
        return ans

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        if self._err is not None:
            self._err.close()


# --- the report ------------------------------------------------------------------------------------------------

_FEATURES = {  # what the report names -> /proc/cpuinfo flag
    "AVX2": "avx2", "FMA": "fma", "AVX-512": "avx512f", "AVX512_BF16": "avx512_bf16", "AVX512_VNNI": "avx512_vnni",
    "AMX": "amx_tile", "AMX_BF16": "amx_bf16", "AMX_INT8": "amx_int8",
}  # fmt: skip


def cpu_info(text: str | None = None) -> dict:
    """The CPU: ``model`` (``model name``), ``features`` (name -> used, of :data:`_FEATURES`), ``hidden`` (features
    the CPU has that sublayer is told not to use: ``SUBLAYER_ISA=avx2``), ``cores`` (logical CPUs), read from
    ``/proc/cpuinfo`` (or ``text``); the platform's processor name where there is none."""
    default = text is None
    if default:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            text = ""
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    have = set(flags.group(1).split()) if flags else set()
    used = set(_used_flags()) if default and _used_flags is not None and have else have
    return {
        "model": model.group(1).strip() if model else (platform.processor() or platform.machine()),
        "features": {name: flag in used for name, flag in _FEATURES.items()},
        "hidden": [name for name, flag in _FEATURES.items() if flag in have - used],
        "cores": len(re.findall(r"^processor\s*:", text, re.M)) or None,
    }


def cpu_kind(info: dict) -> str:
    """A file-name slug of the CPU: vendor and family words of its model, then its widest vector ISA
    (``amd-epyc-avx512``, ``intel-xeon-amx``)."""
    words = [w for w in re.sub(r"\(.*?\)|[^A-Za-z0-9 ]", " ", info["model"]).lower().split() if w not in ("r", "tm")]
    f = info["features"]
    isa = "amx" if f.get("AMX") else "avx512" if f.get("AVX-512") else "avx2" if f.get("AVX2") else platform.machine()
    return "-".join(words[:2] + [isa.lower()])


def machine() -> dict:
    """The machine and versions a report states: CPU (:func:`cpu_info`), torch threads, python, torch, sublayer
    and each peer found (transformers, ctranslate2, sentence-transformers)."""
    vers = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("sublayer", "transformers", "ctranslate2", "sentence-transformers"):
        with suppress(importlib.metadata.PackageNotFoundError):
            vers[dist] = importlib.metadata.version(dist)
    return {"cpu": cpu_info(), "threads": torch.get_num_threads(), "versions": vers}


def report_path(report: str | Path, subject: str, *, when: datetime.date | None = None) -> Path:
    """``report`` itself for a file name (``.md``), else ``report/<subject>-<cpu kind>-<YYYY-MM-DD>.md``."""
    report = Path(report)
    if report.suffix == ".md":
        return report
    day = (when or datetime.datetime.now(datetime.timezone.utc).date()).isoformat()
    return report / f"{subject}-{cpu_kind(cpu_info())}-{day}.md"


def _fmt_ms(row: Row, impl: str) -> str:
    ms = row.times_ms[impl]
    rate = row.rate(impl)
    per = f", {rate:,.1f} {row.unit}/s" if rate is not None else ""
    return f"{impl} {ms:,.2f} ms ±{100 * row.spread.get(impl, 0):.0f}%{per}"


def report_markdown(title: str, rows: list[Row], *, command: str, notes: str = "", info: dict | None = None,
                    reps: int | None = None, appendix: str = "") -> str:  # fmt: skip
    """The markdown report: a header table (machine, versions, date, command, notes), then one line a row with
    every implementation's median time, rate and spread, and ``sublayer``'s ratio against each other one; then
    ``appendix`` (e.g. :func:`contention_table`)."""
    info = info or machine()
    cpu = info["cpu"]
    feats = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu["features"].items())
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"# {title}", "",
        "| | |", "|---|---|",
        f"| date | {now} |",
        f"| command | `{command}` |",
        f"| CPU | {cpu['model']} |",
        f"| CPU features | {feats} |",
        f"| cores, torch threads | {cpu['cores']} logical CPUs, {info['threads']} threads |",
        f"| versions | {', '.join(f'{k} {v}' for k, v in info['versions'].items())} |",
    ]  # fmt: skip
    if cpu.get("hidden"):
        lines.append(f"| not used | {', '.join(cpu['hidden'])}: the CPU has them, the run was told to behave as an "
                     "AVX2 + FMA CPU (`SUBLAYER_ISA=avx2`) |")  # fmt: skip
    if notes:
        lines.append(f"| notes | {notes} |")
    lines += [
        "",
        f"Each figure is the median of {reps or 'the'} interleaved rounds (every implementation in turn, so "
        "noise hits all alike), ± the inter-quartile range / median. ratio = the reference's time / sublayer's "
        "(> 1: sublayer is faster).",
        "",
        "| job | shape | dtype | mode | sublayer | reference | ratio | other figures | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ours = _fmt_ms(r, "sublayer").removeprefix("sublayer ") if "sublayer" in r.times_ms else "—"
        ref = _fmt_ms(r, r.base) if r.base in r.times_ms else "—"
        others = "; ".join(_fmt_ms(r, k) for k in r.times_ms if k not in ("sublayer", r.base)) or "—"
        mode = r.mode + (f" [{r.malloc}]" if len({x.malloc for x in rows}) > 1 else "")
        x = r.ratio()
        cells = [r.case, r.shape, r.dtype, mode, ours, ref, "—" if x is None else f"x{x:.2f}", others,
                 "; ".join(f"{k} {v}" for k, v in r.extra.items())]  # fmt: skip
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines + ([("\n" + appendix.strip())] if appendix.strip() else [])) + "\n"


def contention_table(quiet: list[Row], busy: list[Row]) -> str:
    """Markdown: each row's ratio quiet and beside a busy neighbour (:func:`busy_neighbour`), and busy / quiet
    (1: the neighbour costs sublayer no more than its reference), with the quiet row's ``READ`` extra (the memory
    read rates of :func:`read_rates`, where measured). ``quiet`` and ``busy`` pair up in order."""
    lines = [
        "## Under a competing busy process", "",
        "ratio = the reference's time / sublayer's, measured quiet and while one other process spins on a core; "
        "held = busy ratio / quiet ratio. memory read = the rate `torch.sum` reads 256 MB on one thread / on all, "
        "quiet, just before the job: one over all bounds how much of its quiet ratio a job bound by memory "
        "(batch-1 decoding) keeps on the one free core against a reference that uses one thread anyway.", "",
        "| job | shape | reference | ratio quiet | ratio busy | held | sublayer quiet → busy | memory read |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for q, b in zip(quiet, busy):
        rq, rb = q.ratio(), b.ratio()
        held = f"{rb / rq:.2f}" if rq and rb else "—"
        ms = f"{q.times_ms['sublayer']:,.2f} → {b.times_ms['sublayer']:,.2f} ms"
        cells = [f"{q.case}, {q.dtype}", q.shape, q.base, "—" if rq is None else f"x{rq:.2f}",
                 "—" if rb is None else f"x{rb:.2f}", held, ms, str(q.extra.get(READ, "—"))]  # fmt: skip
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed: ``sublayer bench ...`` for the console script, ``python -m sublayer.X ...`` for a
    module of the package, ``python FILE ...`` for a script."""
    argv = sys.argv if argv is None else argv
    prog, parts = argv[0], Path(argv[0]).with_suffix("").parts
    if prog.endswith(".py"):
        mod = parts[len(parts) - 1 - parts[::-1].index("sublayer") :] if "sublayer" in parts else None
        prog = f"python -m {'.'.join(p for p in mod if p != '__main__')}" if mod else f"python {prog}"
    else:
        prog = Path(prog).name
    return " ".join([prog, *map(shlex.quote, argv[1:])])


def write_report(report: str | Path, subject: str, title: str, rows: list[Row], **kw) -> Path:
    """Write :func:`report_markdown` to :func:`report_path` (folders made); returns the path."""
    path = report_path(report, subject)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report_markdown(title, rows, **kw))
    return path
