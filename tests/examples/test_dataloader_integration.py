"""examples/dataloader: a script that trains from a torch DataLoader (DistributedSampler, worker processes,
persistent workers, prefetch) through `loop.loader`, recorded under torchrun (gloo, 2 ranks) and replayed,
bisected and resumed by the product's commands, as its README says; in one process (a RandomSampler), recorded
and run without replay, bit for bit the same. Every run is a real process."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from replay.launch.script import ScriptServer
from replay.recorder.loader import WORKERS_DRAW
from replay.replayer.replays import ReplayRequest, run
from replay.store import RunStore
from replay.store.overrides import Overrides
from tests.conftest import REPO, replay_cli
from tests.examples.conftest import DETERMINISM, TORCHRUN, assert_same_run, kill_after_checkpoint, run_example
from tests.examples.planted import overwrite_with_noise
from tests.head_norms import assert_fused_head_norms

EXAMPLE = REPO / "examples" / "dataloader" / "train.py"
BLOCKS, BATCH, ACCUM, SEED, STEPS = 900, 4, 2, 1337, 60   # 450 blocks a rank: 112 batches of 4, then one of 2
SETTINGS = [f"--n_blocks={BLOCKS}", f"--batch_size={BATCH}", f"--gradient_accumulation_steps={ACCUM}",
            f"--seed={SEED}", f"--max_iters={STEPS}", "--checkpoint_every=10"]


def _torchrun(workdir: Path, *args: str, popen: bool = False, launcher: tuple[str, ...] = TORCHRUN):
    return run_example(EXAMPLE, workdir, *args, popen=popen, launcher=launcher)


@pytest.fixture(scope="module")
def data_dir(token_file) -> Path:
    """train.bin (90 000 tokens: 2 812 blocks of 33, of which the example reads the first 900) and val.bin."""
    return token_file.parent


@pytest.fixture(scope="module")
def recorded(data_dir, tmp_path_factory) -> Path:
    """60 steps on 2 ranks, checkpoints every 10: the reference the tests below replay and compare with."""
    workdir = tmp_path_factory.mktemp("dataloader")
    done = _torchrun(workdir, f"--data_dir={data_dir}", f"--store={workdir / 'run'}", *SETTINGS)
    assert done.returncode == 0, done.stderr
    return workdir / "run"


def test_the_loaders_stream_is_repositioned_in_place_for_each_replay_on_kept_up_ranks(recorded, tmp_path):
    """Both ranks of the script stay up (their DistributedSampler, their persistent workers) through a plain
    window over the epoch's end, a halved learning rate and a plain window before it: the loader's stream starts
    again from each checkpoint's position, and the plain windows equal the record at the level of the state."""
    store = tmp_path / "run"
    shutil.copytree(recorded, store, ignore=shutil.ignore_patterns("replays"))
    requests = [ReplayRequest(50, 58), ReplayRequest(20, 22, overrides=Overrides(lr_scale=0.5)),
                ReplayRequest(30, 33), ReplayRequest(30, 32, overrides=Overrides(skip=[30]))]
    with ScriptServer(RunStore.open(store).manifest.command) as server:
        outcomes = []
        for req in requests:
            result = run(store, req, ranks=server)
            outcomes.append((result.verification.bitwise, result.verification.level, tuple(server.pids)))
            assert server.refused is None
    assert [o[:2] for o in outcomes][:3] == [(True, "state"), (False, "state"), (True, "state")]
    assert len({o[2] for o in outcomes}) == 1 and len(outcomes[0][2]) == 2   # the same two processes throughout
    # the window skipping the step of its checkpoint: its stream passes over that step's batches, as a fresh start's
    skipped = replay_cli("run", str(store), "--from", "30", "--to", "32", "--skip", "30", "--name", "fresh", "--json")
    assert skipped.returncode == 0, skipped.stderr
    fields = ["sample_ids", "loss", "state_digest"]
    kept, fresh = (RunStore.open(store / "replays" / name).read_steps(fields) for name in (
        run(store, requests[3]).location.name, "fresh"))
    assert all(kept[f].shape == fresh[f].shape and kept[f].tobytes() == fresh[f].tobytes() for f in fields)   # NaN too


