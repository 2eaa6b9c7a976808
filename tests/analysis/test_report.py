"""`replay report` refusing what it cannot report (the report of a real spike: test_report_integration.py)."""

from __future__ import annotations

from tests.conftest import error_line, replay_cli


def test_report_needs_a_store(tmp_path):
    assert "does not exist" in error_line(replay_cli("report", str(tmp_path / "missing")))
