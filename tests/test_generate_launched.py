"""``glm52 generate --tp N --ep M --pp P``: the checkpoint read and run split over launched ranks
(generation/launched.py through the training worker), rank 0's tokens streamed. The text is one
process's; the command checks that every rank chose the same tokens (a rank that went its own way
would otherwise print nothing wrong: only rank 0's tokens are shown)."""

from __future__ import annotations

import filecmp
import json

import pytest

from paddleformers_glm.cli import main

pytestmark = pytest.mark.slow

ARGS = ["generate", "--prompt", "Hello there", "--max-new-tokens", "6"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    from paddleformers_glm.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("launched") / "tiny")


def test_tp2_ep2_prints_the_one_process_text_and_keeps_only_asked_logs(tiny_dir, tmp_path, capsys):
    """Greedy at TP2 x EP2 (each rank half the heads and half the experts, the cache replicated):
    the same text as one process; --log-dir keeps the ranks' logs and the run's files there."""
    assert main([*ARGS, "--model", tiny_dir]) == 0
    plain = capsys.readouterr().out
    assert plain.strip()
    # a reused --log-dir: an earlier run's streams go (rank 7's of a larger layout too); a generate/
    # folder's other files are the user's and stay (the whole generate/ folder was deleted)
    mine = tmp_path / "logs" / "generate"
    (mine / "src").mkdir(parents=True)
    (mine / "src" / "main.py").write_text("print('mine')\n")
    (mine / "tokens.rank0").write_text("999\n")
    (mine / "tokens.rank7").write_text("999\n")
    assert main([*ARGS, "--model", tiny_dir, "--tp", "2", "--ep", "2", "--log-dir", str(tmp_path / "logs")]) == 0
    assert capsys.readouterr().out == plain
    assert (tmp_path / "logs" / "workerlog.1").is_file() and (tmp_path / "logs" / "generate.json").is_file()
    assert sorted(p.name for p in mine.iterdir()) == [
        "result.rank0.json",
        "result.rank1.json",
        "src",
        "tokens.rank0",
        "tokens.rank1",
    ]
    assert (mine / "src" / "main.py").read_text() == "print('mine')\n"


def test_ep2_sampling_without_a_seed_draws_the_same_tokens_on_both_ranks(tiny_dir, capsys):
    """--ep 2 above --tp 1: two copies of the attention, the experts split; both ranks run the
    generation and their MoE layers exchange tokens every step, so they must draw alike: without
    --seed they take the first rank's (generation/search.py). Measured before that: rank 1 chose
    other tokens and the command exited 2 naming both lists."""
    assert main([*ARGS, "--model", tiny_dir, "--ep", "2", "--do-sample", "--top-k", "20"]) == 0
    cap = capsys.readouterr()
    assert cap.out.strip() and "chose" not in cap.err


def test_tp2_speculative_prints_the_same_text(tiny_dir, capsys):
    """The MTP layer drafting on the split model: plain decoding's text, the drafter's counts on stderr."""
    assert main([*ARGS, "--model", tiny_dir]) == 0
    plain = capsys.readouterr().out
    assert main([*ARGS, "--model", tiny_dir, "--tp", "2", "--speculative"]) == 0
    cap = capsys.readouterr()
    assert cap.out == plain and "main forwards" in cap.err


@pytest.mark.parametrize(
    "split, dtype", [(["--tp", "2", "--pp", "2"], "float32"), (["--pp", "2"], "bfloat16")], ids=["tp2-pp2", "pp2-bf16"]
)
def test_pipeline_stages_print_the_one_process_text(tiny_dir, capsys, split, dtype):
    """Four ranks: two pipeline stages, each split over two tensor-parallel ranks; the stages run in
    turn every step and the last stage's logits reach every rank. In bf16 (the carry and the logits
    cross gloo as fp32, CPU kernels through ops/cpu_bf16) the text is one bf16 process's too."""
    assert main([*ARGS, "--model", tiny_dir, "--dtype", dtype]) == 0
    plain = capsys.readouterr().out
    assert main([*ARGS, "--model", tiny_dir, "--dtype", dtype, *split]) == 0
    assert capsys.readouterr().out == plain