def _expected_ids(rank: int) -> np.ndarray:
    """[step, micro-batch, sample] of `rank`, from torch's own DistributedSampler: epoch after epoch, each
    epoch's indices in batches of BATCH, the last one padded with -1."""
    sampler: DistributedSampler[int] = DistributedSampler(TensorDataset(torch.arange(BLOCKS)), num_replicas=2,
                                                          rank=rank, shuffle=True, seed=SEED)
    batches: list[np.ndarray] = []
    epoch = 0
    while len(batches) < STEPS * ACCUM:
        sampler.set_epoch(epoch)
        order = np.array(list(sampler))
        for i in range(0, len(order), BATCH):
            chunk = order[i:i + BATCH]
            batches.append(np.concatenate([chunk, np.full(BATCH - len(chunk), -1)]))
        epoch += 1
    return np.stack(batches[:STEPS * ACCUM]).reshape(STEPS, ACCUM, BATCH)


@pytest.fixture(scope="module")
def served(recorded) -> Iterator[ScriptServer]:
    """The recording's script kept up between this file's replays of it (docs/your-loop.md), started at the first."""
    with ScriptServer(RunStore.open(recorded).manifest.command) as server:
        yield server


@pytest.mark.parametrize("workers", [0, 2])
def test_a_recording_trains_as_the_script_without_replay_bit_for_bit(data_dir, tmp_path, workers):
    """One process: the DataLoader's own RandomSampler (its seed drawn from torch's generator every epoch),
    the DataLoader's base seed (every epoch without workers, once with persistent ones) and dropout all draw
    from the global generators, over two epoch ends: with its replay lines and without them (--record=False),
    every step's loss and the final weights are the same. The dataset draws nothing in its workers: no line
    says otherwise."""
    args = [f"--data_dir={data_dir}", "--n_blocks=24", "--max_iters=8", "--dropout=0.1", f"--num_workers={workers}"]
    python = (sys.executable,)
    recorded = _torchrun(tmp_path, *args, f"--store={tmp_path / 'run'}", f"--out={tmp_path / 'recorded.pt'}",
                         launcher=python)
    assert recorded.returncode == 0, recorded.stderr
    assert recorded.stderr.count(DETERMINISM) == 1 and WORKERS_DRAW not in recorded.stderr
    plain = _torchrun(tmp_path, *args, "--record=False", f"--out={tmp_path / 'plain.pt'}", launcher=python)
    assert plain.returncode == 0 and "replay" not in plain.stderr, plain.stderr
    assert_same_run(tmp_path / "recorded.pt", tmp_path / "plain.pt", steps=8)


def test_the_step_log_holds_each_ranks_sampler_shard_in_order(recorded):
    store = RunStore.open(recorded)
    assert store.manifest.status == "complete" and store.manifest.world_size == 2
    assert store.manifest.command.launcher == "torchrun"
    assert [c.step for c in store.checkpoints()] == [0, 10, 20, 30, 40, 50, 60]
    ids = store.read_steps(["sample_ids"])["sample_ids"]
    assert ids.shape == (STEPS, 2, ACCUM, BATCH)
    for rank in range(2):
        assert np.array_equal(ids[:, rank], _expected_ids(rank)), rank
    # epoch 0 ends at step 56's first micro-batch, two samples and two pads; epoch 1 begins in its second
    assert (ids[56, :, 0, 2:] == -1).all() and (ids[56, :, 0, :2] >= 0).all() and (ids[56, :, 1] >= 0).all()
    assert (ids[np.arange(STEPS) != 56] >= 0).all()


def test_a_window_across_the_epoch_end_replays_bit_for_bit(recorded, served):
    """From checkpoint 50 (in the middle of epoch 0) over the step that ends it and begins epoch 1."""
    result = replay_cli("run", str(recorded), "--from", "54", "--to", "58", "--verify", ranks=served)
    assert result.returncode == 0, result.stderr
    assert "steps 50..58" in result.stdout
    assert "verify: every replayed step equals the record bit for bit" in result.stdout, result.stdout
    replay = RunStore.open(recorded / "replays" / "steps-54-58").read_steps(["sample_ids"])
    record = RunStore.open(recorded).read_steps(["sample_ids"], start=50, stop=59)
    assert replay["step"].tolist() == list(range(50, 59))
    assert np.array_equal(replay["sample_ids"], record["sample_ids"])


