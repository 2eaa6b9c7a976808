"""The command line's own parsing: a bad option, value, argument or command is one `error:` line that names
it and the help that lists what the command takes, exit code 2, before anything runs."""

from __future__ import annotations

import pytest

from tests.conftest import error_line, replay_cli


@pytest.mark.parametrize("args, names, command", [
    (["run", "S", "--from", "1", "--to", "2", "--precision", "fp8"], ["'--precision'", "'fp8'", "'bf16'"],
     "replay run"),
    (["record", "--stpes", "3"], ["--stpes"], "replay record"),
    (["analyze", "S", "--workers", "many"], ["'--workers'", "'many'"], "replay analyze"),
    (["bisect"], ["STORE"], "replay bisect"),
    (["frobnicate"], ["'frobnicate'"], "replay"),
])
def test_a_usage_mistake_is_one_line_naming_it_and_the_help(tmp_path, args, names, command):
    result = replay_cli(*[str(tmp_path / "S") if a == "S" else a for a in args])
    line = error_line(result)
    assert result.returncode == 2 and result.stderr.strip() == line   # no usage block, no hint, no traceback
    assert all(name in line for name in names), line
    assert line.endswith(f"; see `{command} --help`")
    assert not (tmp_path / "S").exists()


def test_help_and_the_bare_command_still_print_the_help():
    assert "Commands:" in replay_cli("--help").stdout
    bare = replay_cli()
    assert "Commands:" in bare.stdout + bare.stderr and "error:" not in bare.stderr
