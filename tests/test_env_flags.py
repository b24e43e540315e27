"""The package's on/off environment variables all read the same: 1/true/on/yes and 0/false/off/no
in any case, spaces around ignored, empty as unset; anything else is refused by ``glm52 train``
before it starts (one line naming the variable and the value, exit 2) and, read inside a run,
warned about once and left at its default."""

from __future__ import annotations

import warnings

import pytest

from paddleformers_glm.cli import main

FLAGS = ("GLM52_QUIET", "GLM52_CPU_KERNELS", "GLM52_CPU_BF16", "GLM52_FAST_COPY", "GLM52_EMULATE_COLLECTIVES")


@pytest.fixture(autouse=True)
def _no_flags(monkeypatch):
    for name in FLAGS:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    "raw, want",
    [
        ("1", True), ("true", True), ("On", True), (" YES ", True),
        ("0", False), ("False", False), ("OFF", False), (" no\n", False),
    ],
)  # fmt: skip
def test_on_and_off_words(monkeypatch, raw, want):
    from paddleformers_glm._io import env_flag

    monkeypatch.setenv("GLM52_X", raw)
    assert env_flag("GLM52_X", not want) is want


@pytest.mark.parametrize("default", [True, False])
def test_unset_or_empty_is_the_default(monkeypatch, default):
    from paddleformers_glm._io import env_flag

    assert env_flag("GLM52_X", default) is default
    monkeypatch.setenv("GLM52_X", "  ")
    assert env_flag("GLM52_X", default) is default
    assert env_flag("GLM52_X", default, value="off") is False  # a value read elsewhere (a deprecated name)


def test_anything_else_is_refused_or_warned_about(monkeypatch):
    from paddleformers_glm._io import ENV_FLAGS, EnvFlagError, env_flag

    assert set(ENV_FLAGS) == set(FLAGS)
    monkeypatch.setenv("GLM52_X", "maybe")
    with pytest.raises(EnvFlagError, match=r"^GLM52_X='maybe' is not an on/off setting: use 1, true, on, yes"):
        env_flag("GLM52_X", True)
    with pytest.warns(RuntimeWarning, match=r"GLM52_X='maybe' is not an on/off setting.*using the default \(on\)"):
        assert env_flag("GLM52_X", True, strict=False) is True


def test_quiet_false_does_not_silence(monkeypatch, capsys):
    """``GLM52_QUIET=false`` (or ``no``) silenced progress: anything but "" and "0" counted as on."""
    from paddleformers_glm import progress
    from paddleformers_glm.ops import kernels

    prev = progress.set_quiet(None)
    try:
        monkeypatch.setenv("GLM52_QUIET", "false")
        assert progress._quiet() is False
        kernels._say("compiling")
        assert "compiling" in capsys.readouterr().err
        monkeypatch.setenv("GLM52_QUIET", " Yes ")
        assert progress._quiet() is True
        kernels._say("compiling")
        assert capsys.readouterr().err == ""
    finally:
        progress.set_quiet(prev)


def test_cpu_bf16_off(monkeypatch):
    """``GLM52_CPU_BF16=off`` (or " 0") left the fp32 routing installed: only "0" turned it off."""
    from paddleformers_glm.ops import cpu_bf16

    monkeypatch.setenv("GLM52_CPU_BF16", "off")
    assert cpu_bf16.install() == []


def test_fast_copy_off(monkeypatch):
    """``GLM52_FAST_COPY=OFF`` kept the native transposes: only "0" turned them off."""
    from paddleformers_glm.ops import transpose

    transpose._lib.cache_clear()
    try:
        monkeypatch.setenv("GLM52_FAST_COPY", "OFF")
        assert transpose._lib() is None and not transpose.available()
    finally:
        transpose._lib.cache_clear()


def test_emulated_collectives_on(monkeypatch):
    """``GLM52_EMULATE_COLLECTIVES=true`` did nothing on a GPU: only "1" turned the emulation on."""
    from paddleformers_glm.parallel import comm

    monkeypatch.setattr(comm, "detect_backend", lambda: "nccl")
    assert comm.uses_emulation() is False
    monkeypatch.setenv("GLM52_EMULATE_COLLECTIVES", "true")
    assert comm.uses_emulation() is True
    monkeypatch.setenv("GLM52_EMULATE_COLLECTIVES", "sure")
    with pytest.warns(RuntimeWarning, match="GLM52_EMULATE_COLLECTIVES='sure'"):
        assert comm.uses_emulation() is False


def test_cpu_kernels_switch_warns_about_a_typo(monkeypatch):
    """A value neither on nor off built the kernels without a word; now a warning, and the default (on)."""
    from paddleformers_glm.ops import kernels

    for key in ("tried", "ops", "error"):
        monkeypatch.setitem(kernels._state, key, kernels._state[key])
    monkeypatch.setitem(kernels._state, "tried", False)
    monkeypatch.setattr(kernels, "build", lambda: "built")
    monkeypatch.setenv("GLM52_CPU_KERNELS", "of")
    with pytest.warns(RuntimeWarning, match="GLM52_CPU_KERNELS='of'"):
        assert kernels.cpu_ops() == "built"
    monkeypatch.setitem(kernels._state, "tried", False)
    monkeypatch.setitem(kernels._state, "ops", None)
    monkeypatch.setenv("GLM52_CPU_KERNELS", " Off ")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.cpu_ops() is None


def test_train_refuses_a_typo_before_it_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GLM52_CPU_BF16", "maybe")
    out = tmp_path / "run"
    rc = main(
        ["train", "--model", "toy", "--seq-len", "8", "--global-batch-size", "1", "--steps", "1", "--out", str(out)]
    )
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "ccache" not in ln]
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("glm52 train: error: GLM52_CPU_BF16='maybe' is not an on/off setting"), err
    assert not out.exists()


def test_the_train_module_entry_refuses_a_typo_as_glm52_does(tmp_path, monkeypatch, capsys):
    """``python -m paddleformers_glm.train`` (train.command.main) ran with a typo in an on/off variable
    that ``glm52 train`` refuses (exit 0, the default used without a word)."""
    from paddleformers_glm.train.command import main as train_main

    monkeypatch.setenv("GLM52_CPU_KERNELS", "maybe")
    out = tmp_path / "run"
    rc = train_main(["--model", "toy", "--seq-len", "8", "--global-batch-size", "1", "--steps", "1", "--out", str(out)])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "ccache" not in ln]
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("glm52 train: error: GLM52_CPU_KERNELS='maybe' is not an on/off setting"), err
    assert not out.exists()
