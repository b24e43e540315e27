"""`glm52 plot-experts` / `glm52 plot-indexer` on a malformed loss.json: one line on stderr naming the
file, the key path and expected vs found, exit 2, no PNG (docs/failure-modes.md, "Bad input").

Before: IndexError / TypeError / KeyError / ZeroDivisionError / OverflowError tracebacks (exit 1), a
ValueError of numpy or of a format string that named no key, or a plot of wrong numbers with exit 0
(`layers` shorter than the `load_total` rows; a string `steps`)."""

from __future__ import annotations

import copy
import json

import pytest

from paddleformers_glm.cli import main

# the shapes of a real `glm52 train --moe-bias-update-rate 0.01 --indexer-stage sparse` record, cut down
EXPERT_LOAD = {
    "num_experts": 4,
    "layers": [3, 4],
    "bias_update_rate": 0.01,
    "aux_loss_coeff": 0.0,
    "dropped_tokens": 0,
    "steps": [1, 2, 3],
    "max_mean_ratio": [[2.0, 1.5], [1.6, 1.4], [1.2, 1.1]],
    "unused_fraction": [[0.25, 0.0], [0.0, 0.0], [0.0, 0.0]],
    "idle_experts": [{"3": [2]}, {}, {}],
    "load_total": [[30, 10, 0, 8], [12, 12, 12, 12]],
    "load_last": [[10, 4, 0, 2], [4, 4, 4, 4]],
}
INDEXER = {
    "stage": "sparse",
    "loss_weight": 0.01,
    "shared_supervision": False,
    "layers": [0, 1, 2],
    "steps": [1, 2, 3],
    "kl": [[4.0, 3.0, 2.0], [3.0, 2.5, 1.5], [2.0, 2.0, 1.0]],
    "recall": [[0.4, 0.5, 0.6], [0.6, 0.7, 0.8], [0.8, 0.9, 0.95]],
    "mean_recall": [0.5, 0.7, 0.85],
    "stages": [
        {"stage": "warmup", "first_step": 1, "last_step": 1},
        {"stage": "sparse", "first_step": 2, "last_step": 3},
    ],
}


def _write(folder, doc):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "loss.json").write_text(json.dumps(doc))
    return folder


def _run_dir(tmp_path, key, block, change):
    """A run folder whose loss.json holds `block` under `key` with `change(block)` applied."""
    b = copy.deepcopy(block)
    new = change(b)
    return _write(tmp_path / "run", {"losses": [5.0, 4.9, 4.8], "steps": 3, key: b if new is None else new})


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip() and "ccache" not in ln]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def _set(**kv):
    def change(b):
        b.update(kv)

    return change


def _set_item(key, i, value):
    def change(b):
        b[key][i] = value

    return change


