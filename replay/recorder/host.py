"""The machine and the packages a run ran on, and what differs from them now. No torch: a launcher
compares them before any rank starts (recorder/environment.py adds how torch computes)."""

from __future__ import annotations

import os
import platform
import socket
from importlib import metadata
from typing import Any

_PACKAGES = ("torch", "transformers", "deepspeed", "numpy", "zarr", "triton")
NODE_ENV = "REPLAY_NODE"   # a node's name where the hostname does not tell it (launch/ray_ranks.py: the Ray node)


def host() -> dict[str, Any]:
    versions: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"python": platform.python_version(), "packages": versions, "platform": platform.platform(),
            "machine": platform.machine(), "processor": _cpu_model(), "hostname": socket.gethostname()}


def this_node() -> tuple[int, str]:
    """(node rank, node name) of this process: torchrun's GROUP_RANK tells two agents on one host apart."""
    return int(os.environ.get("GROUP_RANK", 0)), os.environ.get(NODE_ENV) or socket.gethostname()


def environment_notes(recorded: dict[str, Any]) -> list[str]:
    """What differs from the recording's environment, and so may break bitwise equality."""
    if not recorded:
        return ["the record has no environment fingerprint; bitwise equality is not guaranteed"]
    now = host()
    notes = []
    for key in ("python", "machine", "processor"):
        if recorded.get(key) != now.get(key):
            notes.append(f"{key}: recorded {recorded.get(key)}, now {now.get(key)}")
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
    for key in ("torch_threads", "deterministic_algorithms", "tf32", "device", "python", "machine", "processor"):
        if key in recorded and recorded.get(key) != replayed.get(key):
            out.append(f"{key}: recorded {recorded.get(key)}, replayed {replayed.get(key)}")
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


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
