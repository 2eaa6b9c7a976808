"""A store's location: parsed once, named as given, joined and related without touching anything; the
local backend's exclusive create (the S3 backend against a real server: test_s3_integration.py)."""

import os
import pickle
import threading

import pytest

from replay.errors import UsageError
from replay.store.location import Location


def test_a_path_is_made_absolute_and_a_url_keeps_its_bucket_and_prefix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = Location.parse("runs/a")
    assert local.scheme == "file" and local.local == tmp_path / "runs" / "a" and str(local) == str(tmp_path / "runs/a")
    url = Location.parse("s3://bucket/team/run-1/")
    assert (url.scheme, url.bucket, url.key) == ("s3", "bucket", "team/run-1")
    assert str(url) == "s3://bucket/team/run-1" and url.local is None
    assert Location.parse(url) is url and Location.parse(str(url)) == url
    assert str(Location.parse("s3://bucket")) == "s3://bucket"


@pytest.mark.parametrize("text, says", [
    ("gs://bucket/x", "gs:// is not supported"),
    ("http://host/x", "http:// is not supported"),
    ("s3:///x", "not a store URL"),
    ("s3://bucket/a/../../x", "not a store URL"),
    ("", "empty"),
])
def test_what_is_not_a_location_is_refused_in_one_line(text, says):
    with pytest.raises(UsageError, match=says) as refused:
        Location.parse(text)
    assert "\n" not in str(refused.value)


def test_joining_and_the_parent_stay_inside_the_scheme():
    url = Location.parse("s3://b/runs/a")
    replay = url / "replays" / "steps-1-2"
    assert str(replay) == "s3://b/runs/a/replays/steps-1-2" and replay.name == "steps-1-2"
    assert replay.parent.parent == url and replay / "../.." == url
    local = Location.parse("/data/runs/a")
    assert (local / "replays" / "x").parent.parent == local and (local / "replays").name == "replays"


def test_a_relative_reference_resolves_back_and_another_bucket_is_kept_whole():
    run = Location.parse("s3://b/runs/a")
    for other in (Location.parse("s3://b/runs/a/replays/w"), Location.parse("s3://b/ckpts/x"),
                  Location.parse("s3://other/x"), Location.parse("/local/x")):
        reference = other.relative(run)
        assert run.resolve(reference) == other
    assert Location.parse("s3://b/runs/a/replays/w").relative(run) == "replays/w"
    assert Location.parse("s3://other/x").relative(run) == "s3://other/x"
    local = Location.parse("/data/runs/a")
    assert local.resolve("../b") == Location.parse("/data/runs/b") and local.resolve("/x/y") == Location.parse("/x/y")


def test_a_location_travels_to_another_process_as_itself():
    url = Location.parse("s3://b/runs/a")
    assert pickle.loads(pickle.dumps(url)) == url and len({url, Location.parse("s3://b/runs/a/")}) == 1


def test_a_local_create_succeeds_once_among_racing_threads_and_keeps_the_first_bytes(tmp_path):
    target = Location.parse(tmp_path / "store" / "leases" / "run.json")
    won: list[int] = []

    def create(i: int) -> None:
        if target.create(f"writer {i}".encode()):
            won.append(i)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and target.read() == f"writer {won[0]}".encode()
    assert not target.create(b"late") and target.read() == f"writer {won[0]}".encode()
    assert [n for n in os.listdir(target.local.parent) if n.endswith(".tmp")] == []   # no temporary left


def test_local_children_remove_tree_and_a_missing_file(tmp_path):
    root = Location.parse(tmp_path / "s")
    assert root.children() == [] and (root / "zarr.json").read() is None and not (root / "zarr.json").exists()
    (root / "b" / "c.json").write(b"1")
    (root / "a.json").write(b"2", durable=True)
    assert root.children() == ["a.json", "b"] and (root / "a.json").exists() and not (root / "b").exists()
    (root / "b").remove_tree()
    assert root.children() == ["a.json"]


def test_a_local_range_and_size_read_only_what_is_asked(tmp_path):
    f = Location.parse(tmp_path / "blob")
    assert f.size() is None and f.read_range(0, 4) is None
    f.write(bytes(range(100)))
    assert f.size() == 100 and f.read_range(10, 5) == bytes(range(10, 15))
    assert f.read_range(95, 10) == bytes(range(95, 100)) and f.read_range(100, 3) == b""
