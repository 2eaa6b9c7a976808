"""results/common.py: what `make results` says it reused, by section."""

from __future__ import annotations

import threading

from results.common import Context


def test_a_reused_output_is_credited_to_the_section_whose_thread_reuses_it(tmp_path):
    ctx = Context(out=tmp_path, work=tmp_path)
    worker = threading.Thread(target=ctx.note_reused, args=(str(tmp_path / "demo"),), name="results.story.story")
    worker.start()
    worker.join()
    ctx.note_reused("replay info x")
    assert ctx.reused == [("results.story.story", str(tmp_path / "demo")), ("MainThread", "replay info x")]
