"""`glm52 check-loss`: pass and fail against the tolerances, malformed input, the receipt and the plot."""

from __future__ import annotations

import json
import math

import pytest

from paddleformers_glm.cli import main
from paddleformers_glm.parity.loss_check import compare_losses


def _loss(tmp_path, name, losses, raw: str | None = None):
    p = tmp_path / name
    p.write_text(raw if raw is not None else json.dumps({"losses": losses}))
    return p


def _check(tmp_path, capsys, *args):
    out = tmp_path / "receipt.json"
    code = main(["check-loss", *map(str, args), "--json", str(out)])
    text = capsys.readouterr()
    return code, json.loads(out.read_text()), text


def test_identical_files_pass_bit_exact(tmp_path, capsys):
    losses = [2.3025850929940455, 2.1, 1.9876543210987654, 1.5]
    a, b = _loss(tmp_path, "a.json", losses), _loss(tmp_path, "b.json", losses)
    code, r, text = _check(tmp_path, capsys, a, b, "--bit-exact", "--steps", "4")
    assert code == 0 and r["result"] == "pass"
    assert r["bit_exact"] is True and r["length_match"] is True and r["enough_steps"] is True
    assert r["consistent_steps"] == 4 and r["matching_steps"] == 4 and r["first_divergent_step"] is None
    assert r["max_diff"] == 0.0
    assert len(r["a"]["sha256"]) == 64
    assert "pass" in text.out


def test_run_folders_are_read_as_their_loss_json(tmp_path, capsys):
    """``check-loss RUN_A RUN_B``: the plot commands take a run folder, check-loss said "cannot read the
    loss record: Is a directory" (exit 2). A folder stands for its loss.json; a file is read as given."""
    for run, losses in (("run_a", [1.0, 0.9]), ("run_b", [1.0, 0.8])):
        (tmp_path / run).mkdir()
        _loss(tmp_path / run, "loss.json", losses)
    code, r, _ = _check(tmp_path, capsys, tmp_path / "run_a", tmp_path / "run_b")
    assert code == 1 and r["first_divergent_step"] == 1, r
    assert r["a"]["path"] == str(tmp_path / "run_a" / "loss.json"), r["a"]
    code, r, _ = _check(tmp_path, capsys, tmp_path / "run_a", tmp_path / "run_a" / "loss.json")
    assert code == 2 and "are the same file" in r["errors"][0], r  # a folder and its own loss.json


def test_one_ulp_away_fails_at_step_2(tmp_path, capsys):
    a = _loss(tmp_path, "a.json", [1.0, 0.9, 0.8, 0.7])
    b = _loss(tmp_path, "b.json", [1.0, 0.9, 0.8000001, 0.7])
    code, r, _ = _check(tmp_path, capsys, a, b, "--bit-exact")
    assert code == 1 and r["result"] == "fail"
    assert r["consistent_steps"] == 2 and r["first_divergent_step"] == 2
    assert r["matching_steps"] == 3 and r["bit_exact"] is False
    assert r["max_diff"] == pytest.approx(1e-7, rel=1e-3)
    # the same pair passes under a tolerance that covers it, and fails under one that does not
    code, r, _ = _check(tmp_path, capsys, a, b, "--atol", "1e-6")
    assert code == 0 and r["mode"] == "tolerance" and r["consistent_steps"] == 4 and r["bit_exact"] is False
    code, r, _ = _check(tmp_path, capsys, a, b, "--atol", "0", "--rtol", "1e-8")
    assert code == 1 and r["first_divergent_step"] == 2


def test_default_mode_is_bit_exact(tmp_path, capsys):
    a = _loss(tmp_path, "a.json", [1.0, 0.5])
    b = _loss(tmp_path, "b.json", [1.0, 0.5000000000000001])
    code, r, _ = _check(tmp_path, capsys, a, b)
    assert code == 1 and r["mode"] == "bit-exact" and r["first_divergent_step"] == 1


def test_length_and_steps(tmp_path, capsys):
    a = _loss(tmp_path, "a.json", [1.0, 0.9, 0.8])
    b = _loss(tmp_path, "b.json", [1.0, 0.9, 0.8, 0.7])
    code, r, _ = _check(tmp_path, capsys, a, b)
    assert code == 1 and r["length_match"] is False and r["consistent_steps"] == 3 and r["bit_exact"] is False
    b2 = _loss(tmp_path, "b2.json", [1.0, 0.9, 0.8, 0.7])
    code, r, _ = _check(tmp_path, capsys, b, b2, "--steps", "5")
    assert code == 1 and r["enough_steps"] is False and r["length_match"] is True
    code, r, _ = _check(tmp_path, capsys, b, b2, "--steps", "3")
    assert code == 0 and r["steps_compared"] == 3


