"""The machine and the packages a run ran on, and what differs from them now. No torch: a launcher
compares them before any rank starts (recorder/environment.py adds how torch computes)."""

from __future__ import annotations

import os
import platform
import socket
from importlib import metadata
from typing import Any

_PACKAGES = ("torch", "transformers", "deepspeed", "numpy", "zarr", "triton")
# The x86 instruction sets torch's, oneDNN's and MKL's CPU kernels choose between, and with them the order in which
# a product sums: two machines of one model name may differ in them (a cloud VM's "AMD EPYC" with and without
# AVX-512), and then in the bits they compute. On ARM, the same for its vector and matrix extensions.
_ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
              "asimd", "asimdhp", "asimddp", "fphp", "sve", "sve2", "bf16", "i8mm", "svebf16", "svei8mm", "sme")
NODE_ENV = "REPLAY_NODE"   # a node's name where the hostname does not tell it (launch/ray_ranks.py: the Ray node)


def host() -> dict[str, Any]:
    versions: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"python": platform.python_version(), "packages": versions, "platform": platform.platform(),
            "machine": platform.machine(), "processor": cpu_model(), "cpu_flags": _cpu_flags(),
            "hostname": socket.gethostname()}


def this_node() -> tuple[int, str]:
    """(node rank, node name) of this process: torchrun's GROUP_RANK tells two agents on one host apart."""
    return int(os.environ.get("GROUP_RANK", 0)), os.environ.get(NODE_ENV) or socket.gethostname()


def environment_notes(recorded: dict[str, Any]) -> list[str]:
    """What differs from the recording's environment, and so may break bitwise equality."""
    if not recorded:
        return ["the record has no environment fingerprint; bitwise equality is not guaranteed"]
    now = host()
    notes = _differing(recorded, now, ("python", "machine", "processor", "cpu_flags"), "now", "this machine")
    for pkg, version in recorded.get("packages", {}).items():
        if now["packages"].get(pkg) != version:
            notes.append(f"{pkg}: recorded {version}, now {now['packages'].get(pkg)}")
    return notes


def differences(recorded: dict[str, Any], replayed: dict[str, Any]) -> list[str]:
    """What differs between the environments a run and its replay ran in (two fingerprints of
    recorder/environment.py), the likeliest cause of a difference in the bits first: the autocast the forward
    ran under, the launchers' variables, how torch computes, then the machine and the packages."""
    if not recorded or not replayed:
        return []
    out = []
    if recorded.get("autocast") and replayed.get("autocast") and recorded["autocast"] != replayed["autocast"]:
        out.append(f"the forward ran under autocast {replayed['autocast']}, the record's under {recorded['autocast']}")
    was, now = recorded.get("env") or {}, replayed.get("env") or {}
    for key in sorted(set(was) | set(now)):
        if was.get(key) != now.get(key) and _covers(recorded, key) and _covers(replayed, key):
            out.append(f"{key}: recorded {_value(was.get(key))}, replayed {_value(now.get(key))}")
    out += _differing(recorded, replayed, ("torch_threads", "deterministic_algorithms", "tf32", "device",
                                           "cpu_capability", "cpu_flags", "python", "machine", "processor"),
                      "replayed", "the replay's")
    packages = replayed.get("packages") or {}
    out += [f"{pkg}: recorded {version}, replayed {packages.get(pkg)}"
            for pkg, version in (recorded.get("packages") or {}).items() if packages.get(pkg) != version]
    return out


def _covers(fingerprint: dict[str, Any], key: str) -> bool:
    """Whether a fingerprint's `env` says whether `key` was set (one of an earlier version holds three names)."""
    covers = fingerprint.get("env_covers") or {"names": ["OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                                         "CUBLAS_WORKSPACE_CONFIG"], "prefixes": []}
    return key in covers["names"] or key.startswith(tuple(covers["prefixes"]))


def _value(value: str | None) -> str:
    return "unset" if value is None else repr(value)


def _differing(recorded: dict[str, Any], other: dict[str, Any], keys: tuple[str, ...], side: str,
               where: str) -> list[str]:
    """A note for each of `keys` the record has that `other` (a fingerprint, or this machine's `host()`) has
    otherwise; `side` and `where` name `other` in them ("replayed", "the replay's")."""
    notes: list[str] = []
    for key in (k for k in keys if k in recorded):
        if key == "cpu_flags":
            notes += [note] if (note := flags_differ(recorded[key], other.get(key), where)) else []
        elif recorded[key] != other.get(key):
            notes.append(f"{key}: recorded {recorded[key]}, {side} {other.get(key)}")
    return notes


def flags_differ(recorded: list[str], other: list[str] | None, where: str) -> str | None:
    """The CPU instruction sets the recording's machine and `where` ("this machine", "the replay's") do not share,
    as a note; None where they are the same."""
    if other is None:
        return f"CPU instruction sets: recorded {' '.join(recorded) or 'none'}, unknown on {where}"
    gone, new = [f for f in recorded if f not in other], [f for f in other if f not in recorded]
    if not gone and not new:
        return None
    parts = ([f"{' '.join(gone)} on the recording's CPU only"] if gone else []) + \
            ([f"{' '.join(new)} on {where} only"] if new else [])
    return f"CPU instruction sets: {', '.join(parts)}"


def _cpu_flags() -> list[str]:
    """The CPU's instruction sets that decide which kernels compute (`_ISA_FLAGS`), in /proc/cpuinfo's order."""
    named = _cpuinfo("flags") or _cpuinfo("Features") or ""   # x86's name for them, ARM's
    return [n for n in named.split() if n in _ISA_FLAGS]


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor()


def _cpuinfo(key: str) -> str | None:
    """The first value of `key` in /proc/cpuinfo (None without it, or without /proc)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return None
