"""`replay diff` on the reference 2-rank recording (checkpoint 10): step 10 run twice in this process from the
checkpoint, every tensor compared as it is produced."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from replay.replayer import diff as diff_module
from replay.replayer.diff import diff
from replay.store import RunStore
from replay.store.location import Location
from replay.store.overrides import Overrides
from tests.conftest import error_line, replay_cli, tree_snapshot

STEP = 10


def test_the_step_run_twice_as_recorded_is_the_same_bit_for_bit(two_rank_store):
    result = diff(Location.parse(two_rank_store), STEP, Overrides())
    assert result.first is None and result.differences == [] and result.only_in_a == result.only_in_b == []
    assert result.notes == []   # each side's loss is the one the store logged for rank 0, bit for bit
    assert result.compared > 50   # every module's output and gradient, the attention calls', the weights'
    assert [(h.layer, h.head) for h in result.heads] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(h.o == h.do == h.dq == h.delta == 0 for h in result.heads)


def test_one_layers_emulated_bf16_attention_is_the_first_difference(two_rank_store):
    """Layer 1's attention on emulated BF16: nothing of layer 0's forward differs, the first differing tensor is
    layer 1's attention output O; its heads' O deviate, layer 0's do not; every weight gradient reached by the
    backward of layer 1's attention differs."""
    result = diff(Location.parse(two_rank_store), STEP, Overrides(attention="reference-emu:dtype=bf16", layers=[1]))
    first = result.first
    assert first is not None and (first.phase, first.where, first.what) == ("forward", "attention 1", "O")
    assert first.order > 0 and 0 < first.deviation.relative < 0.1   # BF16's rounding, not another computation
    o = {(h.layer, h.head): h.o for h in result.heads}
    assert all(o[(0, h)] == 0 for h in range(2)) and all(o[(1, h)] > 0 for h in range(2)), o
    grads = {d.where for d in result.differences if d.phase == "gradient"}
    assert "transformer.h.1.attn.c_attn.weight" in grads and "transformer.wte.weight" in grads


def test_a_planted_perturbation_of_one_operation_is_named_as_the_first_difference(two_rank_store, monkeypatch):
    """A test double for a fault: side B's model (the second one built) has one element of layer 0's MLP input
    projection output moved by one ULP. The diff names that module's output first, one ULP away, and the
    differences after it only."""
    built = diff_module.build_model
    models: list[torch.nn.Module] = []

    def build_planted(*args, **kwargs):
        model = built(*args, **kwargs)
        models.append(model)
        if len(models) == 2:   # side B
            def nudge(module, inputs, output):   # + 0 everywhere, + one ULP at one element: exact, grads unchanged
                bumped = output.detach().clone().view(-1)
                bumped[7] = torch.nextafter(bumped[7], torch.tensor(float("inf")))
                return output + (bumped.view_as(output) - output.detach())
            model.transformer.h[0].mlp.c_fc.register_forward_hook(nudge)
        return model

    monkeypatch.setattr(diff_module, "build_model", build_planted)
    result = diff(Location.parse(two_rank_store), STEP, Overrides())
    first = result.first
    assert first is not None and (first.phase, first.where, first.what) == ("forward", "transformer.h.0.mlp.c_fc",
                                                                            "output")
    assert first.deviation.max_abs > 0 and first.deviation.ulps <= 1
    assert all(d.order >= first.order for d in result.differences)


def test_a_side_as_recorded_whose_loss_is_not_the_records_is_said(two_rank_store, monkeypatch):
    """A test double for a machine that computes other bits: side A's model (the first built) has layer 0's MLP
    output scaled by 1 + 2^-8. The answer says, in a note, that the step run here as the store ran it does not
    give the loss the store logged."""
    built = diff_module.build_model
    models: list[torch.nn.Module] = []

    def build_planted(*args, **kwargs):
        model = built(*args, **kwargs)
        models.append(model)
        if len(models) == 1:
            model.transformer.h[0].mlp.register_forward_hook(lambda module, inputs, output: output * (1 + 2 ** -8))
        return model

    monkeypatch.setattr(diff_module, "build_model", build_planted)
    result = diff(Location.parse(two_rank_store), STEP, Overrides())
    assert result.first is not None and len(result.notes) == 1, result.notes
    assert result.notes[0].startswith(f"{Location.parse(two_rank_store)}'s step, run here as it ran, is not its record")


