"""A foreign checkpoint series on an object store: the three formats uploaded to an S3 server (moto's, a
process of its own) and read back equal to the local copies (tests/store/test_foreign.py makes them)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from replay.store.foreign import open_series
from replay.store.location import Location
from tests.conftest import tensors_equal
from tests.store.test_foreign import Nano, Titan, _dcp_save, _llama, _nano_ckpt

MOTO = shutil.which("moto_server") or "/root/.pyenv/versions/3.11.7/bin/moto_server"


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    if not os.access(MOTO, os.X_OK):
        pytest.skip("moto_server (an S3 server for tests) is not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path_factory.mktemp("moto") / "log", "w")
    server = subprocess.Popen([MOTO, "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(urllib.request.Request(f"{url}/foreign", method="PUT"))
            break
        except OSError:
            time.sleep(0.1)
    env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield "s3://foreign"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.terminate()
        server.wait()
        log.close()


def upload(folder: Path, to: Location) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            (to / str(path.relative_to(folder))).write(path.read_bytes())


def test_each_format_reads_back_from_an_object_store_as_saved(bucket, tmp_path):
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