def test_emulated_bf16_attention_on_layer_0_diverges_exactly_at_from(recorded, served):
    """From checkpoint 20: steps 20..24 as recorded, bit for bit; from step 25 on, each rank's state after every
    update is another (its digests). A rank's loss at a step may still round to the recorded value (it did on
    an Intel Xeon): the state tells."""
    result = replay_cli("run", str(recorded), "--from", "25", "--to", "27", "--verify", "--json",
                        "--attention", "reference-emu:dtype=bf16", "--layers", "0", ranks=served)
    assert result.returncode == 0, result.stderr
    v = json.loads(result.stdout)["verification"]
    assert not v["bitwise"] and v["level"] == "state"
    d = v["divergence"]
    assert d["step"] == 25 and d["state"]["ranks"] == [0, 1]
    assert "model/h.0.attn.c_attn.weight" in d["state"]["tensors"], d   # the overridden layer's own weights
    fields = ["rank_loss", "state_digest"]
    replayed = RunStore.open(json.loads(result.stdout)["replay"]).read_steps(fields)
    record = RunStore.open(recorded).read_steps(fields, start=20, stop=28)
    assert replayed["step"].tolist() == list(range(20, 28))
    for name in fields:   # steps 20..24: as recorded
        assert np.array_equal(replayed[name][:5], record[name][:5]), name
    moved = (replayed["state_digest"][5:] != record["state_digest"][5:]).any(axis=2)   # (step, rank)
    assert moved.all(), moved                                                       # 25..27: on both ranks


def test_bisect_names_the_step_whose_blocks_were_overwritten_in_the_token_file(recorded, data_dir, tmp_path):
    """Write random bytes above 127 (never in Python source) over every block step 55 drew (read from the
    recording), record again (the sampler draws the same blocks): its loss jumps there, and a data bisect
    of the window from checkpoint 54 names that step's batches. Step 55 is in epoch 0: its blocks were
    never trained on before."""
    blocks = RunStore.open(recorded).read_steps(["sample_ids"])["sample_ids"][55].ravel()
    poisoned = overwrite_with_noise(data_dir, blocks * 32, 32, into=tmp_path / "data")
    store = tmp_path / "spiked"
    # the learning rate's schedule is not the run's length: as recorded; no worker processes (the sampler's
    # batches are the same with or without, and the dataset draws nothing), so the bisect's probes start none
    done = _torchrun(tmp_path, f"--data_dir={poisoned}", f"--store={store}", *SETTINGS, "--checkpoint_every=6",
                     "--max_iters=58", "--num_workers=0")
    assert done.returncode == 0, done.stderr
    assert [e["step"] for e in RunStore.open(store).spikes] == [55]   # the recording's own detector saw it
    result = replay_cli("bisect", str(store), "--by", "data", "--json")
    assert result.returncode == 0, result.stderr
    verdict = json.loads(result.stdout)["verdict"]
    assert verdict["data_window"] == [54, 55] and verdict["batches"] == [55] and verdict["samples"] is None
    assert "one at a time in this process, each with 2 of the script's rank(s), kept up" in result.stderr
    assert "started afresh" not in result.stderr


def test_analyze_reads_the_layout_the_script_declares(recorded):
    """The per-head spectral norms of the analysis against an SVD of the stored weights, where the script's
    layout mapping says they are: layer l's fused c_attn (out, in), head h's W_Q rows h*16:(h+1)*16 of its
    first third; W_O the columns of c_proj."""
    from replay.analysis import jobs, tasks

    items, _ = jobs.plan_metrics(RunStore.open(recorded, mode="a"))
    values = tasks.compute_metrics(next(i for i in items if i.ckpt.step == STEPS))
    model = RunStore.open(recorded).read_shard(STEPS, 0)["state"]["replicated"]["model"]
    for layer in range(2):   # c_attn [3 * 32, 32]
        assert_fused_head_norms(values, layer, model[f"h.{layer}.attn.c_attn.weight"],
                                model[f"h.{layer}.attn.c_proj.weight"], n_head=2)


def test_a_recording_killed_mid_run_resumes_to_the_uninterrupted_one(recorded, data_dir, tmp_path):
    store = tmp_path / "cut"
    args = [f"--data_dir={data_dir}", f"--store={store}", *SETTINGS]
    last = kill_after_checkpoint(_torchrun(tmp_path, *args, popen=True), store, 20)
    assert 20 <= last < STEPS
    resumed = _torchrun(tmp_path, *args, "--resume=True")
    assert resumed.returncode == 0, resumed.stderr
    a, b = RunStore.open(recorded), RunStore.open(store)
    assert b.manifest.status == "complete" and [r.from_step for r in b.manifest.resumes] == [last]
    for name in ("sample_ids", "loss", "grad_norm"):
        assert np.array_equal(a.read_steps([name])[name], b.read_steps([name])[name]), name
    final_a = a.read_shard(STEPS, 0)["state"]["replicated"]["model"]   # rank 0 keeps the replicated state
    final_b = b.read_shard(STEPS, 0)["state"]["replicated"]["model"]
    assert final_a.keys() == final_b.keys()
    for key, tensor in final_a.items():
        assert tensor.equal(final_b[key]), key
