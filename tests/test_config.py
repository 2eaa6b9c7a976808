import pytest

from replay.config import RunConfig, all_keys, build_config
from replay.errors import UsageError


def test_later_sources_win(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('steps = 77\n[optim]\nlr = 0.01\n[model]\nn_layer = 3\n')
    cfg = build_config("spike", str(toml), ["optim.lr=2e-3"], steps=12)
    assert cfg.steps == 12 and cfg.optim.lr == 2e-3 and cfg.model.n_layer == 3
    assert cfg.data.max_samples == 8            # from the preset, untouched


def test_round_trip_through_a_dict():
    cfg = build_config("gpt2-small", sets=["spike.threshold=4.5"])
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("kwargs, match", [
    ({"preset": "gpt5"}, "unknown preset 'gpt5'"),
    ({"sets": ["model.n_layers=3"]}, "unknown config key 'model.n_layers'"),
    ({"sets": ["steps=many"]}, "expects a int"),
    ({"sets": ["batch_size=6"]}, "not a multiple"),
    ({"sets": ["zero_stage=2"]}, "needs --launcher deepspeed"),
])
def test_bad_config_is_a_usage_error(kwargs, match):
    with pytest.raises(UsageError, match=match):
        build_config(**kwargs)


def test_every_key_is_settable():
    keys = all_keys()
    assert "optim.beta2" in keys and "spike.window" in keys and "model.attention" in keys
