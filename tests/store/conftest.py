"""The schema-1 store kept in tests/data (tests/data/README.md), copied for each test that uses `schema1`."""

import shutil
from pathlib import Path

import pytest

SCHEMA1 = Path(__file__).resolve().parents[1] / "data" / "schema1-run"


@pytest.fixture
def schema1(tmp_path) -> Path:
    store = tmp_path / "old"
    shutil.copytree(SCHEMA1, store)
    return store
