"""A foreign checkpoint series on an object store: the three formats uploaded to the tests' S3 server
(SeaweedFS, tests/s3server.py) and read back equal to the local copies (tests/store/test_foreign.py makes
them)."""

from __future__ import annotations

from pathlib import Path

from replay.store.foreign import open_series
from replay.store.location import Location
from tests.conftest import tensors_equal
from tests.store.test_foreign import Nano, Titan, _dcp_save, _llama, _nano_ckpt


def upload(folder: Path, to: Location) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            (to / str(path.relative_to(folder))).write(path.read_bytes())


def test_each_format_reads_back_from_an_object_store_as_saved(s3_store, tmp_path):
    bucket = str(s3_store)
    models = {3: _llama(3), 5: _llama(5)}
    for step, model in models.items():
        sharded = {"max_shard_size": "16KB"} if step == 5 else {}
        model.save_pretrained(tmp_path / "hf" / f"checkpoint-{step}", **sharded)
    assert (tmp_path / "hf" / "checkpoint-5" / "model.safetensors.index.json").exists()
    titan = Titan()
    _dcp_save({"model": titan.state_dict()}, tmp_path / "dcp" / "step-8")
    nano = Nano()
    _nano_ckpt(nano, 40, tmp_path / "nano" / "ckpt.pt", compiled=True)
    for name in ("hf", "dcp", "nano"):
        upload(tmp_path / name, Location.parse(f"{bucket}/{name}"))

    hf = open_series(Location.parse(f"{bucket}/hf"))
    assert [c.step for c in hf.checkpoints] == [3, 5] and (hf.n_head, hf.n_kv_head) == (4, 2)
    for step, model in models.items():
        state = model.state_dict()
        assert tensors_equal(hf.read_model(step, list(state)[:5]), {n: state[n] for n in list(state)[:5]})
    dcp = open_series(Location.parse(f"{bucket}/dcp"), heads=4)
    assert dcp.n_kv_head == 2 and tensors_equal(dcp.read_model(8, list(titan.state_dict())), titan.state_dict())
    nanos = open_series(Location.parse(f"{bucket}/nano"))
    assert [c.step for c in nanos.checkpoints] == [40]
    assert tensors_equal(nanos.read_model(40, list(nano.state_dict())), nano.state_dict())

    before = hf.checkpoints[0].identity
    other = _llama(9)   # the same names and shapes, other weights
    other.save_pretrained(tmp_path / "other")
    Location.parse(f"{bucket}/hf/checkpoint-3/model.safetensors").write(
        (tmp_path / "other" / "model.safetensors").read_bytes())
    assert open_series(Location.parse(f"{bucket}/hf")).checkpoints[0].identity != before
    assert tensors_equal(hf.read_model(3, ["model.norm.weight", "lm_head.weight"]),
                         {n: other.state_dict()[n] for n in ["model.norm.weight", "lm_head.weight"]})
