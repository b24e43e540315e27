"""A ``glm52`` command's output paths, checked before any work: an output that is one of the command's
inputs (``check-loss A B --json A``, ``check-ckpt REF CAND --json REF/config.json``, ``convert SRC SRC``)
is refused and the input left byte for byte; a folder where a file is written, or a file where a folder
is, is one line and exit 2, never a traceback (docs/failure-modes.md, "Output paths")."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pathlib
import shutil

import pytest

from paddleformers_glm.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny" / "checkpoint"


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip() and "ccache" not in ln]
    assert len(lines) == 1, err
    return lines[0]


def _tree(d: pathlib.Path) -> dict[str, str]:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()
    }


@pytest.fixture
def loss(tmp_path):
    f = tmp_path / "run" / "loss.json"
    f.parent.mkdir()
    f.write_text(json.dumps({"losses": [1.0, 0.9, 0.8]}))
    return f


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_check_loss_refuses_to_write_over_its_input(loss, flag, capsys):
    # before: exit 0 and loss.json replaced by the receipt (--json) or a PNG (--plot)
    before = loss.read_bytes()
    assert main(["check-loss", str(loss), str(loss), flag, str(loss)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"{flag} {loss}: this is an input of the command" in line, line
    assert loss.read_bytes() == before


@pytest.mark.parametrize("command", ["check-loss", "check-ckpt"])
def test_a_receipt_path_that_is_a_folder_or_under_a_file_is_one_line(loss, tmp_path, command, capsys):
    # before: IsADirectoryError / FileExistsError tracebacks (exit 1) after all the checking work
    inputs = [str(loss)] * 2 if command == "check-loss" else [str(FIXTURE)] * 2
    folder = tmp_path / "reports"
    (folder / "keep").mkdir(parents=True)
    assert main([command, *inputs, "--json", str(folder)]) == 2
    assert f"--json {folder}: a folder, not a file" in _one_line(capsys.readouterr().err)
    assert main([command, *inputs, "--json", str(loss / "r.json")]) == 2
    assert f"{loss} is a file, not a folder" in _one_line(capsys.readouterr().err)
    assert sorted(os.listdir(folder)) == ["keep"]


@pytest.mark.skipif(not FIXTURE.exists(), reason="HF fixture checkpoint not present")
def test_check_ckpt_refuses_a_receipt_over_a_checkpoint_file(tmp_path, capsys):
    # before: exit 0 and the reference's config.json replaced by the receipt (the checkpoint unloadable)
    ref = tmp_path / "ref"
    shutil.copytree(FIXTURE, ref)
    before = _tree(ref)
    for victim in ("config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors"):
        assert main(["check-ckpt", str(ref), str(FIXTURE), "--json", str(ref / victim), "--quiet"]) == 2
        assert "this is an input of the command" in _one_line(capsys.readouterr().err)
    assert _tree(ref) == before
    # a receipt beside the weights is fine
    assert main(["check-ckpt", str(ref), str(FIXTURE), "--json", str(ref / "receipt.json"), "--quiet"]) == 0
    assert json.loads((ref / "receipt.json").read_text())["exit_code"] == 0


@pytest.mark.parametrize("command", ["plot-experts", "plot-indexer"])
def test_plot_refuses_a_png_over_the_loss_record(loss, command, capsys):
    # before (plot-experts, a run with an expert-load block): exit 0 and loss.json replaced by the PNG
    from tests.test_expert_plot import _loss_json

    _loss_json(loss.parent)
    before = loss.read_bytes()
    assert main([command, str(loss.parent), "--png", str(loss)]) == 2
    assert "this is an input of the command" in _one_line(capsys.readouterr().err)
    assert loss.read_bytes() == before


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "src"
    shutil.copytree(FIXTURE, d)
    return d


@pytest.mark.skipif(not FIXTURE.exists(), reason="HF fixture checkpoint not present")
def test_convert_refuses_a_source_whose_files_link_into_the_output(tmp_path, capsys):
    """A source folder of links to the files of OUT: measured before, ``convert SRC OUT`` exited 0 and
    the source's links dangled (the save replaced OUT's files, which the source read)."""
    out, links = tmp_path / "out", tmp_path / "links"
    shutil.copytree(FIXTURE, out)
    links.mkdir()
    for f in out.iterdir():
        (links / f.name).symlink_to(f)
    before = _tree(out)
    assert main(["convert", str(links), str(out), "--to", "hf", "--quiet"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "is a link into the output folder" in line and str(out) in line, line
    assert _tree(out) == before and all(p.exists() for p in links.iterdir())


@pytest.mark.skipif(not FIXTURE.exists(), reason="HF fixture checkpoint not present")
@pytest.mark.parametrize("flags", [[], ["--to", "hf", "--dtype", "float16"], ["--quantization", "fp8", "--to", "hf"]])
def test_convert_refuses_to_write_over_its_source(src, flags, capsys):
    # before: exit 0 and SRC's official shards replaced by the output (--dtype float16 / fp8: the
    # source's bf16 weights gone for good)
    before = _tree(src)
    link = src.parent / "link"
    link.symlink_to(src, target_is_directory=True)
    for out in (str(src), f"{src}/./", str(link)):
        assert main(["convert", str(src), out, "--quiet", *flags]) == 2
        line = _one_line(capsys.readouterr().err)
        assert "is the source checkpoint's folder" in line and str(src) in line, line
    weights = src / "model-00001-of-00002.safetensors"
    assert main(["convert", str(weights), str(src), "--quiet", *flags]) == 2
    assert "is the source checkpoint's folder" in _one_line(capsys.readouterr().err)
    assert _tree(src) == before


@pytest.mark.skipif(not FIXTURE.exists(), reason="HF fixture checkpoint not present")
def test_convert_names_a_missing_source_not_the_output(tmp_path, capsys):
    # before: "convert: filesystem error on OUT: GlmMoeDsaConfig: no config file at <SRC's parent>/config.json"
    out = tmp_path / "out"
    assert main(["convert", str(tmp_path / "nope"), str(out)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("convert: ") and str(tmp_path / "nope") in line and "does not exist" in line, line
    assert str(out) not in line
    (tmp_path / "empty").mkdir()
    assert main(["convert", str(tmp_path / "empty"), str(out)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"no config file at {tmp_path / 'empty' / 'config.json'}" in line and str(out) not in line, line
    assert not out.exists()


@pytest.mark.parametrize("command", ["make-tiny", "train"])
def test_an_output_folder_that_is_a_file_is_one_line(tmp_path, command, capsys):
    # before: a CheckpointError (make-tiny) / FileExistsError (train) traceback, exit 1
    f = tmp_path / "a_file"
    f.write_text("keep me")
    args = {"make-tiny": [str(f)], "train": ["--model", "toy", "--steps", "1", "--seq-len", "16", "--out", str(f)]}
    assert main([command, *args[command]]) == 2
    assert str(f) in _one_line(capsys.readouterr().err)
    assert f.read_text() == "keep me"


def test_train_names_a_tokenizer_folder_it_cannot_read_without_data(tmp_path, capsys):
    # before: exit 0, the flag ignored (without --data nothing read it; the export would ship nothing)
    out = tmp_path / "out"
    args = ["train", "--model", "toy", "--steps", "1", "--seq-len", "16", "--no-progress", "--out", str(out)]
    assert main([*args, "--tokenizer", str(tmp_path / "missing")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("glm52 train: error: --tokenizer ") and "missing" in line, line
    assert not (out / "loss.json").exists()


def test_a_toy_export_is_atomic_and_readable_by_others(tmp_path, monkeypatch):
    # before: safetensors.numpy.save_file straight onto OUT/export/model.safetensors. safetensors < 0.8
    # (setup.py allows >= 0.4.3) truncates the file first: a write failing part way (a full disk) left a
    # torn file where the last export was (simulated below: a writer that truncates, writes half, raises);
    # safetensors 0.8 writes a temp file of its own and leaves it mode 0600 (measured: config.json 0644,
    # model.safetensors 0600), so others (a serving job) could not read the export
    import stat

    import safetensors.numpy

    from paddleformers_glm.train.toy_adapter import ToyAdapter

    out = tmp_path / "export"
    old = os.umask(0o022)
    try:
        ToyAdapter({}, seed=0).export(ToyAdapter({}, seed=0).full_state(), str(out))
    finally:
        os.umask(old)
    assert {f: stat.S_IMODE((out / f).stat().st_mode) for f in os.listdir(out)} == {
        "config.json": 0o644,
        "model.safetensors": 0o644,
    }
    before = _tree(out)

    def torn_write(tensors, filename, metadata=None):  # safetensors < 0.8: File::create, then the bytes
        with open(filename, "wb") as f:
            f.write(safetensors.numpy.save(tensors, metadata)[:1000])
        raise OSError(27, "File too large")

    monkeypatch.setattr(safetensors.numpy, "save_file", torn_write)
    with pytest.raises(OSError, match="File too large"):
        ToyAdapter({}, seed=1).export(ToyAdapter({}, seed=1).full_state(), str(out))
    assert _tree(out) == before
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]  # no temporary file left


def test_align_refused_by_its_arguments_leaves_the_earlier_runs(tmp_path, capsys):
    # before: OUT/reference, OUT/paddle and OUT/receipt were deleted first, then `--model` was found
    # to have no config.json (exit 2): a typo in --model threw away both finished runs
    out = tmp_path / "align"
    for sub in ("reference", "paddle", "receipt"):
        (out / sub).mkdir(parents=True)
        (out / sub / "loss.json").write_text('{"losses": [1.0]}')
    before = _tree(out)
    assert main(["align", "--model", str(tmp_path / "typo"), "--out", str(out)]) == 2
    assert f"--model {tmp_path / 'typo'}: no config.json" in _one_line(capsys.readouterr().err)
    if FIXTURE.exists():
        assert main(["align", "--model", str(FIXTURE), "--out", str(out), "--steps", "2", "--dump-step", "5"]) == 2
        # refused by the --dump-step range, or (CI: no torch) first by the missing reference extra
        refusal = "--dump-step" if importlib.util.find_spec("torch") else "needs the reference extra"
        assert refusal in _one_line(capsys.readouterr().err)
    assert _tree(out) == before
    f = tmp_path / "a_file"
    f.write_text("keep me")
    assert main(["align", "--model", str(FIXTURE), "--out", str(f)]) == 2
    assert f"--out {f}: a file, not a folder" in _one_line(capsys.readouterr().err)
    assert f.read_text() == "keep me"


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--tp", "3"], "tp 3 does not divide num_attention_heads 4"),
        (["--lr", "nan"], "--lr must be a finite number, got nan"),
        (["--loss-atol", "-1"], "--loss-atol must be >= 0, got -1.0"),
        (["--timeout", "0"], "--timeout must be > 0, got 0.0"),
    ],
)
def test_align_refuses_what_train_would_refuse_before_clearing_the_runs(tmp_path, capsys, monkeypatch, flags, needle):
    """Before: these lines cleared OUT/reference, OUT/paddle and OUT/receipt, then the reference run
    refused `--steps 0` ("train.py: error: --steps must be >= 1, got 0", exit 2), `--tp 3` ran the
    whole torch reference first and failed in glm52 train (exit 1), `--loss-atol -1` ran both runs
    to fail every loss comparison. Now the Paddle run's line takes glm52 train's pre-launch check
    (train.command.train_line_error, the same words) and the tolerances are checked: one line, exit 2, runs kept."""
    real = importlib.util.find_spec  # the reference extra counts as installed: the checks after it are tested
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: object() if n in ("torch", "transformers") else real(n, *a)
    )
    out = tmp_path / "align"
    for sub in ("reference", "paddle", "receipt"):
        (out / sub).mkdir(parents=True)
        (out / sub / "loss.json").write_text('{"losses": [1.0]}')
    before = _tree(out)
    assert main(["align", "--model", str(FIXTURE), "--out", str(out), *flags]) == 2
    assert _one_line(capsys.readouterr().err) == f"glm52 align: error: {needle}"
    assert _tree(out) == before


def test_align_passes_a_good_line_to_the_runs(tmp_path, capsys, monkeypatch):
    """The default line (TP2 x PP2 + SP on the tiny checkpoint) passes the check: align goes on to clear
    the old runs (stopped there here: no run is launched)."""
    from paddleformers_glm.parity import align

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: object() if n in ("torch", "transformers") else real(n, *a)
    )

    class Cleared(Exception):
        pass

    def rmtree(*a, **k):
        raise Cleared

    monkeypatch.setattr(align.shutil, "rmtree", rmtree)
    with pytest.raises(Cleared):
        main(["align", "--model", str(FIXTURE), "--out", str(tmp_path / "align"), "--steps", "3"])


def test_check_loss_refuses_json_and_plot_at_one_path(tmp_path, capsys, monkeypatch):
    """Before: `--json X --plot X` drew the plot, then the receipt replaced it (exit 0, the plot lost);
    the same file named relatively and absolutely too."""
    a = tmp_path / "a.json"
    a.write_text('{"losses": [1.0, 0.5]}')
    monkeypatch.chdir(tmp_path)
    for plot in ("out.bin", str(tmp_path / "out.bin")):
        assert main(["check-loss", str(a), str(a), "--json", "out.bin", "--plot", plot]) == 2
        line = _one_line(capsys.readouterr().err)
        assert (
            line
            == f"check-loss: --json out.bin and --plot {plot} are the same file; the second write would replace the first"
        )
        assert not (tmp_path / "out.bin").exists()


def test_plot_indexer_refuses_a_png_over_its_own_json(tmp_path, capsys):
    """Before: `plot-indexer OUT --png OUT/indexer.json` wrote the numbers, then the PNG over them (exit 0:
    a PNG named indexer.json, the record lost)."""
    run = tmp_path / "run"
    run.mkdir()
    block = {
        "stage": "warmup", "loss_weight": 1.0, "shared_supervision": False, "layers": [0], "steps": [1],
        "kl": [[1.0]], "recall": [[0.5]], "mean_recall": [0.5], "stages": [{"stage": "warmup", "first_step": 1, "last_step": 1}],
    }  # fmt: skip
    (run / "loss.json").write_text(json.dumps({"losses": [1.0], "indexer": block}))
    (run / "indexer.json").write_text("{}")
    assert main(["plot-indexer", str(run), "--png", str(run / "indexer.json")]) == 2
    assert "are the same file" in _one_line(capsys.readouterr().err)
    assert (run / "indexer.json").read_text() == "{}"


@pytest.mark.parametrize("where", ["file", "under a file"])
def test_train_refuses_a_dump_folder_that_cannot_be_made_before_training(tmp_path, capsys, where):
    """Before: the run trained, then failed at the dump with NotADirectoryError / FileExistsError
    (exit 1, a failure record in OUT/logs). Now one line naming --dump-step, exit 2, OUT not made."""
    f = tmp_path / "a_file"
    f.write_text("keep me")
    d = f if where == "file" else f / "dumps"
    out = tmp_path / "run"
    argv = ["train", "--model", str(FIXTURE), "--steps", "1", "--seq-len", "16", "--global-batch-size", "1"]
    assert main([*argv, "--dump-step", str(d), "1", "--out", str(out)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"glm52 train: error: --dump-step {d}: ") and "not a folder" in line, line
    assert f.read_text() == "keep me" and not out.exists()


@pytest.mark.skipif(not FIXTURE.exists(), reason="HF fixture checkpoint not present")
def test_check_ckpt_names_unusable_input_on_stderr(tmp_path, capsys):
    """As every glm52 command (check-loss, convert, generate, plan ...), unusable input is one line per
    problem on stderr, exit 2, nothing on stdout. Before: ``check-ckpt: unusable input (exit 2)`` and an
    indented ``error:`` line on stdout, stderr empty."""
    missing = tmp_path / "nope"
    assert main(["check-ckpt", str(missing), str(FIXTURE), "--quiet"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert _one_line(err) == f"check-ckpt: ref: path does not exist; file={missing}"
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"{}")  # shorter than a header length
    assert main(["check-ckpt", str(FIXTURE), str(bad), "--quiet"]) == 2
    out, err = capsys.readouterr()
    line = _one_line(err)
    assert out == "" and line.startswith("check-ckpt: cand: ") and str(bad) in line, (out, err)
    assert main(["check-ckpt", str(missing), str(bad), "--quiet"]) == 2  # both named, one line each
    out, err = capsys.readouterr()
    assert out == "" and [ln.split(":")[1] for ln in err.splitlines()] == [" ref", " cand"], err
    copy = tmp_path / "copy"
    shutil.copytree(FIXTURE, copy)
    assert main(["check-ckpt", str(FIXTURE), str(copy), "--quiet"]) == 0  # a verdict stays on stdout
    out, err = capsys.readouterr()
    assert out.startswith("check-ckpt: match (exit 0)") and err == ""