def test_pp2_generate_equals_one_process_bit_for_bit(tiny_dir, tmp_path):
    """``from_pretrained(path, topology=pp 2)`` builds and reads only the rank's stage (before: every
    rank built and read the whole model, 811,920 parameters on the tiny checkpoint), and ``generate``
    on it (tests/_dist/check_generate_dist.py: greedy with and without the cache, right padding,
    beams, seeded and unseeded sampling, prompt lookup, an eval forward's cache continued by a step)
    gives one process's tokens and scores bit for bit: a stage runs the same operations on the same
    numbers (stage 1 starts on a shared indexer layer: the top-k travels with the hidden states). A
    forward with labels is refused by name (training goes through the trainer's pipeline), and so is
    a stage given another input than the stage before it ran; ``save_pretrained`` from the stages
    writes the one-process save byte for byte."""
    import numpy as np

    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM
    from tests._dist.check_generate_dist import PROMPT, generations
    from tests._dist.runner import launch_script, script_logs

    out = tmp_path / "out"
    p = launch_script("check_generate_dist.py", 2, [tiny_dir, str(out), "1", "1", "2"], tmp_path / "logs")
    assert p.returncode == 0 and (out / "rank1.json").is_file(), p.stderr[-2000:] + script_logs(tmp_path / "logs", 2)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    model = GlmMoeDsaForCausalLM.from_pretrained(tiny_dir, dtype="float32")
    model.eval()
    want = generations(model)
    for name, one in want.items():
        for r in ranks:
            assert r[name] == one, name
    whole = sum(int(p.size) for p in model.parameters())
    L = model.config.num_hidden_layers
    assert ranks[0]["built"] == {"stage_layers": [0, 1, 2, 3], "layers": [0, 1, 2, 3], "head": False,
                                 "params": ranks[0]["built"]["params"]}  # fmt: skip
    assert ranks[1]["built"]["stage_layers"] == [4, 5, 6, 7] and ranks[1]["built"]["layers"] == [4, 5, 6, 7, L]
    assert ranks[1]["built"]["head"] and all(r["built"]["params"] < whole for r in ranks)
    # the MTP layer embeds on the last stage: the embedding is the only tensor both stages hold
    embedding = model.config.vocab_size * model.config.hidden_size
    assert ranks[0]["built"]["params"] + ranks[1]["built"]["params"] == whole + embedding
    stats = {}
    o = model.generate(
        paddle_ids(PROMPT[0]), max_new_tokens=6, eos_token_id=[], prompt_lookup_num_tokens=2, stats=stats
    )
    assert ranks[0]["lookup"] == ranks[1]["lookup"] == {"tokens": o.numpy().tolist(), "stats": stats}
    assert ranks[0]["sampled_unseeded"] == ranks[1]["sampled_unseeded"]
    assert ranks[0]["max_time"] == ranks[1]["max_time"] and len(ranks[0]["max_time"]["tokens"][0]) == 8 + 1
    for r, stage in zip(ranks, (0, 1)):
        assert r["labels"].startswith(f"forward on pipeline stage {stage} of 2: labels not supported"), r["labels"]
        assert "decode_step traced by paddle.jit.to_static on a model split over ranks" in r["to_static"]
    assert np.isfinite(np.array(want["greedy"]["scores"])).all()
    # save_pretrained from the two stages writes the one-process save byte for byte
    model.save_pretrained(tmp_path / "one")
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert sorted(p.name for p in (out / "saved").iterdir()) == names
    assert filecmp.cmpfiles(out / "saved", tmp_path / "one", names, shallow=False)[1:] == ([], [])
    # the last stage given 6 tokens where the first ran 8: named, not attended over the wrong rows
    assert ranks[1]["mismatch"] == (
        "pipeline stage 1 was given input of [batch, seq] [1, 6] but stage 0 (rank 0) ran [1, 8]: every "
        "rank of a pipeline must run the same input"
    )