def test_the_command_prints_the_first_difference_and_refuses_a_step_without_a_checkpoint(two_rank_store):
    done = replay_cli("diff", str(two_rank_store), "--step", str(STEP), "--attention", "reference-emu:dtype=bf16",
                      "--layers", "1", "--json")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert (answer["first"]["where"], answer["first"]["what"]) == ("attention 1", "O")
    text = replay_cli("diff", str(two_rank_store), "--step", str(STEP), "--attention", "reference-emu:dtype=bf16",
                      "--layers", "1")
    assert "first difference: forward attention 1 O" in text.stdout, text.stdout
    before = tree_snapshot(two_rank_store)
    missing = replay_cli("diff", str(two_rank_store), "--step", "11")
    assert missing.returncode == 2
    assert "no committed checkpoint at step 11" in error_line(missing) and "--checkpoint-every 1" in error_line(missing)
    assert tree_snapshot(two_rank_store) == before


@pytest.mark.parametrize("args, says", [(["--layers", "1"], "--layers/--heads select where"),
                                        (["--attention", "nope"], "nope")])
def test_bad_overrides_are_one_line_errors(two_rank_store, args, says):
    done = replay_cli("diff", str(two_rank_store), "--step", str(STEP), *args)
    assert done.returncode == 2 and says in error_line(done), done.stderr


def test_a_trace_captured_in_one_process_gives_the_same_first_difference_in_another(two_rank_store, tmp_path):
    """`--capture` in one `replay diff` process (side A with layer 1 on emulated BF16 attention), then `--against`
    in another (the step as recorded): by the trace's digests, the same first difference as the in-process diff
    of the same two sides, and the same count of differing tensors; the store holds the trace, no tensor."""
    store = tmp_path / "run"
    shutil.copytree(two_rank_store, store)
    change = ["--attention", "reference-emu:dtype=bf16", "--layers", "1"]
    captured = replay_cli("diff", str(store), "--step", str(STEP), *change, "--capture", "bf16-layer1", process=True)
    assert captured.returncode == 0 and "trace bf16-layer1 of step 10" in captured.stdout, captured.stderr
    compared = replay_cli("diff", str(store), "--step", str(STEP), "--against", "bf16-layer1", "--json", process=True)
    assert compared.returncode == 0, compared.stderr
    across = json.loads(compared.stdout)
    here = diff(Location.parse(store), STEP, Overrides(attention="reference-emu:dtype=bf16", layers=[1]))
    assert (across["first"]["phase"], across["first"]["where"], across["first"]["what"]) == \
        (here.first.phase, here.first.where, here.first.what) == ("forward", "attention 1", "O")
    assert len(across["differences"]) == len(here.differences) and across["against"]["trace"] == "bf16-layer1"
    ours, theirs = across["first"]["stats"]["ours"], across["first"]["stats"]["theirs"]
    assert ours["norm"] != theirs["norm"]
    assert sum(f.stat().st_size for f in (store / "traces").rglob("*")) < 200_000   # digests and statistics only
    # `--keep attention 1`: that layer's tensors whole, so the comparison has their deviations and per-head signals
    # (|B - A| is the in-process diff's, with the sides swapped)
    kept = replay_cli("diff", str(store), "--step", str(STEP), *change, "--capture", "whole", "--keep", "attention 1")
    assert kept.returncode == 0 and "whole those of attention 1" in kept.stdout, kept.stderr
    whole = diff(Location.parse(store), STEP, Overrides(), against="whole")
    assert whole.first.deviation.max_abs == here.first.deviation.max_abs
    assert {(h.layer, h.head): (h.o, h.dq, h.delta) for h in whole.heads} == \
        {(h.layer, h.head): (h.o, h.dq, h.delta) for h in here.heads if h.layer == 1}
    alone = replay_cli("diff", str(store), "--step", str(STEP), "--keep", "attention 1")
    assert alone.returncode == 2 and "give it with --capture" in error_line(alone)
    missing = replay_cli("diff", str(store), "--step", str(STEP), "--against", "nope")
    assert missing.returncode == 2 and "has no trace 'nope'" in error_line(missing)