EXPERT_CASES = {
    # before: IndexError (steps[0] of an empty list)
    "empty steps": (_set(steps=[]), "'expert_load.steps'"),
    # before: IndexError (ratio.shape[1] of a 1-D array)
    "1-D max_mean_ratio": (_set(max_mean_ratio=[1.5, 1.4, 1.2]), "'expert_load.max_mean_ratio[0]'"),
    # before: TypeError (format of None)
    "null bias_update_rate": (_set(bias_update_rate=None), "'expert_load.bias_update_rate'"),
    "string bias_update_rate": (_set(bias_update_rate="0.01"), "'expert_load.bias_update_rate'"),
    # before: exit 0, two rows of load drawn under one layer label
    "layers shorter than load_total": (
        _set(layers=[3], max_mean_ratio=[[2.0], [1.6], [1.2]]),
        "'expert_load.load_total'",
    ),
    # before: exit 0, the curve drawn against the characters of the string
    "string steps": (_set(steps="123"), "'expert_load.steps'"),
    "float step": (_set_item("steps", 1, 2.5), "'expert_load.steps[1]'"),
    "string layers": (_set(layers="34"), "'expert_load.layers'"),
    "bool layer": (_set_item("layers", 0, True), "'expert_load.layers[0]'"),
    "repeated layer": (_set(layers=[3, 3]), "'expert_load.layers'"),
    # before: numpy's ValueError, naming no key
    "ragged load_total": (_set(load_total=[[30, 10, 0, 8], [12, 12]]), "'expert_load.load_total[1]'"),
    "string count": (_set(load_total=[[30, "10", 0, 8], [12, 12, 12, 12]]), "'expert_load.load_total[0][1]'"),
    "negative count": (_set(load_total=[[30, -10, 0, 8], [12, 12, 12, 12]]), "'expert_load.load_total[0][1]'"),
    "num_experts against the rows": (_set(num_experts=8), "'expert_load.load_total[0]'"),
    # before: OverflowError (an integer past float range)
    "huge count": (_set(load_total=[[30, 10**400, 0, 8], [12, 12, 12, 12]]), "'expert_load.load_total[0][1]'"),
    "ratio rows against steps": (_set(max_mean_ratio=[[2.0, 1.5]]), "'expert_load.max_mean_ratio'"),
    "ratio row against layers": (_set_item("max_mean_ratio", 2, [1.2]), "'expert_load.max_mean_ratio[2]'"),
    # before: TypeError (a string holding every required name passed the `in` checks)
    "block a string": (lambda b: "layers steps max_mean_ratio load_total", "'expert_load'"),
}


