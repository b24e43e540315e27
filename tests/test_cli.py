"""What every `glm52` command does at its edges: help pages with defaults, the subcommand's usage
for a bad flag, one line for Ctrl-C, one message for a --model that is no checkpoint folder (a
typo, a Hugging Face Hub id), and `generate` arguments checked before anything is loaded."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from paddleformers_glm import cli
from paddleformers_glm.cli import main

from .conftest import OFFICIAL_CONFIG, TINY_CONFIG


def _subparsers():
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def test_every_help_page_shows_the_defaults():
    missing = []
    for name, p in _subparsers().items():
        fmt = p.formatter_class(prog=p.prog)
        for a in p._actions:
            if not a.option_strings or a.help == argparse.SUPPRESS or isinstance(a, argparse._HelpAction):
                continue
            if a.default is None or a.default is False or a.default == [] or a.default is argparse.SUPPRESS:
                continue  # by identity: a default of 0 or 0.0 equals False and is still a default to show
            if "default" not in fmt._get_help_string(a).lower():
                missing.append(f"{name} {a.option_strings[0]}")
    assert not missing, missing
    text = _subparsers()["train"].format_help()
    assert "default: 1234" in text  # --seed, which has no help text of its own
    assert "(0: frozen) (default: 0.0)" in text  # --moe-bias-update-rate: a zero default is shown too


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "--model", "m", "--prompt", "p"],
        ["check-loss", "a.json", "b.json"],
        ["plan", "--model", "m"],
        ["train", "--model", "m", "--out", "o"],
    ],
    ids=lambda a: a[0],
)
def test_a_bad_flag_shows_the_subcommands_usage(args, capsys):
    command = args[0]
    with pytest.raises(SystemExit) as e:
        main([*args, "--no-such-flag"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: glm52 {command}") and "--no-such-flag" in err


def test_an_interrupt_that_comes_back_as_another_exception_is_one_line(monkeypatch, capsys):
    """Ctrl-C inside Paddle's C++ (its import, an op) surfaces as ImportError / RuntimeError."""

    def interrupted_inside_cpp(args):
        cli._Interrupts.fired = True
        raise ImportError("initialization failed")

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda only=None: parser)
    monkeypatch.setattr(_plan_parser(parser), "_defaults", {"func": interrupted_inside_cpp})
    assert main(["plan", "--model", "x"]) == 130
    assert capsys.readouterr().err.strip() == "glm52 plan: interrupted"
    monkeypatch.setattr(_plan_parser(parser), "_defaults", {"func": lambda a: (_ for _ in ()).throw(ValueError("x"))})
    with pytest.raises(ValueError):  # anything else is not an interrupt
        main(["plan", "--model", "x"])


def _plan_parser(parser):
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["plan"]


