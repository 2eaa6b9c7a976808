"""Run configuration: small dataclasses, named presets, TOML files and `--set key=value` overrides.

A config is resolved once, before any rank starts, and stored whole in the run store's manifest; every
later component (replay, bisect, analysis) rebuilds the run from that stored copy, never from defaults.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any

from replay.errors import UsageError

PRECISIONS = ("fp32", "bf16")   # FP32, or BF16 autocast (DeepSpeed's BF16 mode under DeepSpeed)


class Launcher(StrEnum):
    """What started a run's ranks. A str, so stored manifests and configs read and write it as before;
    what each can do is replay/store/capabilities.py's."""

    LOCAL = "local"               # the built-in trainer on torch.distributed ranks
    DEEPSPEED = "deepspeed"       # the built-in trainer in a DeepSpeed engine (ZeRO stage 0-2)
    CUSTOM = "custom"             # a training loop of the user's own (replay.recorder)


@dataclass
class ModelConfig:
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    block_size: int = 64          # sequence length of every sample (GPT-2's n_positions)
    vocab_size: int = 0           # 0: taken from the data (256 for the built-in byte corpus)
    dropout: float = 0.0          # off by default; if on, its masks replay from the recorded RNG states
    attention: str = "eager"      # attention plan: a backend for every layer/head (replay.kernels.plan)


@dataclass
class DataConfig:
    path: str = ""                # nanoGPT-style token file (train.bin); "" = the built-in byte corpus
    dtype: str = "uint16"         # uint16, or uint32 for vocabularies above 65,535
    max_samples: int = 0          # 0: every window of the file; N: only the first N (memorisation runs)
    corpus_bytes: int = 1 << 21   # size of the built-in byte corpus


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    decay_steps: int = 0          # 0: cosine decay over the whole run
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0        # 0 disables clipping (the norm is still recorded)


@dataclass
class SpikeConfig:
    window: int = 50              # recent global losses the robust baseline is computed from
    threshold: float = 6.0        # fires when loss > median + threshold * 1.4826 * MAD ...
    min_rise: float = 0.5         # ... and loss > median * (1 + min_rise): ignores noise on flat curves
    min_delta: float = 0.0        # ... and loss > median + min_delta (nats): ignores wobbles of a loss near 0
    warmup: int = 20              # no detection before this many steps


@dataclass(frozen=True)
class Cadence:
    """When a run's state is kept: a checkpoint every `checkpoint_every` steps and after the last; between
    them an in-memory snapshot every `snapshot_every` steps (0: none), of which the last `snapshot_ring` are
    written when a spike fires. One rule for the config, `Loop`'s keywords and the `Recorder`'s."""

    checkpoint_every: int = 20
    snapshot_every: int = 0
    snapshot_ring: int = 3

    LEAST = {"checkpoint_every": 1, "snapshot_every": 0, "snapshot_ring": 1}   # the lowest of each

    def check(self, owner: str) -> None:
        """Refuse, in one line naming `owner`'s key (`owner` + key: "Loop(", "RecorderConfig."), a value that
        is not a whole number at or above its lowest."""
        for key, least in self.LEAST.items():
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                meaning = " (0: no snapshots)" if key == "snapshot_every" else ""
                raise UsageError(f"{owner}{key}={value!r}{')' if owner.endswith('(') else ''}: a whole number "
                                 f">= {least}{meaning}")

    def due(self, checkpoint: int, total_steps: int) -> str | None:
        """What is kept of the state after `checkpoint` steps: "checkpoint", "snapshot" or None."""
        if checkpoint % self.checkpoint_every == 0 or checkpoint == total_steps:
            return "checkpoint"
        if self.snapshot_every and checkpoint % self.snapshot_every == 0:
            return "snapshot"
        return None


@dataclass
class RunConfig:
    preset: str = "tiny"
    seed: int = 1337
    steps: int = 40
    batch_size: int = 8           # sequences per optimizer step, over all ranks: the data order
    micro_batch_size: int = 4     # sequences per rank per forward pass; accumulation fills the rest
    precision: str = "fp32"       # fp32, or bf16 (autocast; DeepSpeed's bf16 mode under DeepSpeed)
    device: str = "auto"          # auto, cpu or cuda
    threads: int = 0              # torch intra-op threads per rank; 0 = cores // local ranks (recorded)
    nproc: int = 1
    launcher: Launcher = Launcher.LOCAL   # local or deepspeed (a config's runs are the built-in trainer's)
    zero_stage: int = 0
    checkpoint_every: int = 20
    snapshot_every: int = 5       # in-memory snapshot cadence (0 disables the pre-spike ring)
    snapshot_ring: int = 3        # snapshots kept in memory, flushed to the store when a spike fires
    log_every: int = 10
    numerics: bool = False        # per-step attention numerics of the emulated backends (kernels/numerics.py)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    spike: SpikeConfig = field(default_factory=SpikeConfig)

    def validate(self) -> None:
        """Refuse, in one line naming the key and its value, what no run can train with: before any store is
        made."""
        _check_choices(self)
        for key in all_keys(self):
            _check_number(key, _value(self, key))
        _check_shapes(self)

    @property
    def cadence(self) -> Cadence:
        return Cadence(self.checkpoint_every, self.snapshot_every, self.snapshot_ring)

    @property
    def grad_accum(self) -> int:
        return self.batch_size // (self.micro_batch_size * self.nproc)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "launcher": self.launcher.value}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        cfg = cls()
        _apply_mapping(cfg, d, prefix="")
        return cfg


