"""The examples' token file, written once by examples/nanogpt/prepare.py (the standard library's bytes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="session")
def token_file(tmp_path_factory) -> Path:
    """100 000 byte tokens: train.bin (90%) and val.bin."""
    out = tmp_path_factory.mktemp("tokens")
    done = subprocess.run([sys.executable, str(REPO / "examples/nanogpt/prepare.py"), "--out", str(out),
                           "--bytes", "100000"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return out / "train.bin"