def test_ctrl_c_during_a_search_is_one_line():
    cmd = [sys.executable, "-m", "paddleformers_glm.cli", "plan", "--model", str(OFFICIAL_CONFIG.parent)]
    p = subprocess.Popen([*cmd, "--search", "--gpus", "256"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    assert p.stderr is not None
    lines = []
    for line in p.stderr:  # wait until the search runs, then press Ctrl-C
        lines.append(line)
        if line.startswith("[glm52 plan] tp 1 done") or time.monotonic() > deadline:
            break
    p.send_signal(signal.SIGINT)
    rest = p.stderr.read()
    rc = p.wait(timeout=60)
    meaningful = [ln for ln in rest.splitlines() if ln.strip() and "ccache" not in ln and "warnings.warn" not in ln]
    assert rc == 130, (rc, rest[-2000:])
    assert meaningful == ["glm52 plan: interrupted"], rest[-2000:]


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("command", ["generate", "plan", "train"])
def test_a_missing_folder_and_a_hub_id_get_their_own_messages(command, tmp_path, capsys):
    extra = {"generate": ["--prompt", "hi"], "plan": [], "train": ["--out", str(tmp_path / "o")]}[command]
    assert main([command, "--model", str(tmp_path / "tinyy"), *extra]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "tinyy: no such folder" in line and "tokenizer" not in line
    assert main([command, "--model", "zai-org/GLM-5.2", *extra]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "Hugging Face Hub id" in line and "huggingface-cli download zai-org/GLM-5.2" in line
    (tmp_path / "empty").mkdir()
    assert main([command, "--model", str(tmp_path / "empty"), *extra]) == 2
    assert "no config.json" in _one_line(capsys.readouterr().err)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from paddleformers_glm.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("cli") / "tiny")


@pytest.mark.parametrize(
    "flags, needle",
    [
        # transformers 5.23 refuses 0 ("`max_new_tokens` must be greater than 0, but is 0.", measured in
        # test_generate.py); the flag's message said ">= 0" and 0 then failed with another message, unnamed
        (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 1, got -1"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (["--temperature", "nan"], "--temperature must be a finite number, got nan"),
        (["--top-p", "2"], "--top-p must be >= 0.0 and <= 1.0, got 2.0"),
        (["--top-k", "-3"], "--top-k must be >= 0"),
        (["--repetition-penalty", "0"], "--repetition-penalty must be > 0.0"),
        # before: numpy's "expected non-negative integer", no flag named, after the model was loaded
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
        # bytes the locale's encoding could not decode (a latin-1 'café' under a UTF-8 locale) reach Python as
        # lone surrogates; before: the tokenizer's bare TypeError "TextInputSequence must be str", exit 1
        (["--prompt", "caf\udce9"], "--prompt is not utf-8 text: byte 0xe9 at character 3"),
        (["--chat", "--system", "caf\udce9"], "--system is not utf-8 text: byte 0xe9 at character 3"),
        (["--stop", "\udcff"], "--stop is not utf-8 text: byte 0xff at character 0"),
    ],
)
def test_generate_refuses_bad_values_in_one_line(tiny_dir, flags, needle, capsys, monkeypatch):
    from paddleformers_glm.configuration import GlmMoeDsaConfig

    def loaded(*a, **k):
        raise AssertionError("a bad value is refused before anything is read")

    monkeypatch.setattr(GlmMoeDsaConfig, "from_pretrained", loaded)
    assert main(["generate", "--model", tiny_dir, "--prompt", "Hello", *flags]) == 2
    assert needle in _one_line(capsys.readouterr().err)


def test_generate_takes_top_p_0():
    """transformers 5.23 takes top_p 0 (the most likely token only; test_generate.py measures it)."""
    import argparse

    from paddleformers_glm.cli.generate import check_arguments

    names = ("max_new_tokens", "max_length", "top_k", "temperature", "repetition_penalty", "num_beams", "system")
    launch = dict(
        tp=1,
        ep=1,
        pp=1,
        log_dir=None,
        nnodes=1,
        master=None,
        node_rank=None,
        launcher_args="",
        job_timeout=None,
        rendezvous_timeout=None,
    )
    launch["speculative"] = False
    args = argparse.Namespace(**dict.fromkeys(names), top_p=0.0, chat=False, prompt="Hi", stop=[], seed=0, **launch)
    assert check_arguments(args) is None


def test_generate_says_when_sampling_flags_meet_greedy_decoding(tiny_dir, capsys):
    """The tiny checkpoint does not sample: ``--temperature 5`` (and ``--top-k``, ``--top-p``) printed
    the greedy text, exit 0, without a word (measured: the same text for any value and seed), where
    transformers warns that the flag is only used in sample-based generation modes.  With
    ``--do-sample`` they apply and nothing is said."""
    base = ["generate", "--model", tiny_dir, "--prompt", "Hello", "--max-new-tokens", "2"]
    assert main([*base, "--temperature", "5", "--top-k", "3"]) == 0
    notes = [ln for ln in capsys.readouterr().err.splitlines() if "note:" in ln]
    assert notes == [
        f"glm52 generate: note: --temperature, --top-k only apply when sampling (--do-sample, or do_sample in "
        f"{tiny_dir}/generation_config.json): greedy decoding ignores them"
    ], notes
    assert main([*base, "--temperature", "5", "--do-sample"]) == 0
    assert "note:" not in capsys.readouterr().err


def test_generate_refuses_system_without_chat(tiny_dir, capsys):
    """--system is "with --chat: a system message before the prompt"; without --chat it was dropped
    and the prompt's text generated from as if it had not been given (exit 0)."""
    assert main(["generate", "--model", tiny_dir, "--prompt", "Hello", "--system", "Be brief."]) == 2
    assert "--system needs --chat" in _one_line(capsys.readouterr().err)


def test_generate_names_a_torn_shard_in_one_line(tiny_dir, tmp_path, capsys):
    """An empty shard (a copy cut short) ended in a CheckpointError traceback, exit 1; now one line, exit 2."""
    import shutil

    model = tmp_path / "torn"
    shutil.copytree(tiny_dir, model)
    (model / "model-00002-of-00002.safetensors").write_bytes(b"")
    assert main(["generate", "--model", str(model), "--prompt", "Hello", "--max-new-tokens", "2"]) == 2
    line = _one_line("\n".join(ln for ln in capsys.readouterr().err.splitlines() if "INFO" not in ln))
    assert line.startswith("glm52 generate: error: truncated safetensors file") and "model-00002-of-00002" in line


@pytest.mark.parametrize("cut", ["empty", "mid-tensor"])
def test_train_refuses_a_torn_shard_before_launch(tiny_dir, tmp_path, capsys, cut):
    """A torn shard (a copy cut short: empty, or its header intact and its tensors cut) was found by
    the worker loading the weights: exit 1 and a failure record in OUT/logs. Now the headers and
    sizes are checked before launch, as glm52 generate refuses the same folder: one line naming the
    file, exit 2, OUT not made."""
    import shutil

    model = tmp_path / "torn"
    shutil.copytree(tiny_dir, model)
    shard = model / "model-00002-of-00002.safetensors"
    shard.write_bytes(b"" if cut == "empty" else shard.read_bytes()[: shard.stat().st_size // 2])
    out = tmp_path / "run"
    argv = ["train", "--model", str(model), "--steps", "1", "--seq-len", "16", "--global-batch-size", "1"]
    assert main([*argv, "--out", str(out)]) == 2
    line = _one_line("\n".join(ln for ln in capsys.readouterr().err.splitlines() if "INFO" not in ln))
    assert line.startswith("glm52 train: error: truncated safetensors file") and str(shard) in line, line
    assert not out.exists()


def test_generate_refuses_a_huge_length_before_loading_anything(tiny_dir):
    """The old failure grew to 12 GB and was OOM-killed; now a bound on the length, before Paddle
    is even imported (the run is short; its time is printed by the test for the report)."""
    code = (
        "import sys, time; t = time.perf_counter(); from paddleformers_glm.cli import main; "
        f"rc = main(['generate', '--model', {tiny_dir!r}, '--prompt', 'Hello', '--max-new-tokens', '100000000']); "
        "print(json.dumps({'rc': rc, 'paddle': 'paddle' in sys.modules, 's': time.perf_counter() - t}))"
    )
    p = subprocess.run(
        [sys.executable, "-c", "import json; " + code], capture_output=True, text=True, timeout=120, env=os.environ
    )
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["rc"] == 2 and res["paddle"] is False, (res, p.stderr)
    line = _one_line(p.stderr)
    assert "exceeds the model's max_position_embeddings 4096" in line
    print(f"refused in {res['s']:.2f} s")


def test_plan_accepts_a_tiny_model_folder(capsys):
    assert main(["plan", "--model", str(TINY_CONFIG.parent), "--tp", "2"]) == 0


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--seed", "-1"], "make-tiny: --seed must be an integer >= 0, got -1"),
        (["--indexer-loss-coeff", "inf"], "make-tiny: --indexer-loss-coeff must be a finite number >= 0, got inf"),
        (["--indexer-loss-coeff", "-1"], "make-tiny: --indexer-loss-coeff must be a finite number >= 0, got -1.0"),
    ],
)
def test_make_tiny_names_the_flag_of_a_bad_value(tmp_path, flags, needle, capsys):
    """Before: --seed -1 said only numpy's "expected non-negative integer" (no flag, no value) and
    --indexer-loss-coeff inf blamed configs/glm52-tiny/config.json, a file the user never named."""
    out = tmp_path / "tiny"
    assert main(["make-tiny", str(out), *flags]) == 2
    assert _one_line(capsys.readouterr().err) == needle
    assert not out.exists()


def test_train_choices_equal_the_settings_choices():
    """``glm52 train``'s argparse choices are spelled apart from the settings' check (the CLI loads no
    Paddle, settings does): a value one accepts and the other refuses would pass the CLI and fail on
    every rank, or be refused up front although the run takes it."""
    from paddleformers_glm.train.settings import SETTING_CHOICES

    compared = {}
    for a in _subparsers()["train"]._actions:
        if a.choices is not None and a.dest in SETTING_CHOICES:
            compared[a.dest] = (sorted(a.choices), sorted(SETTING_CHOICES[a.dest]))
    assert {"dtype", "recompute", "expert_update", "indexer_stage", "export_dtype"} <= set(compared), compared
    assert all(cli_ == settings for cli_, settings in compared.values()), compared
