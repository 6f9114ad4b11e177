"""Every pipeline's commands end a known failure with one line naming its cause and fix, under the
real traceback, through the one table in raytrain_common.known_errors; other errors stay as they
are.

Each command here fails for real (a port bound twice, a key that is missing) inside the pipeline's
own `main`; the failures that need a training run are tested in the pipelines (a NaN loss in
mnist_resnet's test_train.py)."""

from __future__ import annotations

import importlib
import socket
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIPELINES = sorted(p.parent.name for p in ROOT.glob("pipelines/[!.]*/pyproject.toml"))


def bind_a_port_twice(args: Any) -> int:
    with socket.socket() as first, socket.socket() as second:
        first.bind(("127.0.0.1", 0))
        first.listen()
        second.bind(first.getsockname())
    return 0


def look_up_a_missing_key(args: Any) -> int:
    return {}["missing"]


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_a_known_failure_ends_with_its_cause_and_fix_and_an_unknown_one_is_raised(
    pipeline: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cli = importlib.import_module(f"{pipeline}.cli")
    command = next(name for name in cli.COMMANDS if name != "prepare")
    # The real parser and `main`; only the command's body is replaced by one that fails for real.
    monkeypatch.setitem(cli.COMMANDS, command, bind_a_port_twice)
    code = cli.main(_minimal_argv(cli, command))
    lines = capsys.readouterr().err.rstrip().splitlines()
    assert code == 1
    assert "Traceback" in lines[0] and "Address already in use" in "\n".join(lines)
    assert lines[-1].startswith(f"{cli.build_parser().prog} {command}: known failure (port in use)")

    monkeypatch.setitem(cli.COMMANDS, command, look_up_a_missing_key)
    with pytest.raises(KeyError):
        cli.main(_minimal_argv(cli, command))


def _minimal_argv(cli: Any, command: str) -> list[str]:
    """The command with the fewest arguments its parser accepts (positional inputs filled in)."""
    parser = cli.build_parser()
    for extra in ([], ["input.txt"]):
        try:
            parser.parse_args([command, *extra])
            return [command, *extra]
        except SystemExit:
            continue
    raise AssertionError(f"{command} needs more than one positional argument")