def paddle_ids(row: list[int]):
    import paddle

    return paddle.to_tensor([row])


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--tp", "3"], "tp 3 does not divide num_attention_heads 4"),
        (["--tp", "2", "--ep", "3"], "ep 3 x etp 1 = 3 must divide tp 2 x dp 1 = 2"),
        (["--tp", "0"], "--tp must be >= 1, got 0"),
        (["--log-dir", "x"], "--log-dir needs --tp, --ep or --pp"),
        (["--nnodes", "2"], "--nnodes needs --tp, --ep or --pp"),
        (["--rendezvous-timeout", "60"], "--rendezvous-timeout needs --tp, --ep or --pp"),
        (["--tp", "2", "--rendezvous-timeout", "60"], "--rendezvous-timeout 60 needs --nnodes N > 1"),
        (["--tp", "2", "--nnodes", "2"], "--nnodes 2 needs --master IP:PORT"),
        (["--tp", "2", "--nnodes", "3", "--master", "127.0.0.1:1"], "world size 2 is not divisible by --nnodes 3"),
        (["--tp", "2", "--job-timeout", "0"], "--job-timeout must be a finite number of seconds > 0, got 0.0"),
        (["--pp", "9"], "pp 9 > num_hidden_layers 8: a stage would have no layer"),
        (["--pp", "2", "--speculative"], "--speculative needs --pp 1 (the MTP layer drafts from"),
        (["--pp", "0"], "--pp must be >= 1, got 0"),
        (["--tp", "2", "--num-beams", "2", "--speculative"], "use_mtp drafts for one sequence"),
        (["--ep", "2", "--num-beams", "2", "--speculative"], "use_mtp drafts for one sequence"),
    ],
)
def test_a_layout_that_cannot_work_is_one_line_before_any_launch(tiny_dir, flags, needle, capsys):
    assert main([*ARGS, "--model", tiny_dir, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


def _edited_copy(tiny_dir, dest, config_keys=None, generation_config=None) -> str:
    """A copy of the tiny checkpoint with ``config_keys`` set in its config.json and, if given,
    ``generation_config`` as its generation_config.json."""
    import shutil

    shutil.copytree(tiny_dir, dest)
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps(cfg | (config_keys or {})))
    if generation_config is not None:
        (dest / "generation_config.json").write_text(json.dumps(generation_config))
    return str(dest)


@pytest.mark.parametrize(
    "edit, flags, needle",
    [
        ({"generation_config": {"num_beams": 2}}, ["--speculative"], "use_mtp drafts for one sequence"),
        ({"generation_config": {"num_return_sequences": 2}}, [], "num_return_sequences=2 needs do_sample=True"),
        ({"config_keys": {"num_nextn_predict_layers": 0}}, ["--speculative"], "use_mtp needs an MTP layer"),
    ],
    ids=["file-beams-speculative", "file-greedy-many-sequences", "no-mtp-layer"],
)
@pytest.mark.parametrize("split", [["--tp", "2"], ["--ep", "2"], []], ids=["tp2", "ep2", "one-process"])
def test_settings_no_run_can_use_are_one_line_before_any_launch(tiny_dir, tmp_path, edit, flags, needle, split, capsys):
    """The generation settings (the flags over the checkpoint's generation_config.json) are resolved
    as generate resolves them before the ranks start: one line, exit 2, no launch, as one process
    says it. Before: the ranks were launched and each raised in resolve_settings (exit 1, ~36 lines of
    tracebacks on stderr) where one process refused in one line."""
    model = _edited_copy(tiny_dir, tmp_path / "ckpt", **edit)
    log = ["--log-dir", str(tmp_path / "logs")] if split else []
    assert main([*ARGS, "--model", model, *split, *flags, *log]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "logs").exists()


def test_a_torn_shard_is_one_line_before_any_launch(tiny_dir, tmp_path, capsys):
    """The files are checked as the one-process command and glm52 train check them, before the ranks
    start (the ranks would each fail at the load: a failed job, exit 1, its record in a log folder)."""
    import shutil

    model = tmp_path / "torn"
    shutil.copytree(tiny_dir, model)
    (model / "model-00002-of-00002.safetensors").write_bytes(b"")
    log_dir = tmp_path / "logs"
    assert main([*ARGS, "--model", str(model), "--tp", "2", "--log-dir", str(log_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("glm52 generate: error: truncated safetensors file") and "model-00002-of-00002" in err
    assert len(err.splitlines()) == 1 and not log_dir.exists()


def test_an_earlier_runs_stream_is_removed_as_a_name_a_link_too(tmp_path):
    """A ``tokens.rankN`` that is a link is removed as a name: the rank writes its stream through that
    name, which would have truncated the file the link points to."""
    from paddleformers_glm.cli.generate import _clear_results

    out, kept = tmp_path / "generate", tmp_path / "elsewhere.txt"
    out.mkdir()
    kept.write_text("the user's\n")
    (out / "tokens.rank0").symlink_to(kept)
    (out / "result.rank1.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    _clear_results(str(out))
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and kept.read_text() == "the user's\n"


def test_a_log_dir_that_cannot_be_made_is_one_line_before_any_launch(tiny_dir, tmp_path, capsys):
    """A --log-dir under a file (or on a read-only disk) was a traceback from os.makedirs, exit 1."""
    (tmp_path / "a_file").write_text("x")
    log_dir = tmp_path / "a_file" / "logs"
    assert main([*ARGS, "--model", tiny_dir, "--tp", "2", "--log-dir", str(log_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"glm52 generate: error: --log-dir {log_dir}: "), err
    assert "Not a directory" in err


def test_a_log_dir_in_use_by_a_running_generate_is_refused_and_its_files_kept(tiny_dir, tmp_path, capsys):
    """Two launched runs given one --log-dir: the second rewrote the first's generate.json before its
    ranks read it and cleared its token streams, and the first printed the second's text, both
    exit 0. The second is now refused in one line naming the folder and its holder, exit 2, and
    nothing of the running one is touched (the running one is stood in for by its lock)."""
    from paddleformers_glm.train.out_lock import hold_out_folder

    log_dir = tmp_path / "logs"
    (log_dir / "generate").mkdir(parents=True)
    first = {"generate.json": '{"ids": [1]}', "generate/tokens.rank0": "5\n", "generate/result.rank0.json": "{}"}
    for name, text in first.items():
        (log_dir / name).write_text(text)
    with hold_out_folder(str(log_dir), lock=str(log_dir / "generate.lock")):
        rc = main([*ARGS, "--model", tiny_dir, "--tp", "2", "--log-dir", str(log_dir)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"glm52 generate: error: --log-dir {log_dir} is in use by a running glm52 generate (pid "), (
        err
    )
    assert err.endswith("wait for it to end, stop it, or give another --log-dir"), err
    assert {name: (log_dir / name).read_text() for name in first} == first


@pytest.mark.parametrize("split", [["--tp", "2"], ["--pp", "2"]], ids=["tp2", "pp2"])
def test_two_nodes_each_print_the_one_process_text(tiny_dir, tmp_path, split):
    """Two nodes simulated on this machine: ``--tp 2`` or ``--pp 2`` with ``--nnodes 2 --node-rank R``
    (one rank each: at --pp 2 one pipeline stage a node, the usual layout across nodes), one
    rendezvous, one shared --log-dir (each node logs in LOG_DIR/node<R>/). Each node streams its own
    first rank's tokens and checks its own ranks: both print one process's text."""
    import subprocess
    import sys

    from tests._dist.runner import env, run_nodes

    one = subprocess.run(
        [sys.executable, "-m", "paddleformers_glm.cli", *ARGS, "--model", tiny_dir],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert one.returncode == 0 and one.stdout.strip(), one.stderr[-2000:]
    base = [sys.executable, "-m", "paddleformers_glm.cli", *ARGS, "--model", tiny_dir, *split]
    got = run_nodes([*base, "--log-dir", str(tmp_path / "logs")])
    for r, (rc, out, err) in enumerate(got):
        assert rc == 0, f"node {r} rc {rc}:\n{err[-3000:]}"
        assert out == one.stdout, (r, out, one.stdout)
        assert (tmp_path / "logs" / f"node{r}" / "generate" / f"result.rank{r}.json").is_file()


def test_a_job_timeout_stops_every_rank_and_names_the_logs(tiny_dir, tmp_path, capsys):
    """--job-timeout shorter than the job: the launcher stops every rank (exit 124, as glm52 train),
    says so in its lines with the failure record and where the ranks' logs are, and keeps the folder."""
    from paddleformers_glm.train.launch import job_processes

    log_dir = tmp_path / "logs"
    rc = main([*ARGS, "--model", tiny_dir, "--tp", "2", "--job-timeout", "0.5", "--log-dir", str(log_dir)])
    err = capsys.readouterr().err
    assert rc == 124, err
    assert f"see {log_dir}/workerlog.*" in err and "(job exceeded --job-timeout 0.5 s; stopped)" in err
    assert f"(failure record: {log_dir}/failure.json)" in err and (log_dir / "failure.json").is_file()
    job = json.loads((log_dir / "job.json").read_text())["job_id"]
    assert job_processes(job) == []


def test_ctrl_c_stops_every_rank_with_one_line(tiny_dir, tmp_path):
    """SIGINT to the command while the ranks generate (after rank 0's first tokens): every process of
    the job ends (none left behind), exit 130, one line naming the signal and the failure record
    (the launcher's handling, as glm52 train's: tests/test_job_lifetime.py)."""
    import signal
    import subprocess
    import sys
    import time

    from paddleformers_glm.train.launch import job_processes
    from tests._dist.runner import env

    log_dir = tmp_path / "logs"
    cmd = [sys.executable, "-m", "paddleformers_glm.cli", *ARGS[:-1], "3000", "--model", tiny_dir]
    p = subprocess.Popen(
        [*cmd, "--tp", "2", "--log-dir", str(log_dir)],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        tokens, t0 = log_dir / "generate" / "tokens.rank0", time.monotonic()
        while not (tokens.is_file() and tokens.stat().st_size > 8) and time.monotonic() - t0 < 120:
            assert p.poll() is None, p.communicate()[1][-2000:]
            time.sleep(0.1)
        assert tokens.is_file(), "no token came within 120 s"
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    lines = [ln for ln in err.splitlines() if ln.strip() and "INFO" not in ln]
    assert p.returncode == 130, err[-2000:]
    assert lines[-2].startswith("glm52 generate: stopped by SIGINT") and lines[-1].startswith("(failure record:"), lines
    job = json.loads((log_dir / "job.json").read_text())["job_id"]
    assert job_processes(job) == []
