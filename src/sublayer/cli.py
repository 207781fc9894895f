"""The ``sublayer`` command line: ``demo`` (the main job), ``train``, ``generate``, ``embed``, ``bench``, ``info``.

Errors are one line on stderr with exit code 2 (a traceback only with ``--debug``).
Each command's work lives in its own module, imported lazily so ``sublayer info`` starts fast.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import sys
import time
from pathlib import Path
from typing import Optional

# Packages of the optional extras -> the extra that installs them (a missing one is named in one line).
_EXTRAS = {"typer": "cli", "click": "cli", "rich": "cli", "matplotlib": "cli", "tokenizers": "cli"}
_CLI_PACKAGES = "typer rich matplotlib tokenizers"


def _missing_package(name: str | None) -> str | None:
    """One line naming the install command for a missing optional package (None: not an optional one)."""
    top = (name or "").split(".")[0]
    if top in _EXTRAS:
        return f"{top!r} is not installed (sublayer's {_EXTRAS[top]} extra): pip install {_CLI_PACKAGES}"
    if top == "transformers":
        return "'transformers' is not installed: pip install transformers"
    return None


try:
    import typer
except ModuleNotFoundError as _e:  # installed without the cli extra: one line, no traceback
    if _missing_package(_e.name) is None:
        raise
    print(f"error: {_missing_package(_e.name)}", file=sys.stderr)
    raise SystemExit(2) from None

app = typer.Typer(add_completion=False, no_args_is_help=True, help="sublayer: Transformer sub-layers, models and demos.")
_state = {"debug": False}


class CLIError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def _flag_errors(command):
    """A command whose ValueError/TypeError names one of its options (``top_p must be ...``, ``prompt length 2 +
    max_new_tokens 40 exceeds ...``: the library's check of the value passed on) names the flag the user typed
    instead (``--top-p must be ...``, ``... + --max-new-tokens 40 exceeds ...``): an option's name as the
    message's first word, and an option's name with an underscore wherever it stands as a word of its own (not
    after a dot: ``generation_config.max_length`` is a file's field). A one-word name elsewhere in the message
    (``model``, ``seed``) is prose and stays."""
    flags = {
        name: next(d for d in p.default.param_decls if d.startswith("--"))
        for name, p in inspect.signature(command).parameters.items()
        if isinstance(p.default, typer.models.OptionInfo) and p.default.param_decls
    }

    def flag(m: re.Match) -> str:
        word = m.group(0)
        return flags[word] if word in flags and (m.start() == 0 or "_" in word) else word

    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (ValueError, TypeError) as e:
            msg = str(e)
            renamed = re.sub(r"(?<![\w.])\w+", flag, msg)
            if renamed != msg and not _state["debug"]:
                raise CLIError(renamed) from None
            raise

    return run


def _setup_inference(quantize: str | None, model: Path) -> Path:
    """generate's and embed's start: torch's threads as :func:`sublayer.kernels.cpu.choose_threads` says,
    ``--quantize`` checked; returns the ``--model`` folder (:func:`_model_folder`)."""
    import torch

    from .kernels.cpu import choose_threads
    from .models.quantized import QUANTIZE_CHOICES

    torch.set_num_threads(choose_threads()[0])

    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise CLIError(f"--quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {quantize!r}")
    return _model_folder(model)


def _model_folder(model: Path) -> Path:
    """``--model``: a folder, or a model name the local Hugging Face cache holds; CLIError saying which is missing."""
    from .checkpoints import resolve_folder

    try:
        return resolve_folder(model)
    except (FileNotFoundError, NotADirectoryError) as e:
        raise CLIError(f"--model: {e}") from None


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors.")) -> None:
    _state["debug"] = debug
    from . import settings

    settings.wait_policy()  # a bad SUBLAYER_WAIT_POLICY is an error of every command
    from .memory import set_memory_reuse

    set_memory_reuse()  # every command: glibc keeps freed memory (no page faults on recycled big buffers)


@app.command()
def info() -> None:
    """Versions, threads, CPU features and whether the fast kernels are active."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from . import kernels, settings
    from .runtime import causal
    from .memory import allocator_setting, buffer_cache
    from .models.int8 import own_int8_gemm
    from .models.quantized import engine
    from .runtime.linear import compact_kernels

    try:
        ours = version("sublayer")
    except PackageNotFoundError:  # a source checkout on PYTHONPATH, never pip-installed
        ours = "not installed (a source tree)"
    rows = {
        "sublayer": ours,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu capability": torch.backends.cpu.get_cpu_capability(),
        "threads": "{} ({})".format(*kernels.cpu.choose_threads()),  # what generate/embed use
        "openmp waits": settings.wait_policy_effect(),
        **kernels.cpu.describe(),
    }

    rows["fast kernels"] = kernels.status()  # builds (or loads the cached) C++ extension once
    on = kernels.enabled()  # switched on and built: else no panels, no int8_linear, no buffer cache
    rows["fast decoding"] = "on" if causal.enabled() else "off (SUBLAYER_DECODING=0): the reference loops"
    bert = f"BERT on torch's linear_dynamic ({engine()})"
    if own_int8_gemm():
        rows["int8"] = "int8_linear (AVX512-VNNI / AMX-INT8): int8 activations; a decoding step's single row at 24 bits"
    elif on:
        rows["int8"] = f"decoding weight-only (int8 panels); {bert}"
    else:
        rows["int8"] = f"decoding weight-only (int8 weights to float32 for torch's GEMMs, no kernels); {bert}"
    if on:
        rows["bf16 decoding"] = (
            "compact panels, 12 bits a weight (AVX-512, AVX512_BF16)" if compact_kernels()
            else "bf16 panels, 16 bits a weight"
        )  # fmt: skip
    else:  # PackedLinear without panels
        rows["bf16 decoding"] = (
            "bf16 weights through torch's bf16 GEMMs, no kernels" if kernels.native_bf16_gemm()
            else "bf16-rounded weights through torch's float32 GEMMs, no kernels"
        )  # fmt: skip
    rows["fp32 GEMMs"] = (
        "oneDNN from 2^24 multiply-adds (torch's BLAS runs a generic path on this CPU)"
        if on and kernels.cpu.onednn_fp32_gemm() else "torch's BLAS"
    )  # fmt: skip
    rows["allocator"] = allocator_setting()
    rows["buffer cache"] = (
        f"Add & Norm keeps up to {buffer_cache()['limit_mb']:g} MiB of freed buffers (SUBLAYER_BUFFER_CACHE_MB)"
        if on else "0 MiB: Add & Norm's kernels are not in use"
    )  # fmt: skip
    for k, v in rows.items():
        typer.echo(f"{k:16s} {v}")


# --- demo: train the encoder-decoder Transformer on numbers in words <-> digits -------------------------------


@app.command()
@_flag_errors
def demo(
    out: Path = typer.Option(Path("runs/demo"), "--out", "-o", help="Folder for metrics, plots and checkpoint."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Total training steps (default 1200)."),
    seed: int = typer.Option(0, "--seed", help="Random seed (weights, data, held-out split of samples)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the checkpoint in --out (up to --steps)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an earlier run's checkpoint in --out."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Sentence pairs per step (default 96)."),
    threads: Optional[int] = typer.Option(
        None, "--threads", help="torch threads per process (default: SUBLAYER_THREADS, else 1: the demo's model is "
        "small, a second thread's barriers cost more than it saves)."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar or tables."),
    nproc: int = typer.Option(
        1, "--nproc",
        help="Train data-parallel on N local CPU processes (gloo, DDP); under torchrun leave it out.",
    ),
) -> None:
    """Train a small Transformer to translate numbers between English words and digits, both ways.

    Shows a progress bar, then the held-out exact-match accuracy and sample translations; writes
    metrics.json, loss.png, attention.png and a safetensors checkpoint to --out. Ctrl-C saves a checkpoint
    (continue with --resume).
    """
    from .demo import DemoConfig, train
    from .demo.training import run_rank

    kw = {"out": str(out), "seed": seed, "resume": resume, "overwrite": overwrite, "threads": threads, "quiet": quiet}
    kw |= {k: v for k, v in (("steps", steps), ("batch_size", batch_size)) if v is not None}  # else DemoConfig's
    _launch_training(functools.partial(run_rank, train), nproc, DemoConfig(**kw), "demo")  # picklable for spawned ranks


def _launch_training(rank_fn, nproc: int, cfg, what: str) -> None:
    """``rank_fn(rank, world_size, cfg)`` in this process or on ``nproc`` spawned ranks (:func:`parallel.launch`),
    the kernels built first (so tokens/s never includes the build); a rank's error as one line."""
    if nproc < 1 or cfg.batch_size % nproc:
        raise CLIError(f"--nproc must be >= 1 and divide --batch-size ({cfg.batch_size}), got {nproc}")
    from torch.multiprocessing import ProcessRaisedException

    from . import kernels, settings
    from .memory import allocator_setting
    from .parallel import launch

    kernels.enabled()  # build (once, announced on stderr) before training starts, so tok/s never includes it
    if not cfg.quiet:
        typer.echo(f"allocator: {allocator_setting()}")
    # spawned ranks start OpenMP afresh: threads that sleep at a barrier rather than spin (a rank's threads share
    # the cores with the other ranks), unless the user chose otherwise
    settings.apply_wait_policy(os.environ, torch_loaded=False)
    try:  # one process: train() here; N: N spawned ranks; under torchrun: this process is one rank
        launch(rank_fn, nproc, cfg)
    except ProcessRaisedException as e:
        if _state["debug"]:
            raise
        last = [line for line in str(e).splitlines() if line.strip()][-1]
        raise CLIError(f"a {what} process failed: {last}") from None


# --- train: a GPT-2 / Llama folder on your own text -----------------------------------------------------------


@app.command(name="train")
@_flag_errors
def train_command(
    model: str = typer.Option(..., "--model", "-m", help="HF GPT-2/Llama/Qwen2 folder with tokenizer.json, or "
                              "builtin:gpt2-tiny / builtin:llama-tiny (a small new model, byte-level tokenizer)."),
    data: str = typer.Option(..., "--data", help="A text file, a folder of .txt/.md files, or builtin:numbers."),
    out: Path = typer.Option(Path("runs/train"), "--out", "-o", help="Folder for the trained HF folder, plots."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Optimizer steps (default: --epochs 1)."),
    epochs: Optional[int] = typer.Option(None, "--epochs", help="Passes over the training rows."),
    batch_size: int = typer.Option(8, "--batch-size", help="Rows per step (over all processes)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per row (default: min(256, positions))."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Peak learning rate (default 1e-3 builtin, else 5e-5)."),
    split: str = typer.Option("paragraphs", "--split", help="Documents: paragraphs (blank lines) or files."),
    val_fraction: float = typer.Option(0.05, "--val-fraction", help="Documents held out for the perplexity."),
    eval_every: Optional[int] = typer.Option(None, "--eval-every", help="Steps between evaluations+checkpoints."),
    seed: int = typer.Option(0, "--seed", help="Random seed (new weights, held-out split, row order, dropout)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch threads per process (default: 1 for a "
                                           "builtin model, else torch's)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the checkpoint in --out."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an earlier run's checkpoint in --out."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    nproc: int = typer.Option(1, "--nproc", help="Train data-parallel on N local CPU processes (gloo, DDP)."),
) -> None:
    """Train or fine-tune a causal LM on text: packed documents, held-out perplexity, a Hugging Face folder out.

    Ctrl-C saves a checkpoint (continue with --resume); the result loads in sublayer generate and HF.
    """
    from .train import TrainConfig, rank_main

    cfg = TrainConfig(model=model, data=data, out=str(out), steps=steps, epochs=epochs, batch_size=batch_size,
                      seq_len=seq_len, lr=lr, split=split, val_fraction=val_fraction, eval_every=eval_every, seed=seed,
                      threads=threads, resume=resume, overwrite=overwrite, quiet=quiet)  # fmt: skip
    _launch_training(rank_main, nproc, cfg, "train")


# --- generate / embed: Hugging Face-format GPT-2, Llama/Qwen2 and BERT folders ----------------------------------


@app.command()
@_flag_errors
def generate(
    prompt: str = typer.Argument(..., help='Token ids ("464 3290 318") or text (text needs the folder\'s tokenizer).'),
    model: Path = typer.Option(
        ..., "--model", "-m", help="Hugging Face-format GPT-2, Llama or Qwen2 folder (config.json + weights)."
    ),
    max_new_tokens: Optional[int] = typer.Option(
        None, "--max-new-tokens", "-n", min=0, help="Tokens to add (default: the folder's generation settings, "
        "else 20)."
    ),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="Sampling temperature (> 0)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Sample among the k most likely tokens."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus sampling: smallest set with this mass."),
    sample: bool = typer.Option(
        False, "--sample", help="Sample instead of greedy decoding (implied by --temperature/--top-k/--top-p)."
    ),
    seed: int = typer.Option(0, "--seed", help="Random seed for sampling."),
    quantize: Optional[str] = typer.Option(
        None, "--quantize", help="int8: int8 decoding (sublayer.models.quantized: int8 weights; int8 activations "
        "where the CPU has AVX512-VNNI or AMX-INT8, else weight-only); a saved int8 folder loads as is."
    ),
    stream: bool = typer.Option(
        False, "--stream", help="Print a text prompt's continuation as it is made (no tokens/s line)."
    ),
) -> None:
    """Continue a prompt with a GPT-2, Llama or Qwen2 checkpoint (the class from config.json's model_type; greedy
    by default; KV-cached decoding), through sublayer.text.TextGenerator.

    Prints the ids (prompt and continuation) for an id prompt, the prompt and its continuation for a text prompt
    (read with the folder's tokenizer). Stops early at the model's eos token. What is not given comes from the
    folder's generation_config.json (else config.json's special ids, else Hugging Face's defaults), as HF's generate.
    """
    import torch

    from .checkpoints import FROM_CONFIG
    from .text import TextGenerator, load_tokenizer
    model = _setup_inference(quantize, model)
    if not prompt.strip():
        raise CLIError("the prompt is empty: give token ids like \"1 2 3\" or text")
    parts = prompt.replace(",", " ").split()  # "1 2 3" or "1,2,3": ids; else text (ids None)
    ids = [int(p) for p in parts] if parts and all(p.isascii() and p.isdigit() for p in parts) else None
    tokenizer = None if ids is not None else load_tokenizer(model, why=f"the text prompt {prompt[:40]!r}")
    gen = TextGenerator.from_pretrained(model, quantize=quantize, tokenizer=tokenizer)
    given = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p}
    sampling = sample or any(given[k] is not None for k in ("temperature", "top_k", "top_p"))
    options = {k: FROM_CONFIG if v is None else v for k, v in given.items()}  # unset: the folder's settings
    if not -(2**63) <= seed < 2**64:  # what torch.Generator.manual_seed takes
        raise CLIError(f"--seed must be in [-2**63, 2**64), got {seed}")
    options |= {"do_sample": True if sampling else FROM_CONFIG, "generator": torch.Generator().manual_seed(seed)}
    started = time.perf_counter()
    counter = _Counter()
    if ids is not None:
        if max(ids) >= 2**63:  # beyond int64: the model's own range check never sees it
            raise CLIError(f"input_ids must lie in [0, vocab_size={gen.model.config.vocab_size}), got {max(ids)}")
        out = gen.model.generate(torch.tensor([ids]), streamer=counter, **options)[0].tolist()
        typer.echo(" ".join(map(str, out)))
    elif stream:  # pieces as they are made; no speed line (a piece may hold several tokens)
        pieces = gen.stream(prompt, **options)
        first = next(pieces, "")  # a bad option raises here: before the prompt is printed
        typer.echo(prompt + first, nl=False)
        for piece in pieces:
            typer.echo(piece, nl=False)
        typer.echo("")
        return
    else:
        typer.echo(gen.generate(prompt, streamer=counter, **options))
    seconds = time.perf_counter() - started
    new = counter.new  # speed on stderr: stdout stays the ids/text
    typer.echo(f"{new} new tokens in {seconds:.2f} s: {new / max(seconds, 1e-9):.1f} tokens/s", err=True)


class _Counter:
    """A streamer counting the new tokens (``generate(streamer=...)``)."""

    def __init__(self) -> None:
        self.new = -1  # the first put is the prompt

    def put(self, ids) -> None:
        self.new += 1

    def end(self) -> None:
        pass


@app.command()
@_flag_errors
def embed(
    texts: list[str] = typer.Argument(..., help="One or more texts."),
    model: Path = typer.Option(..., "--model", "-m", help="Hugging Face-format BERT folder with its tokenizer."),
    quantize: Optional[str] = typer.Option(
        None, "--quantize", help="int8: int8 inference (sublayer.models.quantized); a saved int8 folder loads as is."
    ),
    batch_size: int = typer.Option(32, "--batch-size", help="Texts per forward (sorted by length)."),
) -> None:
    """Sentence vectors from a BERT checkpoint: mean-pooled over tokens, L2-normalised (sublayer.text.Encoder; a
    sentence-transformers folder: its pooling and normalisation).

    Prints JSON: a list of {"text", "embedding"} objects. Texts longer than the model's positions are truncated.
    """
    import json

    from .text import Encoder

    encoder = Encoder.from_pretrained(_setup_inference(quantize, model), quantize=quantize)
    vectors = encoder.encode(list(texts), batch_size=batch_size)
    rows = [{"text": text, "embedding": v} for text, v in zip(texts, vectors.tolist())]
    typer.echo(json.dumps(rows))


# --- bench: sublayer's fused CPU paths vs eager PyTorch ------------------------------------------------------


@app.command()
@_flag_errors
def bench(
    out: Path = typer.Option(Path("runs/bench"), "--out", "-o", help="Folder for bench.json, bench.md, bench.png."),
    quick: bool = typer.Option(False, "--quick", help="One small shape, fewer repetitions (about a minute)."),
    compile: Optional[bool] = typer.Option(
        None, "--compile/--no-compile", help="Also time torch.compile of the eager references (default: full runs)."
    ),
    reps: Optional[int] = typer.Option(None, "--reps", min=1, help="Timed repetitions per case (median reported)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="torch threads (default: torch's)."),
    shapes: Optional[str] = typer.Option(None, "--shapes", help="Comma-separated substrings of shape names to run."),
    dtypes: str = typer.Option("fp32,bf16", "--dtypes", help="fp32, bf16 (autocast for FFN/blocks) and/or int8 (int8 BERT inference row)."),
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="BERT folder for the int8 row's weights."),
    cases: Optional[str] = typer.Option(None, "--cases", help="Comma-separated subset of addnorm,ffn,encoder,hf,bert,loss,models,gemv."),
    malloc: str = typer.Option(
        "both", "--malloc",
        help="Allocator setting(s) to measure under: default (glibc's), reuse (sublayer.set_memory_reuse) or both, "
        "side by side (the default one runs in a child process).",
    ),
    clock: str = typer.Option(
        "wall", "--clock", help="wall, or cpu: this process's CPU time (steadier on a shared machine; use --threads 1)."
    ),
    reuse_memory: bool = typer.Option(False, "--reuse-memory", help="Same as --malloc reuse."),
    decode: bool = typer.Option(
        False, "--decode", help="Run the decoding benchmark instead: GPT-2 generation tok/s and GB/s, fp32 and int8, "
        "vs HF and CTranslate2 (rows appear when ctranslate2 is installed: pip install ctranslate2)."
    ),
    jobs: bool = typer.Option(
        False, "--jobs", help="Run the whole-job suite instead: GPT-2 decoding vs CTranslate2, translate, training "
        "steps vs HF, int8 BERT, MiniLM embedding (--quick: tiny shapes)."
    ),
    only: Optional[str] = typer.Option(
        None, "--only", help="With --jobs: comma-separated subset of decode,translate,train,int8,embed,hf,demo (the "
        "default) and llama,llama-train (a SmolLM-135M-shaped Llama vs llama.cpp and HF), ov-embed,ov-decode (vs "
        "OpenVINO and OpenVINO GenAI)."
    ),
    contention: bool = typer.Option(
        False, "--contention", help="With --jobs: run every job quiet, then beside a competing busy process (one "
        "it starts), and report each ratio's busy / quiet."
    ),
    peers_env: Optional[Path] = typer.Option(
        None, "--peers-env", help="With --only llama or gpt2-llamacpp: the llama.cpp side environment (a venv "
        "with llama-cpp-python built from source), built there on first use by benchmarks/peers_env.sh "
        "(default: .peers-env, not built)."
    ),
    ov_env: Optional[Path] = typer.Option(
        None, "--ov-env", help="With --only ov-embed,ov-decode: the OpenVINO side environment (a venv with openvino, "
        "openvino-genai, optimum-intel), built there on first use by benchmarks/peers_env_openvino.sh (default: "
        ".peers-env-ov, not built)."
    ),
    report: Optional[Path] = typer.Option(
        None, "--report", help="Also write a markdown report (machine, versions, date, command, every row): a .md "
        "file, or a folder where it is named <subject>-<cpu kind>-<date>.md (e.g. benchmarks/results)."
    ),
    notes: str = typer.Option("", "--notes", help="A line for the report's header (e.g. the machine was shared)."),
) -> None:
    """Time sublayer's fused FFN / Add & Norm / EncoderBlock against eager PyTorch, HF and torch.compile."""
    # every flag checked before any work: a benchmark runs for minutes
    if decode and jobs:
        raise CLIError("--decode and --jobs are two benchmarks: give one of them")
    for flag, given in (("--only", only is not None), ("--contention", contention), ("--peers-env", peers_env),
                        ("--ov-env", ov_env)):  # fmt: skip
        if given and not jobs:
            raise CLIError(f"{flag} needs --jobs" + (" (it measures the whole jobs quiet and beside a busy process)"
                                                    if flag == "--contention" else ""))  # fmt: skip
    kernel_flags = {"--shapes": shapes is not None, "--cases": cases is not None, "--dtypes": dtypes != "fp32,bf16",
                    "--malloc": malloc != "both", "--clock": clock != "wall", "--reuse-memory": reuse_memory,
                    "--compile/--no-compile": compile is not None}  # fmt: skip
    for flag, given in kernel_flags.items():
        if given and (decode or jobs):
            raise CLIError(f"{flag} applies to the kernel benchmark, not to {'--decode' if decode else '--jobs'}")
    if decode and (model is not None or report is not None or notes):
        raise CLIError("--model, --report and --notes do not apply to --decode")
    if only is not None and not only.strip():
        raise CLIError("--only must name at least one job, got ''")
    if model is not None:
        _model_folder(model)
    if report is not None:
        if report.suffix == ".md" and report.is_dir():
            raise CLIError(f"--report: {report} is a folder; give a .md file or a folder without the suffix")
        try:
            (report.parent if report.suffix == ".md" else report).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CLIError(f"--report: cannot write {report}: {e.strerror or e}") from None
    if decode or jobs:
        import torch

        if threads is not None:
            torch.set_num_threads(threads)
    if jobs:
        from .bench.jobs import run_jobs
        from .bench.llama import use_peers_env
        from .bench.openvino_peer import use_ov_env

        use_peers_env(peers_env)
        use_ov_env(ov_env)
        run_jobs(quick=quick, reps=reps, only=only, model=model, work=out / "jobs", report=report, notes=notes,
                 contention=contention, log=typer.echo)  # fmt: skip
    elif decode:
        from .bench.decode import run_decode_bench

        run_decode_bench(out, quick=quick, reps=reps, log=typer.echo)
    else:
        from .bench import run_bench

        run_bench(out, quick=quick, use_compile=compile, reps=reps, threads=threads, shapes=shapes, dtypes=dtypes,
                  cases=cases, malloc=malloc, clock=clock, reuse_memory=reuse_memory, model=model, report=report,
                  notes=notes, log=typer.echo)  # fmt: skip


def main() -> None:
    # a command prints its own output only: no transformers notices or progress bars (a user's setting wins)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        code = app(standalone_mode=False)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as e:  # one line on stderr: click's usage errors, ours and the library's, any other
        usage, exit_, abort = _click_exception_types()
        if isinstance(e, usage):
            # one line, as every CLI error: "error: Missing parameter: texts" (none after the help that
            # `sublayer` alone prints: its usage error has no message)
            if e.format_message().strip():
                typer.echo(f"error: {e.format_message()}", err=True)
            sys.exit(2)
        if isinstance(e, exit_):
            sys.exit(e.exit_code)
        if isinstance(e, abort):
            sys.exit(130)
        if _state["debug"]:
            raise
        plain = isinstance(e, (CLIError, ValueError, TypeError, OSError))  # else the message after the type's name
        missing = isinstance(e, ModuleNotFoundError) and _missing_package(e.name)
        typer.echo(f"error: {missing or (e if plain else f'{type(e).__name__}: {e}')}", err=True)
        sys.exit(2)
    if isinstance(code, int) and code:  # typer returns (not raises) 130 for a KeyboardInterrupt in a command
        if code == 130:
            typer.echo("interrupted", err=True)
        sys.exit(code)


def _click_exception_types() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
    """click's exception classes — typer ≥ 0.2x ships its own copy of click, so check both."""
    import click

    mods = [click.exceptions]
    with contextlib.suppress(ImportError):
        from typer._click import exceptions

        mods.append(exceptions)
    return tuple(tuple(getattr(m, n) for m in mods if hasattr(m, n)) for n in ("ClickException", "Exit", "Abort"))

if __name__ == "__main__":
    main()
