"""Distributed export: each rank writes the official-layout tensors it owns straight into the
planned files; the result is byte-identical to the single-process saver's (files and index), and
with TP2 x PP2 / TP2 x EP2 / CP2 x EP2 (experts split over the context-parallel ranks) at lr 0
byte-identical to that of the unsplit model."""

from __future__ import annotations

import filecmp
from pathlib import Path

import pytest

from paddleformers_glm.checkpoint import save_pretrained_state
from paddleformers_glm.checkpoint.distributed import export_distributed
from paddleformers_glm.modeling import GlmMoeDsaForCausalLM
from paddleformers_glm.parallel.pipeline import StageSpec
from paddleformers_glm.train.glm_adapter import GlmAdapter
from tests._dist.runner import run_train_cli, worker_logs


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from paddleformers_glm.tiny import make_tiny_checkpoint

    return Path(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt"))


@pytest.fixture(scope="module")
def reference(tiny_ckpt, tmp_path_factory):
    """The single-process saver's export of the checkpoint's weights, in 1 MB files and in one file
    (with the tokenizer files, as the trainer's export)."""
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(str(tiny_ckpt), dtype="float32")
    root = tmp_path_factory.mktemp("ref")
    save_pretrained_state(model, model.config, root / "sharded", dtype=model.config.model_dtype, max_shard_size="1MB")
    save_pretrained_state(  # the trainer's export carries the source's tokenizer files, in the run's dtype
        model,
        model.config,
        root / "single",
        dtype="float32",
        carry_from=str(tiny_ckpt),
        generation_config=model._changed_generation_config(),  # what model.save_pretrained writes
    )
    return root


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)


def test_single_rank_export_equals_the_saver_byte_for_byte(tiny_ckpt, reference, tmp_path):
    adapter = GlmAdapter(str(tiny_ckpt))
    c = adapter.config
    from paddleformers_glm.parallel.topology import get_topology

    stage = GlmMoeDsaForCausalLM(c, "float32", stage=StageSpec.whole(c.num_hidden_layers, True))
    adapter.load_stage(stage, get_topology())
    info = export_distributed(stage, c, str(tmp_path / "out"), max_shard_size="1MB")
    assert len(info["files"]) > 2 and info["files"][-1] == "model.safetensors.index.json"
    _same_files(tmp_path / "out", reference / "sharded")