@pytest.mark.parametrize(
    "raw, needle",
    [
        ("{not json", "not valid JSON"),
        ('{"loss": [1.0]}', "expected a JSON object with a 'losses' list"),
        ("[1.0, 2.0]", "expected a JSON object with a 'losses' list"),
        ('{"losses": 1.0}', "'losses' must be a list"),
        ('{"losses": [1.0, "0.9"]}', "losses[1] is '0.9' (str), expected a number"),
        ('{"losses": [1.0, true]}', "losses[1] is True (bool)"),
        ('{"losses": [1.0, null]}', "losses[1] is None"),
        ('{"losses": [1.0, NaN]}', "losses[1] is nan, expected a finite number"),
        ('{"losses": [Infinity]}', "losses[0] is inf"),
        # an integer beyond float range: was an OverflowError traceback and exit 1 (a "mismatch")
        ('{"losses": [1.0, 1' + "0" * 400 + "]}", "losses[1] is an integer beyond a float's range"),
        ('{"losses": [1' + "0" * 5000 + "]}", "not readable JSON (Exceeds the limit (4300 digits)"),
        # Python's json keeps the last of two values: the run would be judged on [1.0] and pass
        ('{"losses": [9.0], "losses": [1.0]}', "the loss record holds the key 'losses' twice"),
        ('{"losses": [1.0], "eval": [{"step": 1, "losses": 1.0, "losses": 2.0}]}', "holds the key 'losses' twice"),
    ],
)
def test_malformed_input_exit_2(tmp_path, capsys, raw, needle):
    bad = _loss(tmp_path, "bad.json", None, raw=raw)
    good = _loss(tmp_path, "good.json", [1.0])
    code, r, text = _check(tmp_path, capsys, good, bad)
    assert code == 2 and r["result"] == "unusable input"
    assert needle in r["errors"][0] and str(bad) in r["errors"][0]
    assert needle in text.err


def test_missing_file_exit_2(tmp_path, capsys):
    good = _loss(tmp_path, "good.json", [1.0])
    code, r, _ = _check(tmp_path, capsys, good, tmp_path / "nope.json")
    assert code == 2 and "cannot read" in r["errors"][0]


def test_plot_png(tmp_path, capsys):
    import matplotlib.image as mpimg

    a = _loss(tmp_path, "a.json", [2.0 - 0.01 * i for i in range(50)])
    b = _loss(tmp_path, "b.json", [2.0 - 0.01 * i + (1e-6 * i if i > 20 else 0.0) for i in range(50)])
    png = tmp_path / "plots" / "loss.png"
    code, r, _ = _check(tmp_path, capsys, a, b, "--atol", "1e-4", "--plot", png)
    assert code == 0 and r["plot"] == str(png)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    img = mpimg.imread(str(png))
    assert img.shape[:2] == (600, 800)  # 8 x 6 inches at 100 dpi
    assert img[..., :3].std() > 0.05  # not a blank canvas


def test_compare_losses_direct():
    r = compare_losses([1.0, 2.0, 3.0], [1.0, 2.5, 3.0])
    assert (r["consistent_steps"], r["matching_steps"], r["first_divergent_step"], r["max_diff"]) == (1, 2, 1, 0.5)


def test_steps_n_compares_the_first_n_whatever_the_lengths(tmp_path, capsys):
    """Two runs of different lengths that agree on their first 3 steps pass `--steps 3`."""
    a = _loss(tmp_path, "a.json", [1.0, 0.9, 0.8])
    b = _loss(tmp_path, "b.json", [1.0, 0.9, 0.8, 0.7, 0.6])
    code, r, text = _check(tmp_path, capsys, a, b, "--steps", "3")
    assert code == 0 and r["result"] == "pass" and r["bit_exact"] is True and r["length_match"] is False
    assert "every loss identical" in text.out  # the rule the verdict applied
    code, r, text = _check(tmp_path, capsys, a, b, "--steps", "3", "--atol", "1e-9")
    assert code == 0 and "|a-b| <= 1e-09 + 0*|b| at every step" in text.out
    c = _loss(tmp_path, "c.json", [1.0, 0.9, 0.8000001, 0.7, 0.6])
    code, r, _ = _check(tmp_path, capsys, a, c, "--steps", "3")
    assert code == 1 and r["first_divergent_step"] == 2


