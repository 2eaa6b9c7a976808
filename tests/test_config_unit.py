"""The run configuration's checks (config.py), each one alone: what a user can get wrong is refused with a
UsageError that names the key and the value, and what is right is taken as meant."""

from __future__ import annotations

import pytest

from replay.config import RunConfig, build_config, parse_sets, unknown_keys
from replay.errors import UsageError


@pytest.mark.parametrize("sets, match", [
    (["steps=0"], "steps must be >= 1, got 0"),
    (["precision=fp16"], "precision must be one of fp32, bf16, got 'fp16'"),
    (["launcher=slurm"], "config key 'launcher' expects one of local, deepspeed, got 'slurm'"),
    (["launcher=deepspeed", "zero_stage=3"], "zero stage must be 0, 1 or 2, got 3"),
    (["device=tpu"], "device must be auto, cpu or cuda, got 'tpu'"),
    (["nproc=0"], "nproc must be >= 1, got 0"),
    (["checkpoint_every=0"], "checkpoint_every must be >= 1, got 0"),
    (["log_every=-1"], "log_every must be >= 1, got -1"),
    (["micro_batch_size=0"], "micro_batch_size must be >= 1, got 0"),
    (["snapshot_ring=0"], "snapshot_ring must be >= 1, got 0"),
    (["snapshot_every=-5"], "snapshot_every must be >= 0"),
    (["nproc=3"], r"batch_size 8 is not a multiple of micro_batch_size x nproc = 12"),
    (["model.n_head=3"], "model.n_embd 64 is not divisible by model.n_head 3"),
    (["data.dtype=int64"], "data.dtype must be uint16 or uint32, got 'int64'"),
    (["threads=-1"], r"threads must be >= 0 \(0: cores // local ranks\), got -1"),
    (["seed=-1"], "seed must be between 0 and 9223372036854775807, got -1"),
    (["model.dropout=1"], "model.dropout must be >= 0 and < 1, got 1.0"),
    (["optim.beta1=-0.1"], "optim.beta1 must be >= 0 and < 1, got -0.1"),
    (["optim.lr=NaN"], "optim.lr must be a finite number, got nan"),
    (["spike.threshold=-Infinity"], "spike.threshold must be a finite number, got -inf"),
    (["model.n_head=0"], "model.n_head must be >= 1, got 0"),   # before the division by it
    (["model.vocab_size=-1"], "model.vocab_size must be >= 0, got -1"),
    (["spike.window=2"], "spike.window must be >= 3, got 2"),
    (["optim.grad_clip=-1"], "optim.grad_clip must be >= 0, got -1.0"),
])
def test_each_invalid_setting_is_named_with_its_value(sets, match):
    with pytest.raises(UsageError, match=match):
        build_config(sets=sets)


@pytest.mark.parametrize("sets", [
    ["snapshot_every=0"],                                 # no pre-spike snapshots
    ["launcher=deepspeed", "zero_stage=2"],
    ["nproc=2", "micro_batch_size=2", "batch_size=12"],   # 3 accumulation passes
    ["data.dtype=uint32", "precision=bf16", "device=cpu"],
    ["threads=0", "seed=0", "model.dropout=0.99", "optim.lr=0", "optim.grad_clip=0", "spike.window=3"],
])
def test_the_edges_of_what_is_valid_are_accepted(sets):
    build_config(sets=sets)


def test_accumulation_fills_the_batch_from_the_passes_of_all_ranks():
    assert build_config(sets=["nproc=2", "micro_batch_size=2", "batch_size=12"]).grad_accum == 3
    assert build_config(sets=["nproc=1", "micro_batch_size=8", "batch_size=8"]).grad_accum == 1


@pytest.mark.parametrize("value, meant", [("true", True), ("ON", True), (" yes ", True), ("1", True),
                                          ("false", False), ("off", False), ("0", False), ("No", False)])
def test_switches_read_the_usual_words(value, meant):
    assert build_config(sets=[f"numerics={value}"]).numerics is meant


@pytest.mark.parametrize("sets, match", [
    (["numerics=maybe"], "config key 'numerics' expects true or false, got 'maybe'"),
    (["steps=1.5"], "config key 'steps' expects a int, got 1.5"),
    (["steps=true"], "config key 'steps' expects a int, got True"),
    (["optim.lr=fast"], "config key 'optim.lr' expects a float, got 'fast'"),
    (["optim=1"], "config key 'optim' is a section; set its fields as optim.FIELD=VALUE"),
    (["optim.beta3=0.9"], "unknown config key 'optim.beta3'; known keys: preset, seed, .*optim.beta2"),
])
def test_a_value_of_the_wrong_kind_is_refused(sets, match):
    with pytest.raises(UsageError, match=match):
        build_config(sets=sets)


def test_numbers_are_read_as_the_fields_type():
    cfg = build_config(sets=["optim.lr=1", "optim.min_lr=2e-5", "steps=7", "data.path=7"])
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.min_lr == 2e-5 and cfg.steps == 7 and cfg.data.path == "7"


@pytest.mark.parametrize("pair", ["steps", "=3", ""])
def test_set_needs_a_key_and_a_value(pair):
    with pytest.raises(UsageError, match=f"--set expects key=value, got {pair!r}"):
        parse_sets([pair])


def test_set_pairs_nest_by_their_dots_and_keep_what_follows_the_first_equals_sign():
    assert parse_sets(["a.b.c=1", "a.d=x=y", "e=2"]) == {"a": {"b": {"c": "1"}, "d": "x=y"}, "e": "2"}


def test_a_config_file_that_is_missing_or_not_toml_is_named(tmp_path):
    with pytest.raises(UsageError, match=f"config file {tmp_path / 'none.toml'} does not exist"):
        build_config(config_file=str(tmp_path / "none.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = = 3\n")
    with pytest.raises(UsageError, match=f"config file {bad} is not valid TOML"):
        build_config(config_file=str(bad))


def test_a_config_file_that_is_not_utf8_is_named(tmp_path):
    utf16 = tmp_path / "run.toml"
    utf16.write_text("steps = 5\n", encoding="utf-16")
    with pytest.raises(UsageError, match=f"config file {utf16} is not UTF-8 text, as TOML must be: save it as UTF-8"):
        build_config(config_file=str(utf16))


def test_a_config_files_values_are_checked_as_the_command_lines_are(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("[optim]\nlr = nan\n")
    with pytest.raises(UsageError, match="optim.lr must be a finite number, got nan"):
        build_config(config_file=str(toml))


def test_the_keys_of_a_stored_config_this_version_does_not_know_are_listed():
    assert unknown_keys({"steps": 3, "rope": 1, "model": {"n_head": 2, "rope_theta": 1e4}}) == ["rope",
                                                                                               "model.rope_theta"]
    assert unknown_keys(RunConfig().to_dict()) == []


def test_flags_left_unset_change_nothing():
    assert build_config("spike", steps=None, nproc=None) == build_config("spike")


def test_a_stored_config_is_checked_key_by_key_when_read_back():
    with pytest.raises(UsageError, match="unknown config key 'model.n_layers'"):
        RunConfig.from_dict({"model": {"n_layers": 3}})
