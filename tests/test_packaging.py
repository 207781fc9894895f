"""The package without its extras: checkpoint loading works (safetensors is core), and a missing optional extra
(typer/rich/matplotlib/tokenizers for the CLI, transformers) is named in one line with its pip command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLI_HINT = " (sublayer's cli extra): pip install typer rich matplotlib tokenizers"
OPTIONAL = {"typer", "click", "rich", "matplotlib", "tokenizers", "transformers"}


def test_core_dependencies_cover_the_library():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {d.split(">")[0].split("=")[0].split("[")[0].strip() for d in meta["dependencies"]}
    assert {"torch", "safetensors", "ninja"} <= core
    # importing the library and loading/saving checkpoints touches no optional package
    code = (
        "import sys, sublayer, sublayer.models, sublayer.checkpoints, sublayer.checkpoints.io\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({sorted(OPTIONAL)!r})))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_cli_without_typer_is_one_line():
    # `sublayer --help` installed without the cli extra: the entry point imports sublayer.cli
    code = (
        "import sys, runpy\n"
        "sys.modules['typer'] = None\n"  # makes `import typer` raise ModuleNotFoundError(name='typer')
        "sys.argv = ['sublayer', '--help']\n"
        "runpy.run_module('sublayer.cli', run_name='__main__')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip() == f"error: 'typer' is not installed{CLI_HINT}", res.stderr


@pytest.mark.parametrize(
    "module, hint",
    [("matplotlib.pyplot", CLI_HINT), ("rich", CLI_HINT), ("transformers", ": pip install transformers")],
)
def test_a_command_missing_an_extra_is_one_line(monkeypatch, capsys, module, hint):
    from sublayer import cli

    monkeypatch.setitem(sys.modules, module.split(".")[0], None)
    monkeypatch.setattr(cli.app, "registered_commands", list(cli.app.registered_commands))

    @cli.app.command("needs-extra")
    def needs_extra() -> None:
        __import__(module)

    monkeypatch.setattr(sys, "argv", ["sublayer", "needs-extra"])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: '{module.split('.')[0]}' is not installed{hint}", err


def test_info_from_a_source_checkout_without_package_metadata():
    # `PYTHONPATH=src python -m sublayer.cli info` in a checkout that was never pip-installed: no dist-info to read
    code = (
        "import importlib.metadata as md, sys, runpy\n"
        "def missing(name):\n"
        "    raise md.PackageNotFoundError(name)\n"
        "md.version = missing\n"
        "sys.argv = ['sublayer', 'info']\n"
        "runpy.run_module('sublayer.cli', run_name='__main__')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert any(ln.split()[:4] == ["sublayer", "not", "installed", "(a"] for ln in res.stdout.splitlines()), res.stdout
