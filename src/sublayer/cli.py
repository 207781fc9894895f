"""The ``sublayer`` command line: ``demo`` (the main job), ``generate``, ``embed``, ``bench``, ``info``.

Errors are one line on stderr with exit code 2 (a traceback only with ``--debug``).
Each command's work lives in its own module, imported lazily so ``sublayer info`` starts fast.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="sublayer: Transformer sub-layers, models and demos.")
_state = {"debug": False}


class CLIError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors.")) -> None:
    _state["debug"] = debug


@app.command()
def info() -> None:
    """Versions, threads, CPU features and whether the fast kernels are active."""
    import platform

    import torch

    import sublayer

    rows = {
        "sublayer": sublayer.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": str(torch.get_num_threads()),
        "cpu capability": torch.backends.cpu.get_cpu_capability(),
    }
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split()
        rows["avx512"] = "yes" if "avx512f" in flags else "no"
        rows["amx-bf16"] = "yes" if "amx_bf16" in flags else "no"
    except (OSError, IndexError):
        pass
    for k, v in rows.items():
        typer.echo(f"{k:16s} {v}")


def main() -> None:
    try:
        app(standalone_mode=False)
    except CLIError as e:
        if _state["debug"]:
            raise
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except (ValueError, TypeError, FileNotFoundError, OSError) as e:
        if _state["debug"]:
            raise
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as e:  # click usage errors and the like
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(2)
        if isinstance(e, click.exceptions.Exit):
            sys.exit(e.exit_code)
        if isinstance(e, click.exceptions.Abort):
            sys.exit(130)
        if _state["debug"]:
            raise
        typer.echo(f"error: {type(e).__name__}: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