def test_two_runs_sharing_a_step_are_diffed_as_each_ran_it(two_rank_store, tmp_path):
    """`replay diff A B`: a plain replay from the record's checkpoint is the record bit for bit at that step; a
    replay with layer 1 on emulated BF16 attention parts from it where `replay diff A --step N` with the same
    overrides does, tensor for tensor; a step whose state the two no longer share, and overrides beside B, are
    refused in one line, the stores untouched."""
    store = tmp_path / "run"
    shutil.copytree(two_rank_store, store)
    change = ["--attention", "reference-emu:dtype=bf16", "--layers", "1"]
    for args in (["--from", "10", "--to", "10", "--name", "same"],
                 ["--from", "10", "--to", "20", "--checkpoint-every", "10", *change, "--name", "cf"],
                 ["--from", "10", "--to", "10", "--attention", "fa2-emu:dtype=bf16", "--layers", "1", "--name", "fa2"]):
        done = replay_cli("run", str(store), *args)
        assert done.returncode == 0, done.stderr
    run, same, cf = (Location.parse(p) for p in (store, store / "replays" / "same", store / "replays" / "cf"))
    plain = diff(run, STEP, Overrides(), other=same)
    assert plain.first is None and plain.compared > 50 and plain.changes == {}
    parted = diff(run, STEP, Overrides(), other=cf)
    here = diff(run, STEP, Overrides(attention="reference-emu:dtype=bf16", layers=[1]))
    assert (parted.first.phase, parted.first.where, parted.first.what) == ("forward", "attention 1", "O")
    assert [(d.phase, d.where, d.what, d.deviation) for d in parted.differences] == \
        [(d.phase, d.where, d.what, d.deviation) for d in here.differences]
    assert parted.changes["model.attention"][0] == "eager" and "reference-emu" in parted.changes["model.attention"][1]
    # two emulations of BF16 flash attention on layer 1: their S and P are compared per head; layer 0 is eager on
    # both sides, which gives its P and its softmax's input as S: compared, and the same
    emulations = diff(cf, STEP, Overrides(), other=Location.parse(store / "replays" / "fa2"))
    heads = {(h.layer, h.head): h for h in emulations.heads}
    assert all(0 < heads[(1, h)].s < 0.1 and 0 < heads[(1, h)].p < 0.1 for h in range(2)), heads
    assert all(heads[(0, h)].s == 0 and heads[(0, h)].p == 0 for h in range(2)), heads
    assert {(d.where, d.what) for d in emulations.differences} >= {("attention 1", "S"), ("attention 1", "P")}
    text = replay_cli("diff", str(store), str(store / "replays" / "cf"), "--step", str(STEP), "--save", "cf-at-10")
    assert text.returncode == 0 and "first difference: forward attention 1 O" in text.stdout, text.stderr
    assert "B's config differs in model.attention 'eager' -> " in text.stdout and "Warning" not in text.stderr
    kept = RunStore.open(store).diffs()["cf-at-10"]
    assert kept["other"] == str(cf) and len(kept["differences"]) == len(parted.differences)
    before = tree_snapshot(store)
    unnamed = replay_cli("diff", str(store), "--step", str(STEP), "--save", "no/such")
    assert unnamed.returncode == 2 and "a saved diff's name is letters" in error_line(unnamed)
    later = replay_cli("diff", str(store), str(store / "replays" / "cf"), "--step", "20")
    assert later.returncode == 2 and "hold different states at step 20" in error_line(later), later.stderr
    both = replay_cli("diff", str(store), str(store / "replays" / "cf"), "--step", str(STEP), *change)
    assert both.returncode == 2 and "leave out the overrides" in error_line(both)
    assert tree_snapshot(store) == before


def test_each_ranks_micro_batches_are_diffed_from_its_own_rng_states(two_rank_store, tmp_path):
    """`--rank 1`: the step on rank 1's samples (its token embeddings' output differs from rank 0's), the same
    twice bit for bit, and the same as its trace in the store; a trace of another rank, or a rank the run did not
    have, is refused in one line."""
    from replay.replayer.diff import capture

    store = tmp_path / "run"
    shutil.copytree(two_rank_store, store)
    location = Location.parse(store)
    for rank in (0, 1):
        assert capture(location, STEP, Overrides(), f"rank{rank}", rank)[0] > 50
    embedded = [next(e["digest"] for e in RunStore.open(store).trace(f"rank{rank}")["entries"]
                     if e["key"] == "forward|transformer.wte|output") for rank in (0, 1)]
    assert embedded[0] != embedded[1]
    assert diff(location, STEP, Overrides(), rank=1).first is None
    one, every = diff(location, STEP, Overrides(), rank=0), diff(location, STEP, Overrides(), rank=None)
    assert every.first is None and every.compared > one.compared   # both ranks' micro-batches, the same weights
    text = replay_cli("diff", str(store), "--step", str(STEP), "--rank", "all", "--attention",
                      "reference-emu:dtype=bf16", "--layers", "1")
    assert "(every rank's micro-batches, their gradients averaged)" in text.stdout, text.stderr
    assert "first difference: forward attention 1 O" in text.stdout
    assert diff(location, STEP, Overrides(), against="rank1", rank=1).first is None
    other = replay_cli("diff", str(store), "--step", str(STEP), "--against", "rank0", "--rank", "1")
    assert other.returncode == 2 and "give --rank 0" in error_line(other)
    beyond = replay_cli("diff", str(store), "--step", str(STEP), "--rank", "2")
    assert beyond.returncode == 2 and "recorded on ranks 0..1" in error_line(beyond)
