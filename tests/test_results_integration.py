"""`make results` at its reduced size (`--quick`): the pipeline runs end to end with the product's commands,
and the numbers in the doc are the ones those commands printed or wrote (read back here, nothing re-run)."""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from results import golden, qiu_yao, story
from tests.conftest import REPO

PNG = b"\x89PNG\r\n\x1a\n"


def sections(doc: str) -> list[tuple[int, str, str]]:
    """(number, title, text) of every `## N. title` section."""
    parts = re.split(r"^## (\d+)\. (.+)$", doc, flags=re.M)
    return [(int(parts[i]), parts[i + 1], parts[i + 2]) for i in range(1, len(parts), 3)]


def table_after(text: str, label: str) -> list[list[str]]:
    """The body rows of the first markdown table after `label`."""
    lines = text[text.index(label):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def close(shown: str, value: float) -> bool:
    """A number as the doc shows it (3 significant digits, or a ratio like 0.72x) against the full value."""
    if shown.endswith("x"):
        return abs(float(shown[:-1]) - value) <= 0.005 + 1e-9
    return abs(float(shown) - value) <= 5e-3 * abs(value) + 1e-12


def pair(cell: str) -> tuple[str, str]:
    """'1.00e-02 (9.07e-04)' -> ('1.00e-02', '9.07e-04')."""
    first, _, second = cell.partition(" (")
    return first, second.rstrip(")")


@pytest.fixture(scope="module")
def quick(reported_spike, ray_local, tmp_path_factory):
    """The pipeline's commands that use Ray (analyze, bisect, compare) use the session's cluster."""
    tmp = tmp_path_factory.mktemp("results")
    shutil.copytree(reported_spike, tmp / "spike")
    out, work = tmp / "docs", tmp / "work"
    proc = subprocess.run([sys.executable, "-m", "results.make_results", "--quick", "--out", str(out), "--work",
                           str(work), "--story-store", str(tmp / "spike"), "--jobs", "4"], cwd=REPO,
                          capture_output=True, text=True, timeout=1200, env=os.environ | {"RAY_ADDRESS": ray_local})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, work, (out / "results.md").read_text()


def test_sections_commands_and_figures(quick):
    out, work, doc = quick
    found = sections(doc)
    titles = [golden.FORWARD_TITLE, golden.WEIGHTS_TITLE, qiu_yao.TITLE, story.TITLE]
    assert [n for n, _, _ in found] == list(range(1, len(titles) + 1))
    assert all(title.startswith(want) for (_, title, _), want in zip(found, titles, strict=True)), \
        [t for _, t, _ in found]
    assert "Wall time:" in doc and "hardware:" in doc
    for _, title, text in found:
        block = re.search(r"```bash\n(.*?)\n```", text, re.S)
        assert block, f"section {title!r} shows no command"
        for line in block.group(1).splitlines():
            assert shlex.split(line)[0] == "replay", line
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", doc)
    assert {"results-golden-seq.png", "results-golden-tile.png", "results-golden-weights.png",
            "results-story-loss.png", "results-story-probes.png"} <= set(links)
    for link in links:
        assert (out / link).read_bytes()[:8] == PNG, link


def test_forward_numbers_are_the_sweeps(quick):
    _, work, doc = quick
    text = sections(doc)[0][2]
    with open(work / "forward" / "sweep" / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))

    def dev(kernel, precision, n, d, tile, stat="max"):
        block = tile.split("x") if kernel != "baseline" else ["", ""]
        return next(float(r["abs_dev"]) for r in rows if (r["kernel"], r["precision"], r["seq_len"], r["block_r"],
                    r["block_c"], r["head_dim"], r["tensor"], r["stat"]) == (kernel, precision, str(n), *block, str(d),
                                                                            "O", stat))

    n, tile, d = re.search(r"at N = (\d+), tile (\d+x\d+), d = (\d+)", text).groups()
    table = table_after(text, "**By precision**")
    assert [r[0] for r in table] == ["BF16", "FP16", "FP32"]
    for row in table:
        p = row[0].lower()
        values = [dev(k, p, n, d, tile) for k in golden.KERNELS]
        assert all(close(s, v) for s, v in zip(row[1:4], values, strict=True)), row
        assert close(row[4], values[1] / values[0]) and close(row[5], values[2] / values[0]), row
    by_length = table_after(text, "**By sequence length**")
    assert len(by_length) == len(golden.SWEEP_QUICK["seq-lens"].split(","))
    for row in by_length:
        for cell, kernel in zip(row[1:4], golden.KERNELS, strict=True):
            shown_max, shown_mean = pair(cell)
            assert close(shown_max, dev(kernel, "bf16", row[0], d, tile))
            assert close(shown_mean, dev(kernel, "bf16", row[0], d, tile, "mean"))
    printed = (work / "forward" / "stdout.txt").read_text().splitlines()
    verdicts = re.search(r"own verdicts \(its stdout\):\n\n```\n(.*?)\n```", text, re.S).group(1).splitlines()
    assert verdicts and all(line in printed for line in verdicts)
    for kernel in golden.KERNELS[1:]:   # the comparison's median ratio is the one the command's verdict prints
        median = re.search(rf"Flash \({kernel}\) deviates O \w+ \(median ([\d.]+)x\)", "\n".join(verdicts)).group(1)
        assert re.search(rf"\(`{kernel}`[^)]*\) deviates {median}x|`{kernel}`[^)]*\) {median}x", text), kernel