def test_plot_experts_on_a_reference_record_names_the_paddle_run(tmp_path, capsys):
    """`glm52 align OUT` writes OUT/reference/loss.json (torch: only idle experts and the bias rate) and
    OUT/paddle/loss.json. Before: "'expert_load' lacks 'layers'", which did not say what to plot."""
    ref = _write(
        tmp_path / "align" / "reference",
        {
            "losses": [5.0],
            "expert_load": {"idle_experts": [{}], "bias_update_rate": 0.01},
            "reference": "torch + transformers GlmMoeDsaForCausalLM (eager, float32) + torch MTP",
        },
    )
    assert main(["plot-experts", str(ref)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert str(ref / "loss.json") in line and "'expert_load'" in line
    assert "reference run" in line and "no load counts" in line
    assert f"glm52 plot-experts {tmp_path / 'align' / 'paddle'}" in line
    assert not (ref / "expert_load.png").exists()


def test_plot_experts_accepts_null_ratios_of_a_strict_record(tmp_path, capsys):
    """A strict record writes a non-finite number as null: drawn as a gap, not refused."""
    run = _run_dir(tmp_path, "expert_load", EXPERT_LOAD, _set_item("max_mean_ratio", 1, [None, 1.4]))
    assert main(["plot-experts", str(run)]) == 0, capsys.readouterr().err
    assert (run / "expert_load.png").stat().st_size > 0


INDEXER_CASES = {
    # before: TypeError (len() of a number)
    "kl rows not lists": (_set(kl=[1.0, 2.0, 3.0]), "'indexer.kl[0]'"),
    "recall row of strings": (_set_item("recall", 1, ["a", "b", "c"]), "'indexer.recall[1][0]'"),
    # before: KeyError
    "stage without first_step": (_set_item("stages", 1, {"stage": "sparse"}), "'indexer.stages[1]'"),
    "stage name not a string": (_set_item("stages", 0, {"stage": 3, "first_step": 1}), "'indexer.stages[0].stage'"),
    "stage first_step a string": (
        _set_item("stages", 1, {"stage": "sparse", "first_step": "2"}),
        "'indexer.stages[1].first_step'",
    ),
    "stage not an object": (_set_item("stages", 1, "sparse"), "'indexer.stages[1]'"),
    "stages not an array": (_set(stages={"stage": "sparse"}), "'indexer.stages'"),
    # before: ZeroDivisionError (the mean of an empty row)
    "empty layers": (_set(layers=[], kl=[[], [], []], recall=[[], [], []]), "'indexer.layers'"),
    # before: TypeError (list() of an int)
    "layers a number": (_set(layers=4), "'indexer.layers'"),
    "repeated layer": (_set(layers=[0, 1, 1]), "'indexer.layers'"),
    # before: exit 0, the steps drawn as the characters of the string
    "string steps": (_set(steps="123"), "'indexer.steps'"),
    # before: a format-string ValueError naming no key
    "mean_recall a string": (_set(mean_recall="abc"), "'indexer.mean_recall'"),
    "mean_recall too short": (_set(mean_recall=[0.5]), "'indexer.mean_recall'"),
    "block a string": (lambda b: "layers steps kl recall", "'indexer'"),
}


MALFORMED = [
    *(("plot-experts", "expert_load", EXPERT_LOAD, *case, ("expert_load.png",)) for case in EXPERT_CASES.values()),
    *(("plot-indexer", "indexer", INDEXER, *case, ("indexer.png", "indexer.json")) for case in INDEXER_CASES.values()),
]


@pytest.mark.parametrize(
    "cmd,block,base,change,key,outputs", MALFORMED, ids=[*(f"experts: {k}" for k in EXPERT_CASES), *INDEXER_CASES]
)
def test_a_malformed_block_is_one_line_naming_the_key(tmp_path, capsys, cmd, block, base, change, key, outputs):
    """plot-experts / plot-indexer on a malformed loss.json block: one line naming the file and the key
    path, exit 2, nothing written (the cases say what each was before)."""
    run = _run_dir(tmp_path, block, base, change)
    assert main([cmd, str(run)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"{cmd}: {run / 'loss.json'}: ") and key in line, line
    assert not any((run / name).exists() for name in outputs)


def test_plot_indexer_accepts_the_nulls_of_a_strict_record(tmp_path, capsys):
    """A reference run's mean recall of a step without an indexed layer is NaN, written as null.
    Before: TypeError formatting None (exit 1)."""

    def change(b):
        b["recall"][0] = [None, 0.5, 0.6]
        b["mean_recall"][0] = None

    run = _run_dir(tmp_path, "indexer", INDEXER, change)
    assert main(["plot-indexer", str(run)]) == 0, capsys.readouterr().err
    assert "mean recall nan -> 0.8500" in capsys.readouterr().out
    doc = json.loads((run / "indexer.json").read_text())
    assert doc["recall_by_layer"]["0"] == [None, 0.6, 0.8] and doc["recall_first_last"]["first"] is None
    assert (run / "indexer.png").stat().st_size > 0


@pytest.mark.parametrize(
    "cmd,key,block", [("plot-experts", "expert_load", EXPERT_LOAD), ("plot-indexer", "indexer", INDEXER)]
)
def test_a_png_that_cannot_be_written_is_named_as_given(tmp_path, capsys, monkeypatch, cmd, key, block):
    """A --png in a folder the process may not write: matplotlib opens the temporary file beside it, so
    the line named that file (``.e.png.<pid>.<hex>.tmp``), as check-loss's ``--plot`` does not. Now it
    names --png as given, exit 2, and nothing is left there. (Root writes a mode-0500 folder anyway:
    the write is refused by the figure's save itself, as the OS refuses it.)"""
    import matplotlib.figure

    def refused(self, fname, *args, **kwargs):
        raise PermissionError(13, "Permission denied", fname)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", refused)
    run = _write(tmp_path / "run", {"losses": [5.0, 4.9, 4.8], "steps": 3, key: copy.deepcopy(block)})
    png = tmp_path / "pngs" / "out.png"
    png.parent.mkdir()
    assert main([cmd, str(run), "--png", str(png)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line == f"{cmd}: --png {png}: cannot write the plot: Permission denied", line
    assert list(png.parent.iterdir()) == []