def test_plot_without_matplotlib_names_the_extra_exits_2_and_keeps_the_receipt(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    a, b = _loss(tmp_path, "a.json", [1.0, 0.9]), _loss(tmp_path, "b.json", [1.0, 0.9])
    code, r, text = _check(tmp_path, capsys, a, b, "--plot", tmp_path / "p.png")
    assert code == 2
    assert r["result"] == "pass" and r["plot"] is None  # the comparison itself stands in the receipt
    assert "matplotlib" in r["errors"][0] and "[plot]" in text.err
    assert "Traceback" not in text.err and "check-loss: pass" in text.out
    assert not (tmp_path / "p.png").exists()


def test_plot_names_runs_by_folder_and_shows_tolerance_and_verdict(tmp_path):
    pytest.importorskip("matplotlib")
    from paddleformers_glm.parity.loss_check import loss_figure, run_labels

    assert run_labels("/r/demo/single/loss.json", "/r/demo/parallel/loss.json") == ("single", "parallel")
    assert run_labels("/x/run/loss.json", "/y/run/loss.json") == ("x/run", "y/run")
    assert run_labels("/r/a.json", "/r/b.json") == ("a.json", "b.json")
    fig = loss_figure([1.0, 0.9, 0.8], [1.0, 0.9, 0.80001], ("single", "parallel"), (1e-4, 0.0), "pass")
    top, bottom = fig.axes
    assert [t.get_text() for t in top.get_legend().get_texts()] == ["single", "parallel"]
    assert any("tolerance 0.0001" in t.get_text() for t in bottom.get_legend().get_texts())
    title = fig._suptitle.get_text()
    assert "PASS" in title and "|A - B| <= 0.0001" in title


@pytest.mark.parametrize(
    ("flags", "needle"), [(["--atol", "-1"], "--atol"), (["--atol", "nan"], "--atol"), (["--rtol", "-0.5"], "--rtol")]
)
def test_negative_or_nan_tolerance_is_unusable_input_exit_2(tmp_path, capsys, flags, needle):
    """A negative or NaN tolerance is refused, as torch.allclose refuses it (measured, torch 2.13:
    ``torch.allclose(x, x, atol=-1.0)`` raises "atol must be greater than or equal to zero, but got -1",
    the same for rtol=-1.0 and atol=nan). Before: identical curves "failed" with consistent_steps 0, exit 1."""
    a = _loss(tmp_path, "a.json", [1.0, 0.5])
    code, r, text = _check(tmp_path, capsys, a, a, *flags)
    assert code == 2 and r["result"] == "unusable input"
    assert f"{needle} must be >= 0" in text.err and "pass" not in text.out and "fail" not in text.out


def test_infinite_tolerance_is_accepted(tmp_path, capsys):
    """torch.allclose(x, x, atol=inf) is True (measured, torch 2.13): an infinite tolerance is usable."""
    a, b = _loss(tmp_path, "a.json", [1.0, 0.5]), _loss(tmp_path, "b.json", [1.0, 0.5])
    code, r, _ = _check(tmp_path, capsys, a, b, "--atol", "inf")
    assert code == 0 and r["result"] == "pass"


def test_infinite_rtol_passes_identical_curves_of_zeros(tmp_path, capsys):
    """Equal losses agree whatever the tolerance, as in torch.isclose (``torch.isclose(0., 0., rtol=inf)``
    is True): before, ``inf x |0|`` made the bound NaN and identical all-zero curves failed, exit 1."""
    z, z2 = _loss(tmp_path, "z.json", [0.0, 0.0, 0.0]), _loss(tmp_path, "z2.json", [0.0, 0.0, 0.0])
    code, r, _ = _check(tmp_path, capsys, z, z2, "--rtol", "inf")
    assert code == 0 and r["matching_steps"] == 3
    assert compare_losses([0.0, 1.0], [0.0, 0.0], rtol=math.inf)["matching_steps"] == 1  # 1 vs 0: inf x 0, not close


@pytest.mark.parametrize(
    "value, needle",
    [
        # the plain `losses` path named these; the eval records' ended in tracebacks, exit 1
        ("1" + "0" * 400, "eval[0].losses is an integer beyond a float's range"),
        ("1" + "0" * 5000, "not readable JSON (Exceeds the limit (4300 digits)"),
    ],
)
def test_eval_curve_with_an_unreadable_number_is_exit_2(tmp_path, capsys, value, needle):
    good = _loss(tmp_path, "good.json", None, '{"losses": [1.0], "eval": [{"step": 1, "losses": 1.0}]}')
    bad = _loss(tmp_path, "bad.json", None, '{"losses": [1.0], "eval": [{"step": 1, "losses": ' + value + "}]}")
    code, r, text = _check(tmp_path, capsys, good, bad, "--curve", "eval.losses")
    assert code == 2 and r["result"] == "unusable input"
    assert needle in text.err and str(bad) in text.err


def test_curve_compares_another_list_or_the_held_out_evaluations(tmp_path, capsys):
    """--curve mtp_losses reads that list; --curve eval.losses each evaluation record's entry
    (glm52 train --eval-data's loss.json 'eval'); a file without evaluations is unusable input."""

    def run(name, evals, mtp):
        return _loss(tmp_path, name, None, json.dumps({"losses": [1.0], "mtp_losses": mtp, "eval": evals}))

    a = run("a.json", [{"step": 2, "losses": 2.5, "mtp_losses": 2.6}, {"step": 4, "losses": 2.4}], [1.5, 1.4])
    b = run("b.json", [{"step": 2, "losses": 2.5, "mtp_losses": 2.6}, {"step": 4, "losses": 2.40001}], [1.5, 1.4])
    code, r, _ = _check(tmp_path, capsys, a, b, "--curve", "mtp_losses")
    assert code == 0 and r["curve"] == "mtp_losses" and r["steps_compared"] == 2
    code, r, _ = _check(tmp_path, capsys, a, b, "--curve", "eval.losses")
    assert code == 1 and r["first_divergent_step"] == 1 and r["steps_compared"] == 2
    code, r, _ = _check(tmp_path, capsys, a, b, "--curve", "eval.losses", "--atol", "1e-4")
    assert code == 0 and abs(r["max_diff"] - 1e-5) < 1e-9
    code, _, text = _check(tmp_path, capsys, a, b, "--curve", "eval.mtp_losses")
    assert code == 2 and "eval[1].mtp_losses is None, expected a finite number" in text.err
    plain = _loss(tmp_path, "plain.json", [1.0])
    code, _, text = _check(tmp_path, capsys, plain, b, "--curve", "eval.losses")
    assert code == 2 and "no 'eval' records (the run had no --eval-data)" in text.err


def test_evaluations_pair_by_training_step_not_position(tmp_path, capsys):
    """A run resumed from step 3 with --eval-at-start evaluates at 0 2 3 4 6 7 where the run it
    continues evaluated at 0 2 4 6 7, every loss and weight equal (measured): the evaluations after
    steps 3 and 4 were compared as a pair, a failure blamed on a routing flip at "step 2", and a
    tolerance could pass evaluations of different steps. Now the steps both hold are compared."""

    def run(name, evals):
        records = [{"step": s, "losses": v} for s, v in evals]
        return _loss(tmp_path, name, None, json.dumps({"losses": [1.0] * 7, "eval": records}))

    full = run("full.json", [(0, 5.0), (2, 4.5), (4, 4.0), (6, 3.5), (7, 3.4)])
    resumed = run("resumed.json", [(0, 5.0), (2, 4.5), (3, 4.2), (4, 4.0), (6, 3.5), (7, 3.4)])
    code, r, text = _check(tmp_path, capsys, full, resumed, "--curve", "eval.losses", "--bit-exact")
    assert code == 0 and r["result"] == "pass" and r["bit_exact"] is True, text.out
    assert r["eval_steps"] == [0, 2, 4, 6, 7] and r["eval_steps_only_in"] == {"a": [], "b": [3]}
    assert r["jumps"] == [] and r["first_divergent_eval_step"] is None
    assert f"evaluations at steps [3] only in b ({resumed}): not compared" in text.out
    # a disagreement is named by its training step; a tolerance never pairs different steps
    off = run("off.json", [(0, 5.0), (2, 4.5), (3, 4.2), (4, 4.1), (6, 3.5), (7, 3.4)])
    code, r, text = _check(tmp_path, capsys, full, off, "--curve", "eval.losses", "--atol", "0.05")
    assert code == 1 and r["first_divergent_eval_step"] == 4 and r["first_divergent_step"] == 2
    assert "the curves first differ at the evaluation of step 4: |diff| 0.1 (equal before it)" in text.out
    assert "first_divergent_eval_step=4" in text.out and "first_divergent_step=" not in text.out
    # a run that stopped evaluating earlier is not as long as the other
    short = run("short.json", [(0, 5.0), (2, 4.5), (4, 4.0)])
    code, r, _ = _check(tmp_path, capsys, full, short, "--curve", "eval.losses")
    assert code == 1 and r["length_match"] is False and r["matching_steps"] == 3
    # its first N shared evaluations, equal: bit-exact whatever the runs' lengths (as --steps on losses)
    code, r, _ = _check(tmp_path, capsys, full, short, "--curve", "eval.losses", "--steps", "3", "--bit-exact")
    assert code == 0 and r["bit_exact"] is True and r["length_match"] is False
    # an evaluation record without its training step is unusable input
    nostep = _loss(tmp_path, "nostep.json", None, '{"losses": [1.0], "eval": [{"losses": 1.0}]}')
    code, _, text = _check(tmp_path, capsys, full, nostep, "--curve", "eval.losses")
    assert code == 2 and "eval[0].step is None, expected the training step" in text.err


def test_a_failed_comparison_names_differing_cpu_math_settings(tmp_path, capsys, monkeypatch):
    """MKL splits a GEMM's sums by its thread count: the same glm52 train line with OMP_NUM_THREADS 1
    and 2 differs from step 1 (2.5e-7 at seq 32 on the tiny model, 1.5e-5 at seq 256; equal with
    MKL_CBWR=AUTO,STRICT, measured), and loss.json recorded no thread setting to tell why. A run
    records them (cpu_math), and a failed check-loss names the ones that differ."""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("MKL_CBWR", "AUTO,STRICT")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    out = tmp_path / "run"
    args = ["train", "--model", "toy", "--seq-len", "8", "--global-batch-size", "2", "--steps", "1", "--no-progress"]
    assert main([*args, "--out", str(out)]) == 0
    capsys.readouterr()
    run = json.loads((out / "loss.json").read_text())
    assert run["cpu_math"]["OMP_NUM_THREADS"] == "3" and run["cpu_math"]["MKL_CBWR"] == "AUTO,STRICT"
    assert run["cpu_math"]["MKL_NUM_THREADS"] is None
    other = dict(run, losses=[x + 1e-7 for x in run["losses"]], cpu_math=dict(run["cpu_math"], OMP_NUM_THREADS="1"))
    b = _loss(tmp_path, "b.json", None, json.dumps(other))
    code, r, text = _check(tmp_path, capsys, out / "loss.json", b, "--bit-exact")
    assert code == 1 and r["cpu_math_differs"] == {"a": {"OMP_NUM_THREADS": "3"}, "b": {"OMP_NUM_THREADS": "1"}}
    assert "the runs' CPU math settings differ (a: {'OMP_NUM_THREADS': '3'}, b: {'OMP_NUM_THREADS': '1'})" in text.out
    same = _loss(tmp_path, "same.json", None, json.dumps(dict(other, cpu_math=run["cpu_math"])))
    code, r, _ = _check(tmp_path, capsys, out / "loss.json", same, "--bit-exact")
    assert code == 1 and "cpu_math_differs" not in r  # the settings are equal: not the cause


def test_a_first_difference_is_not_called_a_flip_and_a_jump_names_both_causes(tmp_path, capsys):
    """check-loss has no top-k margins, so it cannot tell a near-tie flip from a real difference
    (docs/parity.md: glm52 align names the reference's margins at each jump).  A constant offset from
    step 0 (a loss normalised differently) is the curves' first difference, with nothing before it to
    leap from: it is said as such, not as a routing flip; a leap after rounding growth names both
    causes.  The jump list of the receipt is kept as it was."""
    base = [2.0, 1.9, 1.8, 1.7, 1.6]
    a = _loss(tmp_path, "a.json", base)
    offset = _loss(tmp_path, "offset.json", [v + 0.5 for v in base])
    code, r, text = _check(tmp_path, capsys, a, offset, "--atol", "1e-3")
    assert code == 1 and [j["step"] for j in r["jumps"]] == [0], r["jumps"]
    assert "check-loss: the curves first differ at step 0: |diff| 0.5 (equal before it)" in text.out
    assert "flip" not in text.out and "jump" not in text.out
    leap = _loss(tmp_path, "leap.json", [2.0, 1.9 + 1e-6, 1.8 + 2e-6, 1.7 + 1e-3, 1.6 + 1e-3])
    code, r, text = _check(tmp_path, capsys, a, leap, "--atol", "1e-5")
    assert code == 1 and [j["step"] for j in r["jumps"]] == [3], r["jumps"]  # 1e-6, 2e-6: below the floor
    assert "first differ" not in text.out
    assert "jump at step 3: |diff| 0.001 after at most 2e-06 before: a leap, not steady rounding growth" in text.out
    assert "or a real difference; glm52 align names the reference's top-k margins" in text.out


def test_a_run_that_stopped_short_is_named_with_both_lengths(tmp_path, capsys):
    """A curve shorter than the other fails (``length_match`` false); the line says which run is
    short and by how much, and that ``--steps`` compares the steps both did (the receipt had
    ``len_a`` / ``len_b``, the printed line neither)."""
    a, b = _loss(tmp_path, "a.json", [2.0, 1.9, 1.8, 1.7]), _loss(tmp_path, "b.json", [2.0, 1.9])
    code, r, text = _check(tmp_path, capsys, a, b)
    assert code == 1 and (r["len_a"], r["len_b"]) == (4, 2)
    assert f"check-loss: a ({a}) has 4 losses, b ({b}) 2: b stopped short or ran fewer steps; --steps 2 " in text.out
    code, r, text = _check(tmp_path, capsys, a, b, "--steps", "3")
    assert code == 1 and f"a ({a}) has 4 losses, b ({b}) 2: --steps 3 needs that many on both" in text.out
    code, r, text = _check(tmp_path, capsys, a, b, "--steps", "2")
    assert code == 0 and "losses, b" not in text.out


def test_a_loss_the_run_computed_as_nan_is_named_as_such(tmp_path, capsys):
    """glm52 train and the reference trainer write a NaN / Inf loss as null and list it under
    ``nonfinite`` (``_io.dumps_json``).  It was refused as "losses[3] is None (NoneType), expected a
    number", an input error; it is the run's own NaN at step 3, said so, with the steps before it
    comparable: ``--steps 3`` compares them (the curve ends before the NaN, in a warning)."""
    good = _loss(tmp_path, "good.json", [2.0, 1.9, 1.8, 1.7, 1.6])
    raw = json.dumps({"losses": [2.0, 1.9, 1.8, None, None], "nonfinite": ["losses[3]", "losses[4]"]})
    nan = _loss(tmp_path, "nan.json", None, raw)
    code, r, text = _check(tmp_path, capsys, good, nan)
    assert code == 2 and r["result"] == "unusable input"
    assert (
        f"{nan}: losses[3] is non-finite: the run computed NaN or Inf at step 3 (written null, listed under "
        "'nonfinite')"
    ) in text.err
    assert "check-loss: --steps 3 compares the steps before the first non-finite loss" in text.err
    early = _loss(tmp_path, "early.json", None, json.dumps({"losses": [2.0, None], "nonfinite": ["losses[1]"]}))
    code, r, text = _check(tmp_path, capsys, early, nan)  # both went NaN: one hint, the earlier step
    assert code == 2 and text.err.count("--steps") == 1 and "--steps 1 compares" in text.err, text.err
    code, r, text = _check(tmp_path, capsys, good, nan, "--steps", "3")
    assert code == 0 and r["steps_compared"] == 3 and r["len_b"] == 3, r
    assert "losses[3] is non-finite (the run computed NaN or Inf at step 3): its curve ends before it" in text.err
    unlisted = _loss(tmp_path, "unlisted.json", None, json.dumps({"losses": [2.0, None]}))  # a null not the run's
    code, _, text = _check(tmp_path, capsys, good, unlisted, "--steps", "1")
    assert code == 2 and "losses[1] is None (NoneType), expected a number" in text.err


def test_a_nan_evaluation_is_named_as_the_runs(tmp_path, capsys):
    """An evaluation the run computed as NaN is written null and listed (``eval[1].losses``): it is
    named as the run's non-finite evaluation of its step, not as an input that holds no number."""
    raw = {"losses": [1.0] * 4, "eval": [{"step": 0, "losses": 5.0}, {"step": 2, "losses": None}]}
    nan = _loss(tmp_path, "nan.json", None, json.dumps({**raw, "nonfinite": ["eval[1].losses"]}))
    good = _loss(tmp_path, "good.json", None, json.dumps({**raw, "eval": [{"step": 0, "losses": 5.0}]}))
    code, _, text = _check(tmp_path, capsys, good, nan, "--curve", "eval.losses")
    assert code == 2 and f"{nan}: eval[1].losses is non-finite: the run's evaluation of step 2 computed" in text.err


def test_jumps_past_the_steps_compared_are_not_reported(tmp_path, capsys):
    """``--steps N`` compares the first N steps: a difference after them is no part of the verdict,
    nor reported as the curves' first difference beside a pass."""
    a, b = _loss(tmp_path, "a.json", [2.0, 1.9, 1.8, 1.7]), _loss(tmp_path, "b.json", [2.0, 1.9, 1.8, 1.2])
    code, r, text = _check(tmp_path, capsys, a, b, "--steps", "3")
    assert code == 0 and r["jumps"] == [] and "differ" not in text.out, text.out
    code, r, text = _check(tmp_path, capsys, a, b)
    assert code == 1 and [j["step"] for j in r["jumps"]] == [3]


def test_two_evaluations_of_one_step_that_disagree_are_refused(tmp_path, capsys):
    """An evaluation repeated at one step holds the same value (the same weights and data: the trainer
    does not write two, docs/parallel.md, --eval-at-start); two that disagree come from other weights
    or data (a merged or edited file), and which one to compare decides the verdict: refused by
    file, record and step, not resolved silently by keeping the first."""

    def run(name, evals):
        records = [{"step": s, "losses": v} for s, v in evals]
        return _loss(tmp_path, name, None, json.dumps({"losses": [1.0] * 4, "eval": records}))

    a = run("a.json", [(0, 5.0), (2, 4.5)])
    same = run("same.json", [(0, 5.0), (2, 4.5), (2, 4.5)])
    code, _, _ = _check(tmp_path, capsys, a, same, "--curve", "eval.losses")
    assert code == 0
    other = run("other.json", [(0, 5.0), (2, 4.5), (2, 4.0)])
    code, r, text = _check(tmp_path, capsys, a, other, "--curve", "eval.losses")
    assert code == 2 and f"{other}: eval[2] evaluates step 2 again with losses 4.0, eval[1] gave 4.5" in text.err


def test_a_difference_equal_to_atol_passes(tmp_path, capsys):
    """The rule is ``|a - b| <= atol + rtol |b|`` (docs/parity.md, torch.allclose's): a difference of
    exactly ``--atol`` agrees; one just above it does not."""
    a, b = _loss(tmp_path, "a.json", [1.0, 2.0]), _loss(tmp_path, "b.json", [1.5, 2.0])
    code, r, _ = _check(tmp_path, capsys, a, b, "--atol", "0.5")
    assert code == 0 and r["max_diff"] == 0.5, r
    code, _, _ = _check(tmp_path, capsys, a, b, "--atol", str(math.nextafter(0.5, 0.0)))
    assert code == 1


def test_a_failure_record_written_in_the_same_clock_tick_as_the_losses_is_the_runs(tmp_path, capsys):
    """A run that stops on an error writes its losses, then ``logs/failure.json``: on a filesystem of
    coarse timestamps both carry one mtime, and the record is the run's (only an older one is an
    earlier run's, docs/parity.md): the warning is printed."""
    import os

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    losses = _loss(run, "loss.json", [2.0, 1.9])
    record = run / "logs" / "failure.json"
    record.write_text(json.dumps({"message": "rank 1 died"}))
    tick = os.stat(losses).st_mtime_ns
    os.utime(record, ns=(tick, tick))
    other = _loss(tmp_path, "other.json", [2.0, 1.9])
    code, r, text = _check(tmp_path, capsys, losses, other)
    assert code == 0 and r["a"]["failed_run"]["message"] == "rank 1 died", r["a"]
    assert "is a failed run" in text.err