def test_weight_distances_are_the_comparisons(quick):
    _, work, doc = quick
    text = sections(doc)[1][2]
    printed = {p: json.loads((work / "weights" / f"compare-{p}.json").read_text()) for p in "abc"}
    for metric, label in (("max_abs", "**max |difference|**"), ("wasserstein", "**Wasserstein-1**")):
        rows = table_after(text, label)
        assert [int(r[0]) for r in rows] == printed["a"]["steps"] == [0, 5, 10]
        for i, row in enumerate(rows):
            a, b, c = (max(printed[p][metric][i]) for p in "abc")
            assert close(row[1], a) and close(row[2], b) and close(row[3], c), row
            if a:
                assert close(row[4], c / a) and close(row[5], b / a), row
            else:
                assert row[4] == row[5] == "–"
    stores = re.findall(r"^replay record --store (\S+)", text, re.M)
    assert len(stores) == 4 and all((Path(s) / "zarr.json").is_file() for s in stores)
    # each pair ran as `replay compare X REF`: REF is the command's second store, "other" in its JSON
    assert all(Path(printed[p]["other"]).resolve() == Path(stores[0]).resolve() for p in "abc")


def test_story_is_the_bisect_and_the_analysis(quick):
    _, work, doc = quick
    text = sections(doc)[-1][2]
    verdict = json.loads((work / "story-bisect.json").read_text())["verdict"]
    w0, w1 = verdict["window"]
    assert dict(table_after(text, "**The bisect's verdict**"))["decided in steps"].startswith(f"{w0}..{w1}:")
    found = next(f for f in json.loads((work / "story-analyze.json").read_text())["spikes"]
                 if f["spike"] == verdict["spike"])
    top = table_after(text, "**The analysis ranking**")[0]
    assert top[0] == found["heads"][0]["unit"] and top[1] == f"{found['heads'][0]['score']:.1f}"
    spike = json.loads((work / "story-info.json").read_text())["spikes"][0]
    assert f"| spike at step {spike['step']} | loss {spike['loss']:.4f}" in text
    diffed = json.loads((work / "story-diff.json").read_text())   # `replay diff` at the window's first step
    assert diffed["step"] == w0 and diffed["first"] is not None   # BF16 rounding changes the attention's output
    assert f"the first is forward `{diffed['first']['where']} {diffed['first']['what']}`" in text
    heads = table_after(text, "**The decisive step, operation by operation**")
    assert [row[0] for row in heads] == [f"{h['layer']}.{h['head']}" for h in diffed["heads"]]
    assert heads[0][4] == f"{diffed['heads'][0]['delta_sign_bias']:+.2f}"