# Where each number of a config may lie: (lowest, highest), None for no bound. The keys of _BELOW_HIGHEST stop
# short of their highest; every float must also be finite.
_RANGES: dict[str, tuple[float | None, float | None]] = {
    "seed": (0, 2**63 - 1), "steps": (1, None), "batch_size": (1, None), "micro_batch_size": (1, None),
    "threads": (0, None), "nproc": (1, None), "log_every": (1, None),
    **{key: (least, None) for key, least in Cadence.LEAST.items()},
    "model.n_layer": (1, None), "model.n_head": (1, None), "model.n_embd": (1, None), "model.block_size": (1, None),
    "model.vocab_size": (0, None), "model.dropout": (0, 1),
    "data.max_samples": (0, None), "data.corpus_bytes": (1, None),
    "optim.lr": (0, None), "optim.min_lr": (0, None), "optim.warmup_steps": (0, None),
    "optim.decay_steps": (0, None), "optim.beta1": (0, 1), "optim.beta2": (0, 1), "optim.eps": (0, None),
    "optim.weight_decay": (0, None), "optim.grad_clip": (0, None),
    "spike.window": (3, None),   # the detector needs 3 losses (recorder/spikes.py)
    "spike.threshold": (0, None), "spike.min_rise": (0, None), "spike.min_delta": (0, None), "spike.warmup": (0, None),
}
_BELOW_HIGHEST = {"model.dropout", "optim.beta1", "optim.beta2"}
_MEANING = {"threads": " (0: cores // local ranks)", "snapshot_every": " (0: no pre-spike snapshots)"}


def _value(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _check_number(key: str, value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"{key} must be a finite number, got {value}")
    if key not in _RANGES:
        return
    low, high = _RANGES[key]
    if high is None:
        if low is not None and value < low:
            raise UsageError(f"{key} must be >= {low}{_MEANING.get(key, '')}, got {value}")
    elif key in _BELOW_HIGHEST and not low <= value < high:
        raise UsageError(f"{key} must be >= {low} and < {high}, got {value}")
    elif not low <= value <= high:
        raise UsageError(f"{key} must be between {low} and {high}, got {value}")


def _check_choices(cfg: RunConfig) -> None:
    if cfg.precision not in PRECISIONS:
        raise UsageError(f"precision must be one of {', '.join(PRECISIONS)}, got {cfg.precision!r}")
    if cfg.launcher not in (Launcher.LOCAL, Launcher.DEEPSPEED):
        raise UsageError(f"launcher must be local or deepspeed, got {str(cfg.launcher)!r}")
    if cfg.zero_stage not in (0, 1, 2):
        raise UsageError(f"zero stage must be 0, 1 or 2, got {cfg.zero_stage}")
    if cfg.zero_stage and cfg.launcher is not Launcher.DEEPSPEED:
        raise UsageError("--zero-stage needs --launcher deepspeed")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"device must be auto, cpu or cuda, got {cfg.device!r}")
    if cfg.data.dtype not in ("uint16", "uint32"):
        raise UsageError(f"data.dtype must be uint16 or uint32, got {cfg.data.dtype!r}")


def _check_shapes(cfg: RunConfig) -> None:
    """What the numbers must be together: a batch the ranks' passes fill, heads that split the width."""
    per_pass = cfg.micro_batch_size * cfg.nproc
    if cfg.batch_size % per_pass:
        raise UsageError(
            f"batch_size {cfg.batch_size} is not a multiple of micro_batch_size x nproc = {per_pass}; "
            "change --set batch_size=... or --set micro_batch_size=..."
        )
    if cfg.model.n_embd % cfg.model.n_head:
        raise UsageError(f"model.n_embd {cfg.model.n_embd} is not divisible by model.n_head {cfg.model.n_head}")


