"""A bisect session's phase results: typed in memory, stored as the JSON objects sessions have always held
(stores written by earlier versions read back, and the keys readers use stay)."""

from __future__ import annotations

from replay.bisect.session import BaselineResult, DataResult, HeadsResult, LayersResult, Phases, Session, StepsResult

# Phase documents as sessions of earlier versions stored them, one per outcome.
STORED = {
    "baseline": {"checkpoint": 20, "bitwise": True, "spike_at": 27, "probe": "steps-20-37"},
    "steps": {"checkpoint": 20, "last_preventing_step": 24, "first_failing_step": 25, "window": [20, 25],
              "separation": {"first_bit": 21, "measurable": 23, "relative": 1e-3}, "candidates": [10, 20],
              "bound": 4, "monotone": True},
    "layers": {"start": 20, "layers": [1], "also": [], "minimal": True, "bound": 11,
               "rerun": "replay run s --from 20 --to 37 --layers 1"},
    "heads": {"start": 20, "heads": [[1, 0]], "also": [[[1, 1]]], "minimal": False, "bound": 11,
              "rerun": "replay run s --from 20 --to 37 --heads 1.0"},
    "data": {"window": [20, 27], "batches": [27], "samples": [[27, 3]], "minimal": True, "bound": 90,
             "rerun": "replay run s --from 20 --to 38 --drop 27:3"},
}
NOTHING_FOUND = {
    "steps": {"checkpoint": None, "candidates": [10, 20], "bound": 2, "monotone": True},
    "layers": {"start": 20, "layers": None, "bound": 11},
    "heads": {"start": 20, "heads": None, "bound": 0},
    "data": {"window": [20, 27], "batches": None, "samples": None, "bound": 9, "spike_at_without": 30},
}


def test_stored_phases_read_back_typed_and_write_the_same_document():
    for stored in (STORED, {"baseline": STORED["baseline"], **NOTHING_FOUND}):
        phases = Phases.from_dict(stored)
        assert phases.to_dict() == stored
        assert all(list(phases.to_dict()[k]) == list(stored[k]) for k in stored)   # the keys, in their order


def test_each_phase_reads_as_attributes():
    p = Phases.from_dict(STORED)
    assert isinstance(p.baseline, BaselineResult) and p.baseline.bitwise and p.baseline.spike_at == 27
    assert isinstance(p.steps, StepsResult) and p.steps.window == [20, 25] and p.steps.separation.measurable == 23
    assert isinstance(p.layers, LayersResult) and p.layers.layers == [1] and p.layers.minimal
    assert isinstance(p.heads, HeadsResult) and p.heads.heads == [[1, 0]] and p.heads.minimal is False
    assert isinstance(p.data, DataResult) and p.data.samples == [[27, 3]] and p.data.spike_at_without is None
    empty = Phases.from_dict(NOTHING_FOUND)
    assert empty.baseline is None and empty.steps.checkpoint is None and empty.layers.minimal is None
    assert empty.data.batches is None and empty.data.spike_at_without == 30


def test_a_session_keeps_its_phases_through_the_store_format():
    doc = {"id": "spike-27-all-0", "params": {"spike": 27}, "rule": "r", "created": 0.0, "probes": {},
           "phases": STORED, "runs": [], "status": "running", "error": None, "verdict": None}
    session = Session.from_dict(doc)
    assert session.phases.heads.also == [[[1, 1]]]
    assert session.to_dict() == doc
    assert Session.from_dict({**doc, "phases": {}}).phases == Phases()   # a session before any phase ran
