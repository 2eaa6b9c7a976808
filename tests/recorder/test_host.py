"""The machine a run ran on, as its record keeps it, and what differs from it now (recorder/host.py)."""

from __future__ import annotations

from replay.recorder.host import differences, environment_notes, flags_differ, host


def test_the_instruction_sets_the_cpu_names_are_kept_in_its_order():
    flags = host()["cpu_flags"]
    with open("/proc/cpuinfo") as f:
        line = next(line for line in f if line.split(":")[0].strip() in ("flags", "Features"))
    named = line.split(":", 1)[1].split()
    assert flags == [f for f in named if f in flags] and set(flags) <= set(named)
    assert ("avx" in flags or "avx" not in named) and ("asimd" in flags or "asimd" not in named)   # the vector ones


def test_a_record_from_a_cpu_with_other_instruction_sets_is_noted_before_any_rank_starts():
    now = host()
    recorded = {**now, "cpu_flags": [*now["cpu_flags"], "amx_fp16"][1:]}
    dropped = now["cpu_flags"][0]
    assert environment_notes(recorded) == \
        [f"CPU instruction sets: amx_fp16 on the recording's CPU only, {dropped} on this machine only"]
    assert environment_notes(now) == []
    older = {k: v for k, v in now.items() if k != "cpu_flags"}   # recorded before the flags were kept: nothing said
    assert environment_notes(older) == []


def test_flags_name_each_side_and_unknown_ones():
    assert flags_differ(["avx2", "fma"], ["fma", "avx2"], "this machine") is None   # the order is not compared
    assert flags_differ(["avx2", "avx512f", "avx512bw"], ["avx2"], "the replay's") == \
        "CPU instruction sets: avx512f avx512bw on the recording's CPU only"
    assert flags_differ(["avx2"], None, "the replay's") == \
        "CPU instruction sets: recorded avx2, unknown on the replay's"


def test_torchs_cpu_capability_is_named_before_the_machine():
    recorded = {"cpu_capability": "AVX512", "cpu_flags": ["avx2", "avx512f"], "processor": "AMD EPYC", "python": "3.11"}
    replayed = {**recorded, "cpu_capability": "AVX2", "cpu_flags": ["avx2"], "python": "3.12"}
    assert differences(recorded, replayed) == [
        "cpu_capability: recorded AVX512, replayed AVX2",
        "CPU instruction sets: avx512f on the recording's CPU only",
        "python: recorded 3.11, replayed 3.12"]
    assert differences(recorded, dict(recorded)) == []