def test_a_failed_export_leaves_no_temporary_folder_and_a_killed_ones_is_swept(tiny_ckpt, tmp_path, monkeypatch):
    """The export builds its files in a temporary folder beside the target, its shards created at
    their whole size.  A failed export left it (``.<name>.tmp-export``, measured after a full disk,
    a SIGTERM and 2 of 20 SIGKILLs), and only another distributed export removed it: its name held
    no pid, which a one-process save's sweep of killed saves' leftovers looks for.  Now a failure
    removes it, and a killed export's (its process gone) goes with the next save to that target,
    a one-process save or a distributed export."""
    import os
    import subprocess
    import sys

    from paddleformers_glm.checkpoint import safetensors_io
    from paddleformers_glm.parallel.topology import get_topology

    adapter = GlmAdapter(str(tiny_ckpt))
    c = adapter.config
    stage = GlmMoeDsaForCausalLM(c, "float32", stage=StageSpec.whole(c.num_hidden_layers, True))
    adapter.load_stage(stage, get_topology())
    out = tmp_path / "out"
    export_distributed(stage, c, str(out))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = safetensors_io.SafetensorsWriter.write
    calls = []

    def full_disk(self, *a, **k):
        calls.append(1)
        if len(calls) > 20:
            raise OSError(28, "No space left on device")
        return real(self, *a, **k)

    monkeypatch.setattr(safetensors_io.SafetensorsWriter, "write", full_disk)
    with pytest.raises(OSError, match="No space"):
        export_distributed(stage, c, str(out))
    monkeypatch.setattr(safetensors_io.SafetensorsWriter, "write", real)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing beside the target
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the export before: untouched

    # a killed export's folder (its pid no longer runs) is removed by the next save to the target
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".out.tmp-{int(gone.stdout)}-export"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 1024)
    GlmMoeDsaForCausalLM.from_pretrained(str(out), dtype="float32").save_pretrained(str(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and not os.path.exists(stale)
    # ... and by the next distributed export to it (what glm52 train --export runs)
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 1024)
    export_distributed(stage, c, str(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and not os.path.exists(stale)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [("--tp", "2", "--pp", "2"), ("--tp", "4", "--ep", "2", "--etp", "2"), ("--cp", "2", "--ep", "2")],
    ids=["tp2-pp2", "tp4-ep2-etp2", "cp2-ep2"],  # cp2-ep2: each cp rank writes the experts it owns
)
def test_parallel_export_equals_the_single_process_export(tiny_ckpt, reference, tmp_path, layout):
    args = ["--model", str(tiny_ckpt), "--steps", "1", "--seq-len", "16", "--global-batch-size", "2"]
    args += ["--lr", "0", "--min-lr", "0", "--weight-decay", "0", *layout, "--out", str(tmp_path), "--export"]
    p, _ = run_train_cli(args, timeout=300)
    if p.returncode != 0:
        pytest.fail(f"{layout} failed:\n{p.stderr[-3000:]}\n{worker_logs(tmp_path)}")
    _same_files(tmp_path / "export", reference / "single")


def test_export_carries_the_tokenizer_the_run_trained_with(tiny_ckpt, tmp_path):
    """``--tokenizer DIR`` tokenized the run's text data: the export ships that tokenizer (all its
    tokenizer files and only those; a ``--model`` folder's own ``chat_template.jinja`` would override
    the template in transformers), and the model folder's ``generation_config.json`` (the run also
    evaluates held-out text, tokenized with it before launch). Before, the
    export carried only the ``--model`` folder's files: with a weights-only model folder it had no
    tokenizer at all (measured: ``['config.json', 'model.safetensors']``)."""
    import json
    import shutil

    model, tok = tmp_path / "model", tmp_path / "tok"
    shutil.copytree(tiny_ckpt, model)
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.move(model / name, tok / name)
    tc = json.loads((tok / "tokenizer_config.json").read_text())
    tc["chat_template"] += "{# the run's template #}"
    (tok / "tokenizer_config.json").write_text(json.dumps(tc))
    (model / "generation_config.json").write_text('{"eos_token_id": [1, 2], "temperature": 0.7}\n')
    data = tmp_path / "t.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"Hello there, document {i} about the weather."}) + "\n" for i in range(8))
    )
    args = ["--model", str(model), "--data", str(data), "--tokenizer", str(tok), "--steps", "1", "--seq-len", "16"]
    args += ["--global-batch-size", "2", "--micro-batch-size", "1", "--out", str(tmp_path / "out"), "--export"]
    # held-out text too (this launch evaluates it): tokenized once, before launch, beside the run's data
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"text": f"A held-out note, number {i}."}) + "\n" for i in range(6)))
    p, _ = run_train_cli([*args, "--eval-data", str(held)], timeout=240)
    if p.returncode != 0:
        pytest.fail(f"export run failed:\n{p.stderr[-3000:]}\n{worker_logs(tmp_path / 'out')}")
    assert (tmp_path / "out" / "data" / "eval-held.seq16.npz").is_file()
    record = json.loads((tmp_path / "out" / "loss.json").read_text())["eval"]
    assert [r["step"] for r in record] == [1] and record[0]["tokens"] > 0 and record[0]["losses"] > 0
    out = tmp_path / "out" / "export"
    assert sorted(x.name for x in out.iterdir()) == sorted(
        ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (tok / name).read_bytes(), name
    assert (out / "generation_config.json").read_bytes() == (model / "generation_config.json").read_bytes()
    # a model folder with a tokenizer of its own (and a chat_template.jinja): still the run's tokenizer only
    (model / "tokenizer.json").write_bytes((tok / "tokenizer.json").read_bytes())
    (model / "tokenizer_config.json").write_bytes((tiny_ckpt / "tokenizer_config.json").read_bytes())
    (model / "chat_template.jinja").write_text("{{ 'the checkpoint template' }}")
    shutil.rmtree(tmp_path / "out")
    p, _ = run_train_cli(args, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not (out / "chat_template.jinja").exists()
    assert (out / "tokenizer_config.json").read_bytes() == (tok / "tokenizer_config.json").read_bytes()


def test_export_of_a_folder_without_generation_config_writes_the_derived_one(tiny_ckpt, tmp_path):
    """The export is a save of the model loaded from --model: as transformers' save_pretrained (its
    Trainer's save_model calls it), a folder without generation_config.json gets the one derived from
    config.json. Measured, transformers 5.23 on this make-tiny checkpoint: {"_from_model_config": true,
    "eos_token_id": [1, 2], "pad_token_id": 0, "transformers_version": "5.23.0", "use_cache": true}
    (tests/test_generate.py::HF_DERIVED_TINY). Before: the export had no generation_config.json."""
    import json

    from paddleformers_glm.train.command import main as train_main

    from .test_generate import HF_DERIVED_TINY

    assert not (tiny_ckpt / "generation_config.json").exists()
    args = ["--model", str(tiny_ckpt), "--steps", "1", "--seq-len", "16", "--global-batch-size", "1"]
    assert train_main([*args, "--out", str(tmp_path / "run"), "--export", "--no-progress"]) == 0
    saved = json.loads((tmp_path / "run" / "export" / "generation_config.json").read_text())
    assert saved == HF_DERIVED_TINY