PRESETS: dict[str, dict[str, Any]] = {
    # Seconds on 2 CPU cores.
    "tiny": {},
    # A genuine loss spike on CPU (measured on 2 CPU cores): a 2-layer, 64-wide GPT-2 memorising
    # 8 fixed sequences with AdamW lr 3e-3, beta2 0.95 and no warmup spikes around step 280. A
    # memorisation spike: an optimiser instability on a tiny problem, not the papers' BF16 mechanism.
    "spike": {
        "steps": 400,
        "batch_size": 8,
        "micro_batch_size": 4,
        "checkpoint_every": 50,
        "snapshot_every": 10,
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64},
        "data": {"max_samples": 8},
        "optim": {"lr": 3e-3, "min_lr": 3e-3, "warmup_steps": 0, "beta2": 0.95, "grad_clip": 1.0},
    },
    # The papers' model (Qiu & Yao's recipe); needs a GPU and a tokenised corpus (--data train.bin).
    "gpt2-small": {
        "steps": 10000,
        "batch_size": 32,
        "micro_batch_size": 8,
        "precision": "bf16",
        "checkpoint_every": 500,
        "snapshot_every": 50,
        "model": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "vocab_size": 50304},
        "optim": {"lr": 1e-3, "min_lr": 1e-5, "warmup_steps": 2000, "beta2": 0.95, "grad_clip": 1.0},
    },
    "gpt2-medium": {
        "steps": 10000,
        "batch_size": 32,
        "micro_batch_size": 4,
        "precision": "bf16",
        "checkpoint_every": 500,
        "snapshot_every": 50,
        "model": {"n_layer": 24, "n_head": 16, "n_embd": 1024, "block_size": 1024, "vocab_size": 50304},
        "optim": {"lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 2000, "beta2": 0.95, "grad_clip": 1.0},
    },
}


def _apply_mapping(obj: Any, mapping: dict[str, Any], prefix: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if key not in fields:
            raise UsageError(f"unknown config key {name!r}; known keys: {', '.join(all_keys())}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise UsageError(f"config key {name!r} is a section; set its fields as {name}.FIELD=VALUE")
            _apply_mapping(current, value, prefix=f"{name}.")
        else:
            setattr(obj, key, _coerce(name, value, type(current)))


_BOOLS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


def _coerce(name: str, value: Any, typ: type) -> Any:
    if issubclass(typ, Enum):
        try:
            return typ(value)
        except ValueError:
            accepted = [m.value for m in typ if m is not Launcher.CUSTOM]   # a config's runs are the built-in trainer's
            raise UsageError(f"config key {name!r} expects one of {', '.join(accepted)}, got {value!r}") from None
    if isinstance(value, str) and typ is bool:
        if value.strip().lower() not in _BOOLS:
            raise UsageError(f"config key {name!r} expects true or false, got {value!r}")
        return _BOOLS[value.strip().lower()]
    if isinstance(value, str) and typ is not str:
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise UsageError(f"config key {name!r} expects a {typ.__name__}, got {value!r}") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise UsageError(f"config key {name!r} expects a {typ.__name__}, got {value!r}")
    return value


def all_keys(obj: Any = None, prefix: str = "") -> list[str]:
    obj = RunConfig() if obj is None else obj
    keys = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys += all_keys(value, prefix=f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def parse_sets(pairs: list[str]) -> dict[str, Any]:
    """`a.b=1` pairs to a nested mapping (values stay strings; coerced against the field's type)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--set expects key=value, got {pair!r}")
        node = out
        *parents, leaf = key.strip().split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def build_config(
    preset: str = "tiny",
    config_file: str | None = None,
    sets: list[str] | None = None,
    **flags: Any,
) -> RunConfig:
    """Preset, then the TOML file, then command-line flags, then `--set` pairs: later wins."""
    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    cfg = RunConfig(preset=preset)
    _apply_mapping(cfg, PRESETS[preset], prefix="")
    if config_file:
        _apply_mapping(cfg, read_toml(Path(config_file)), prefix="")
    _apply_mapping(cfg, {k: v for k, v in flags.items() if v is not None}, prefix="")
    _apply_mapping(cfg, parse_sets(sets or []), prefix="")
    cfg.validate()
    return cfg


def read_toml(path: Path) -> dict[str, Any]:
    """A config file's fields; what is not a readable UTF-8 TOML file is refused naming the file."""
    if not path.is_file():
        raise UsageError(f"config file {path} does not exist")
    try:
        text = path.read_bytes().decode("utf-8")
        return tomllib.loads(text)
    except OSError as e:
        raise UsageError(f"config file {path} cannot be read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise UsageError(f"config file {path} is not UTF-8 text, as TOML must be: save it as UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"config file {path} is not valid TOML: {e}") from None


def unknown_keys(mapping: dict[str, Any], obj: Any = None, prefix: str = "") -> list[str]:
    """The keys of a config mapping (a stored one) that no field of this version's config has."""
    obj = RunConfig() if obj is None else obj
    fields = {f.name for f in dataclasses.fields(obj)}
    unknown = [f"{prefix}{key}" for key in mapping if key not in fields]
    for key in fields & set(mapping):
        value = getattr(obj, key)
        if dataclasses.is_dataclass(value) and isinstance(mapping[key], dict):
            unknown += unknown_keys(mapping[key], value, prefix=f"{prefix}{key}.")
    return unknown