def test_mechanism_numbers_are_the_microbench_and_the_numerics(quick):
    _, work, doc = quick
    text = next(t for _, title, t in sections(doc) if title == qiu_yao.TITLE)
    with open(work / "microbench" / "mechanism" / "mechanism.csv", newline="") as f:
        bias = {(r["kernel"], int(r["n_tied"]), r["fix_beta"]): r for r in csv.DictReader(f)}
    cases = [("baseline", "")] + [(k, b) for k in ("reference-emu", "fa2-emu") for b in ("", "2", "7")]
    for label, key in (("Mean signed relative error of O", "o_rel"),
                       ("Mean signed relative error of delta", "delta_rel")):
        rows = table_after(text, label)
        assert [int(r[0]) for r in rows] == sorted({n for _, n, _ in bias})
        for row in rows:
            for cell, case in zip(row[1:], cases, strict=True):
                mean, ci = cell.split(" ± ")
                assert close(mean, float(bias[(*case[:1], int(row[0]), case[1])][key + "_mean"])), (cell, case)

    infos = {name: json.loads((work / f"mechanism-info-{name}.json").read_text()) for name, _, _ in qiu_yao.VARIANTS}
    rows = table_after(text, "as `replay info --json` prints them")
    n_layer = len(infos["recorded"]["numerics"]["tied_rate_mean"])
    assert len(rows) == len(qiu_yao.VARIANTS) * n_layer
    for i, row in enumerate(rows):
        name, layer = qiu_yao.VARIANTS[i // n_layer][0], i % n_layer
        assert int(row[1]) == layer
        numerics = infos[name]["numerics"]
        for cell, (key, spec) in zip(row[2:7], qiu_yao.COLUMNS, strict=True):
            value = numerics[key][layer]
            assert cell == ("n/a" if value != value else format(value, spec)), (name, key, cell, value)
    # an FP32 delta has no error at all; the reference placement's does
    assert all(s == 0 for s in infos["hp-delta"]["numerics"]["delta_err_sum"])
    assert all(s != 0 for s in infos["recorded"]["numerics"]["delta_err_sum"])


def test_numerics_are_stored_per_step_and_layer_and_need_an_emulated_backend(quick, tmp_path):
    """`record --numerics` as the pipeline ran it: one value per step and layer; the replays start from the
    same weights; a backend the probe cannot read is refused in one line, before anything is written."""
    from replay.store import RunStore
    from tests.conftest import error_line, replay_cli

    _, work, _ = quick
    store = work / "mechanism"
    steps = RunStore.open(store).read_steps()
    n = len(steps["step"])
    assert steps["tied_rate"].shape == (n, 2) and np.isfinite(steps["delta_err"]).all()
    assert np.isnan(steps["wq_err_cos"][0]).all() and np.isfinite(steps["wq_err_cos"][1:]).all()
    replayed = RunStore.open(store / "replays" / "hp-delta").read_steps()
    assert np.array_equal(replayed["tied_rate"][0], steps["tied_rate"][0])   # from checkpoint 0's weights
    assert (replayed["delta_err"] == 0).all() and (replayed["wq_err_norm"] == 0).all()

    refused = replay_cli("run", str(store), "--from", "3", "--to", "5", "--attention", "eager", "--layers", "1")
    assert "layer 1 head 0 uses 'eager'" in error_line(refused)
    line = error_line(replay_cli("record", "--store", str(tmp_path / "eager"), "--steps", "4", "--numerics"))
    assert "--attention reference-emu" in line and not (tmp_path / "eager").exists()
