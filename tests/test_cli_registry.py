"""The glm52 subcommand registry: every COMMANDS entry registers exactly its subcommand."""

import subprocess
import sys

import pytest

from paddleformers_glm import cli


def test_every_listed_subcommand_is_registered_under_its_name():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert sorted(sub.choices) == sorted(name for name, _ in cli.COMMANDS)


def test_an_entry_that_registers_another_name_is_refused(monkeypatch):
    monkeypatch.setattr(cli, "COMMANDS", [("check-ckpt", "paddleformers_glm.parity.commands:register_check_loss")])
    with pytest.raises(RuntimeError, match="register_check_loss did not register the subcommand 'check-ckpt'"):
        cli.build_parser()


def test_python_dash_m_runs_the_cli():
    out = subprocess.run(
        [sys.executable, "-m", "paddleformers_glm.cli", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for name, _ in cli.COMMANDS:
        assert name in out.stdout
