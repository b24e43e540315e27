"""Bad input is refused up front, named: training data, config values, non-finite weights, tokenizer files.

Each case reproduces a failure of the earlier code: out-of-vocabulary tokens found only when
their batch was drawn (a 2-step run passed, a 15-step run died at step 5), jsonl ``labels``
longer than ``input_ids`` trained on padding, an odd-length ``.bin`` or non-UTF-8 jsonl failing
without a file name, ``hidden_size: "64"`` failing deep in a layer, ``rms_norm_eps: -1`` and
``num_hidden_layers: true`` loading, ``num_hidden_layers: 10**9`` spinning for minutes, NaN
weights and FP8 scales loading silently, and tokenizer files failing without their name.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import struct
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from paddleformers_glm.checkpoint.safetensors_io import Checkpoint
from paddleformers_glm.configuration import GlmMoeDsaConfig, indexer_types_from_schedule
from paddleformers_glm.tokenizer import GlmTokenizer, TokenizerError
from paddleformers_glm.train.data import open_data
from tests._dist.runner import error_lines, run_train_cli
from tests.conftest import FIXTURES, TINY_CONFIG

TOY = ["--model", "toy", "--seq-len", "16", "--global-batch-size", "2", "--seed", "3"]
V = 64  # the toy model's vocabulary


def _cli_error(tmp_path: Path, *args: str) -> str:
    """Run ``glm52 train``; it must fail with exactly one line and no traceback, writing no loss.json."""
    out = tmp_path / "out"
    p, _ = run_train_cli([*args, "--out", str(out)], timeout=200)
    lines = error_lines(p.stderr)
    assert p.returncode != 0, p.stdout[-2000:]
    assert len(lines) == 1 and lines[0].startswith("glm52 train: error:"), p.stderr[-3000:]
    assert not (out / "loss.json").exists()
    return lines[0]


# ---------------------------------------------------------------- data
@pytest.mark.slow  # a glm52 train process
def test_out_of_vocab_token_late_in_npy_is_refused_before_any_step(tmp_path):
    """A token past the vocabulary at position 150 (batch 4 of 2 x 16 tokens): named before launch."""
    toks = np.arange(400, dtype=np.int32) % V
    toks[150] = V + 7
    np.save(tmp_path / "d.npy", toks)
    with pytest.raises(
        ValueError, match=rf"d\.npy: token {V + 7} at position 150 is outside the vocabulary \[0, {V}\)"
    ):
        open_data(str(tmp_path / "d.npy"), 16, V, 0).validate()
    t0 = time.monotonic()
    line = _cli_error(tmp_path, *TOY, "--steps", "2", "--data", str(tmp_path / "d.npy"))
    assert f"{tmp_path / 'd.npy'}: token {V + 7} at position 150" in line, line
    assert "step" not in line  # found by the scan, not by a batch
    print(f"refused in {time.monotonic() - t0:.1f}s (process start included)")


def test_negative_ids_in_npy_are_refused(tmp_path):
    toks = np.arange(100, dtype=np.int64) % V
    toks[97] = -3
    np.save(tmp_path / "n.npy", toks)
    with pytest.raises(ValueError, match=r"token -3 at position 97 is outside the vocabulary"):
        open_data(str(tmp_path / "n.npy"), 16, V, 0).validate()


def test_bin_tokens_past_the_vocab_and_odd_length(tmp_path):
    (tmp_path / "t.bin").write_bytes((np.arange(64, dtype="<u2") % V).tobytes() + struct.pack("<H", 500))
    with pytest.raises(ValueError, match=r"t\.bin \(uint16\): token 500 at position 64"):
        open_data(str(tmp_path / "t.bin"), 16, V, 0).validate()
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00" * 40 + b"\x01")
    with pytest.raises(ValueError, match=r"odd\.bin: 81 bytes is not a whole number of uint16 tokens \(2 bytes each\)"):
        open_data(str(tmp_path / "odd.bin"), 16, V, 0)
    with pytest.raises(
        ValueError, match=r"--data-dtype must be auto or one of uint16, uint32, int32, int64, got 'float8'"
    ):
        open_data(str(tmp_path / "t.bin"), 16, V, 0, data_dtype="float8")


@pytest.mark.slow  # a glm52 train process
def test_odd_length_bin_through_the_cli_is_one_line(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00" * 40 + b"\x01")
    line = _cli_error(tmp_path, *TOY, "--steps", "1", "--data", str(tmp_path / "odd.bin"))
    assert f"{tmp_path / 'odd.bin'}: 81 bytes is not a whole number of uint16 tokens" in line, line


def test_jsonl_labels_longer_than_input_ids_are_refused(tmp_path):
    f = tmp_path / "l.jsonl"
    f.write_text(
        json.dumps({"input_ids": [1, 2, 3], "labels": [1, 2, 3]})
        + "\n"
        + json.dumps({"input_ids": [1, 2, 3], "labels": [1, 2, 3, 4, 5]})
        + "\n"
    )
    with pytest.raises(ValueError, match=r"l\.jsonl:2: labels has 5 entries, input_ids 3: one label per input token"):
        open_data(str(f), 16, V, 0)


@pytest.mark.slow  # a glm52 train process
def test_jsonl_not_utf8_is_named_with_its_line(tmp_path):
    f = tmp_path / "u.jsonl"
    f.write_bytes(b'{"input_ids": [1, 2]}\n{"input_ids": [1, 2], "x": "\xff"}\n')
    with pytest.raises(ValueError, match=r"u\.jsonl:2: not UTF-8 text"):
        open_data(str(f), 16, V, 0)
    line = _cli_error(tmp_path, *TOY, "--steps", "1", "--data", str(f))
    assert f"{f}:2: not UTF-8 text" in line, line


def test_npz_labels_and_mask_are_checked(tmp_path):
    ids = np.ones((2, 16), dtype=np.int64)
    labels = np.full_like(ids, -100)
    labels[:, 7] = 1  # a target a row (test_npz_rows_without_a_target_are_refused)
    np.savez(tmp_path / "p.npz", input_ids=ids, labels=labels, attention_mask=np.ones_like(ids))
    open_data(str(tmp_path / "p.npz"), 16, V, 0).validate()  # -100 labels are the ignore index
    lab = ids.copy()
    lab[1, 5] = V
    np.savez(tmp_path / "q.npz", input_ids=ids, labels=lab, attention_mask=np.ones_like(ids))
    with pytest.raises(ValueError, match=rf"q\.npz: labels: token {V} at row 1 column 5"):
        open_data(str(tmp_path / "q.npz"), 16, V, 0).validate()


def test_npz_rows_without_a_target_are_refused(tmp_path):
    """A .npz row whose labels are -100 past position 0 (the loss's targets are positions 1..S-1) trains
    on nothing: all such rows ran with loss 0.0 and grad norm 0, exit 0 (an --eval-data of them reported
    losses 0.0 over 0 tokens). Refused naming the row, as a jsonl record is ("no label to train on")."""
    ids = np.ones((3, 16), dtype=np.int64)
    labels = ids.copy()
    labels[2, 1:] = -100  # position 0's label is never a target
    np.savez(tmp_path / "p.npz", input_ids=ids, labels=labels, attention_mask=np.ones_like(ids))
    with pytest.raises(ValueError, match=r"p\.npz: row 2: no label to train on within the first --seq-len 16 tokens"):
        open_data(str(tmp_path / "p.npz"), 16, V, 0).validate()
    np.savez_compressed(tmp_path / "c.npz", input_ids=ids, labels=labels, attention_mask=np.ones_like(ids))
    with pytest.raises(ValueError, match=r"c\.npz: row 2: no label to train on"):  # read whole, not mapped
        open_data(str(tmp_path / "c.npz"), 16, V, 0).validate()


@pytest.mark.parametrize("member", ["input_ids", "labels", "attention_mask"])
def test_npz_of_float_arrays_is_refused_not_truncated(tmp_path, member):
    """Token ids 7.9 were read as 7 and a mask of 0.6 as 0 (which passed the 0 / 1 check), and trained;
    the same floats in a .npy are refused ("expected integer tokens, got dtype float32")."""
    arrays = {k: np.ones((2, 16), dtype=np.int64) for k in ("input_ids", "labels", "attention_mask")}
    arrays[member] = np.full((2, 16), 0.6 if member == "attention_mask" else 7.9, dtype=np.float32)
    np.savez(tmp_path / "f.npz", **arrays)
    what = "0 / 1 integers" if member == "attention_mask" else "integer tokens"
    with pytest.raises(ValueError, match=rf"f\.npz: {member}: expected {what}, got dtype float32"):
        open_data(str(tmp_path / "f.npz"), 16, V, 0)


def test_pickled_npy_is_refused_not_loaded(tmp_path):
    """An object-dtype .npy is a pickle; the data reader never unpickles (allow_pickle=False)."""
    import os

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    np.save(tmp_path / "o.npy", np.array([Payload()], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match=r"o\.npy: not a readable \.npy array file"):
        open_data(str(tmp_path / "o.npy"), 16, V, 0)
    assert not (tmp_path / "ran").exists()


def test_token_scan_finds_the_last_token_of_a_multi_chunk_file(tmp_path):
    """The whole-file scan covers every chunk (32M tokens: two chunks of 16M), the bad token last."""
    toks = np.memmap(tmp_path / "big.bin", dtype="<u2", mode="w+", shape=(1 << 25,))
    toks[:] = 5
    toks[-1] = 40000
    toks.flush()
    del toks
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=rf"token 40000 at position {(1 << 25) - 1} "):
        open_data(str(tmp_path / "big.bin"), 16, V, 0).validate()
    print(f"scanned 32M uint16 tokens (64 MB) in {time.perf_counter() - t0:.2f}s (shared machine)")


# ---------------------------------------------------------------- config
@pytest.mark.slow  # glm52 train processes
@pytest.mark.parametrize(
    "args, message",
    [
        ([*TOY, "--cp", "2"], "--cp 2: the toy model does not support context parallel"),
        (
            ["--model", str(FIXTURES / "tiny" / "checkpoint"), "--seq-len", "16", "--global-batch-size", "2"]
            + ["--cp", "2", "--moe-aux-loss-coeff", "0.01"],
            "--cp with --moe-aux-loss-coeff > 0 is not supported",
        ),
    ],
    ids=["cp-unsupported-model", "cp-with-sequence-aux-loss"],
)
def test_a_context_parallel_setting_the_run_cannot_take_is_refused_before_launch(tmp_path, args, message):
    """Settings every rank would refuse are refused by the command itself: exit 2, one line, and no
    process launched (no OUT/logs, where the launcher puts the workers' logs)."""
    line = _cli_error(tmp_path, *args, "--steps", "1")
    assert message in line, line
    assert not (tmp_path / "out" / "logs").exists()


@contextlib.contextmanager
def answers_without_building_anything(limit_bytes: int = 1 << 20, liveness_s: int = 60):
    """The block allocates under ``limit_bytes`` at its peak (a per-layer list of 10**9 entries
    would take gigabytes); SIGALRM after ``liveness_s`` turns a spin (the earlier code's minutes)
    into a failure instead of a hung suite. A liveness bound, not a speed measurement."""

    def spun(*_):
        raise TimeoutError(f"still running after {liveness_s} s")

    old = signal.signal(signal.SIGALRM, spun)
    signal.alarm(liveness_s)
    tracemalloc.start()
    try:
        yield
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert peak < limit_bytes, f"peak allocation {peak} bytes"


def _tiny_dict() -> dict:
    return json.loads(TINY_CONFIG.read_text())


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("hidden_size", "64", "expected an integer in [1, 2147483647], got '64' (str)"),
        ("hidden_size", 64.5, "expected an integer in [1, 2147483647], got 64.5 (float)"),
        ("rms_norm_eps", -1, "expected a finite number > 0.0, got -1 (int)"),
        ("rms_norm_eps", float("nan"), "expected a finite number > 0.0, got nan (float)"),
        ("num_hidden_layers", True, "expected an integer in [1, 10000], got True (bool)"),
        ("num_hidden_layers", 10**9, "expected an integer in [1, 10000], got 1000000000 (int)"),
        ("vocab_size", 0, "expected an integer in [1, 2147483647], got 0 (int)"),
        ("attention_bias", "no", "expected true or false, got 'no' (str)"),
        ("hidden_act", "gelu", "only 'silu' is supported"),
        # transformers 5.23 reads no topk_method (measured: "greedy" and "banana" route as noaux_tc there and
        # here alike, logits equal); another method is not what the file says it is
        ("topk_method", "greedy", "only 'noaux_tc' (top-k over bias-corrected group scores) is supported"),
        ("hidden_act", 3, "expected a string, got 3 (int)"),
        ("eos_token_id", [1, "2"], "`eos_token_id[1]`: expected an integer"),
        ("attention_dropout", 1.5, "expected a finite number >= 0.0 and <= 1.0, got 1.5 (float)"),
        ("indexer_types", ["full", ["shared"]], "must be a list of 'full'/'shared'"),
    ],
)
def test_config_values_are_checked_per_key_naming_the_file(tmp_path, key, value, expected):
    d = _tiny_dict()
    d[key] = value
    if key == "indexer_types":
        d[key] = value + ["shared"] * (d["num_hidden_layers"] - len(value))
    f = tmp_path / "config.json"
    f.write_text(json.dumps(d))
    with answers_without_building_anything(), pytest.raises(ValueError) as e:
        GlmMoeDsaConfig.from_pretrained(f)
    msg = str(e.value)
    assert f"`{key}" in msg and expected in msg and str(f) in msg, msg


def test_rope_numbers_are_numbers(tmp_path):
    d = _tiny_dict()
    d["rope_parameters"] = {**d["rope_parameters"], "rope_theta": "1e6"}
    with pytest.raises(ValueError, match=r"`rope_parameters\.rope_theta`: expected a finite number > 0\.0, got '1e6'"):
        GlmMoeDsaConfig.from_dict(d)


def test_schedule_builder_refuses_absurd_layer_counts_at_once():
    with answers_without_building_anything(), pytest.raises(ValueError, match="num_hidden_layers"):
        indexer_types_from_schedule(10**9, 4, 3)


def test_config_not_utf8_is_named(tmp_path):
    f = tmp_path / "config.json"
    f.write_bytes(b'{"model_type": "glm_moe_dsa", "x": "\xff"}')
    with pytest.raises(ValueError, match=rf"{f}: the model config is not UTF-8 text \(line 1, byte 36\)"):
        GlmMoeDsaConfig.from_pretrained(f)


def test_valid_configs_still_load_and_round_trip():
    from tests.conftest import OFFICIAL_CONFIG

    for f in [OFFICIAL_CONFIG, TINY_CONFIG, *sorted((FIXTURES / "configs").rglob("*.json"))]:
        d = json.loads(f.read_text())
        if d.get("model_type", "glm_moe_dsa") != "glm_moe_dsa" or "hidden_size" not in d:
            continue
        assert GlmMoeDsaConfig.from_dict(d).to_dict() == d, f


# ---------------------------------------------------------------- non-finite weights
_NAN_BITS = {"BF16": b"\xc0\x7f", "F32": b"\x00\x00\xc0\x7f"}


def _plant_nan(folder: Path, key: str) -> None:
    with Checkpoint(str(folder)) as ckpt:
        info = ckpt.info(key)
    with open(info.file, "r+b") as f:
        f.seek(info.begin)
        f.write(_NAN_BITS[info.dtype])


@pytest.fixture
def nan_tiny(tmp_path) -> Path:
    folder = tmp_path / "tiny"
    shutil.copytree(FIXTURES / "tiny" / "checkpoint", folder)
    _plant_nan(folder, "model.layers.0.input_layernorm.weight")
    return folder


def test_from_pretrained_refuses_nan_weights_by_name(nan_tiny):
    from paddleformers_glm import GlmMoeDsaForCausalLM
    from paddleformers_glm.checkpoint.finite import NonFiniteError

    with pytest.raises(NonFiniteError) as e:
        GlmMoeDsaForCausalLM.from_pretrained(nan_tiny)
    assert e.value.key == "model.layers.0.input_layernorm.weight" and e.value.counts == {e.value.key: 1}
    assert str(nan_tiny) in str(e.value)
    m = GlmMoeDsaForCausalLM.from_pretrained(nan_tiny, check_finite=False)  # opted out: loads as stored
    assert np.isnan(m.state_dict()["model.layers.0.input_layernorm.weight"].numpy()[0])


def test_nan_fp8_scale_is_refused_by_from_pretrained_and_named_by_check_ckpt(tmp_path, capsys):
    from paddleformers_glm import GlmMoeDsaForCausalLM
    from paddleformers_glm.checkpoint.finite import NonFiniteError
    from paddleformers_glm.cli import main

    folder = tmp_path / "fp8"
    shutil.copytree(FIXTURES / "tiny_fp8" / "checkpoint", folder)
    scale = "model.layers.0.mlp.gate_proj.weight_scale_inv"
    _plant_nan(folder, scale)
    with pytest.raises(
        NonFiniteError, match=r"hold NaN or Inf: model\.layers\.0\.mlp\.up_gate_proj\.weight \(8192 values\)"
    ):
        GlmMoeDsaForCausalLM.from_pretrained(folder)
    ref = FIXTURES / "tiny_fp8" / "checkpoint"
    rc = main(["check-ckpt", str(ref), str(folder), "--quiet"])
    out = capsys.readouterr().err  # unusable input: on stderr
    assert rc == 2, out
    assert f"check-ckpt: cand: FP8 scale {scale} (F32, file {folder}/" in out and "holds 1 NaN/Inf values" in out, out
    rc = main(["check-ckpt", str(ref), str(folder), "--quiet", "--allow-nonfinite"])
    out = capsys.readouterr().out
    assert rc == 1 and f"warning: cand: FP8 scale {scale}" in out, out  # compared: the scale differs


def test_check_ckpt_refuses_identical_nan_checkpoints(nan_tiny, tmp_path, capsys):
    """Identical NaN bytes hash alike: without the scan two broken copies would "match"."""
    from paddleformers_glm.cli import main

    twin = tmp_path / "twin"
    shutil.copytree(nan_tiny, twin)
    rc = main(["check-ckpt", str(nan_tiny), str(twin), "--quiet"])
    out = capsys.readouterr().err  # unusable input: on stderr
    assert rc == 2 and "ref: tensor model.layers.0.input_layernorm.weight (BF16" in out, out
    assert "cand: tensor model.layers.0.input_layernorm.weight (BF16" in out, out


@pytest.mark.slow  # a glm52 train process
def test_train_refuses_nan_weights_naming_the_tensor(nan_tiny, tmp_path):
    line = _cli_error(tmp_path, "--model", str(nan_tiny), "--steps", "1", "--seq-len", "16", "--global-batch-size", "1")
    assert "model.layers.0.input_layernorm.weight (1 values)" in line and str(nan_tiny) in line, line


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F8_E4M3", "F8_E5M2"])
def test_raw_nonfinite_test_agrees_with_a_decode_of_every_bit_pattern(dtype):
    """Every bit pattern of the 8- and 16-bit float formats: the raw bit test says non-finite
    exactly where Paddle's (bf16, fp8) or numpy's (fp16) decoding to float32 is NaN or Inf."""
    import paddle

    from paddleformers_glm.checkpoint.finite import count_nonfinite_raw

    if dtype == "F16":
        bits = np.arange(1 << 16, dtype=np.uint16)
        decoded = bits.view(np.float16).astype(np.float32)
    elif dtype == "BF16":
        bits = np.arange(1 << 16, dtype=np.uint16)
        decoded = paddle.to_tensor(bits).astype("float32").numpy()  # a uint16 array becomes a bf16 tensor
    else:
        bits = np.arange(256, dtype=np.uint8)
        name = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}[dtype]
        decoded = paddle.to_tensor(bits).view(getattr(paddle, name)).astype("float32").numpy()
    want = ~np.isfinite(decoded)
    got = np.array([count_nonfinite_raw(bits[i : i + 1], dtype) for i in range(bits.size)]) == 1
    assert want.any() and (got == want).all(), np.flatnonzero(got != want)[:10]
    assert count_nonfinite_raw(bits, dtype) == int(want.sum())


def test_raw_nonfinite_count_of_wide_floats():
    from paddleformers_glm.checkpoint.finite import count_nonfinite_raw

    vals = np.array([0.0, 1.5, -2.0, np.nan, np.inf, -np.inf, 3.0])
    for dtype, np_dtype in (("F32", np.float32), ("F64", np.float64)):
        assert count_nonfinite_raw(vals.astype(np_dtype), dtype) == 3
    assert count_nonfinite_raw(np.arange(10, dtype=np.int64), "I64") == 0


# ---------------------------------------------------------------- tokenizer files
@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    from paddleformers_glm.tiny import make_tiny_tokenizer

    d = tmp_path_factory.mktemp("tok")
    make_tiny_tokenizer().save_pretrained(d)
    return d


def _tok_copy(tok_dir: Path, tmp_path: Path) -> Path:
    d = tmp_path / "tok"
    shutil.copytree(tok_dir, d)
    return d


def test_tokenizer_config_not_utf8_is_named(tok_dir, tmp_path):
    d = _tok_copy(tok_dir, tmp_path)
    (d / "tokenizer_config.json").write_bytes(b'{\n "eos_token": "\xff"\n}')
    with pytest.raises(
        TokenizerError, match=r"tokenizer_config\.json: the tokenizer config is not UTF-8 text \(line 2"
    ):
        GlmTokenizer.from_pretrained(d)


def test_tokenizer_config_that_is_a_list_is_named(tok_dir, tmp_path):
    d = _tok_copy(tok_dir, tmp_path)
    (d / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(
        TokenizerError, match=r"tokenizer_config\.json: the tokenizer config must be a JSON object, got a list"
    ):
        GlmTokenizer.from_pretrained(d)


@pytest.mark.parametrize("template", [5, {"a": 1}, [{"name": "default"}]])
def test_chat_template_that_is_not_a_string_is_named(tok_dir, tmp_path, template):
    d = _tok_copy(tok_dir, tmp_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json 'chat_template': "):
        GlmTokenizer.from_pretrained(d)


def test_chat_template_syntax_error_names_file_and_line(tok_dir, tmp_path):
    d = _tok_copy(tok_dir, tmp_path)
    (d / "chat_template.jinja").write_text("{{ messages }}\n{% for m in messages %}\n")
    tok = GlmTokenizer.from_pretrained(d)
    with pytest.raises(TokenizerError, match=r"chat_template\.jinja: chat template syntax error at line \d"):
        tok.render_chat([{"role": "user", "content": "hi"}])


@pytest.mark.slow  # a glm52 train process
def test_bad_tokenizer_through_train_is_one_line(tok_dir, tmp_path):
    d = _tok_copy(tok_dir, tmp_path)
    (d / "tokenizer_config.json").write_text("[1, 2]")
    data = tmp_path / "t.jsonl"
    data.write_text(json.dumps({"text": "hello there"}) + "\n")
    line = _cli_error(tmp_path, *TOY, "--steps", "1", "--data", str(data), "--tokenizer", str(d))
    assert f"{d / 'tokenizer_config.json'}: the tokenizer config must be a JSON object, got a list" in line, line


# ---------------------------------------------------------------- checkpoint index
@pytest.mark.parametrize("name", ["../model-00001-of-00002.safetensors", "/etc/passwd", "sub/x.safetensors"])
def test_index_naming_a_file_outside_the_folder_is_refused(tmp_path, name):
    """The index's weight_map may only name files in the checkpoint folder (no path traversal)."""
    from paddleformers_glm.checkpoint.errors import CheckpointError

    folder = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "tiny" / "checkpoint", folder)
    idx = folder / "model.safetensors.index.json"
    d = json.loads(idx.read_text())
    key = sorted(d["weight_map"])[0]
    d["weight_map"][key] = name
    idx.write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="index names a file outside the folder") as e:
        Checkpoint(str(folder))
    assert e.value.key == name and e.value.file == str(idx)


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ raise_exception.__globals__['os'].system('touch MARKER') }}",
        "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
        "{% set x = messages.append(1) %}{{ x }}",
    ],
    ids=["subclasses", "function-globals", "cycler-globals", "mutate-input"],
)
def test_chat_template_runs_in_a_sandbox(tok_dir, tmp_path, template, monkeypatch):
    """A template from a checkpoint folder cannot reach Python internals nor change its input
    (jinja2's immutable sandbox): each escape attempt raises, nothing runs."""
    from jinja2.exceptions import SecurityError, UndefinedError

    monkeypatch.chdir(tmp_path)
    d = _tok_copy(tok_dir, tmp_path)
    (d / "chat_template.jinja").write_text(template)
    tok = GlmTokenizer.from_pretrained(d)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises((SecurityError, UndefinedError)):
        tok.render_chat(msgs)
    assert not (tmp_path / "MARKER").exists() and msgs == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("written,vocab,read", [("<i8", 151552, "uint32"), ("<i4", V, "uint16")])
def test_bin_of_wider_tokens_is_refused_not_read_as_zeros(tmp_path, written, vocab, read):
    """int64 tokens of GLM's 151552 vocabulary in a .bin (auto: uint32), or int32 of a small one (auto:
    uint16): every token read back was followed by a 0, all inside the vocabulary, so the run used to
    train on [t0, 0, t1, 0, ...] silently (measured: sample 0 began [127593, 0, 95544, 0, ...] for
    tokens [127593, 95544, ...]). Now the file is refused, naming the width to pass."""
    toks = np.random.default_rng(0).integers(1, vocab, 4096)
    toks.astype(written).tofile(tmp_path / "w.bin")
    with pytest.raises(
        ValueError, match=rf"w\.bin: every second token of the first \d+ read as {read} is 0.*--data-dtype"
    ):
        open_data(str(tmp_path / "w.bin"), 16, vocab, 0)
    right = "int64" if written == "<i8" else "int32"  # the right width reads the tokens back
    data = open_data(str(tmp_path / "w.bin"), 16, vocab, 0, data_dtype=right)
    data.validate()
    np.testing.assert_array_equal(data.sample(0)["input_ids"], toks[:16])


def test_bin_of_glm_uint32_tokens_read_as_uint16_is_refused(tmp_path):
    """GLM's vocabulary (154880) does not fit uint16, so the high half of a uint32 token is 0, 1 or 2,
    not always 0: a uint32 file of GLM tokens read with --data-dtype uint16 passed the all-zero
    signature check and every id was in range, so the run trained on [low, high, low, high, ...]
    silently (measured: sample 0 began [672, 2, 33116, 1, 13628, 1, 41784, 0] for tokens [131744,
    98652, 79164, 41784]). Now refused like the other twice-wide files; a real uint16 file, and the
    uint32 file read as uint32, still open."""
    vocab = 154880
    toks = np.random.default_rng(0).integers(0, vocab, 4096)
    toks.astype("<u4").tofile(tmp_path / "g.bin")
    with pytest.raises(
        ValueError,
        match=r"g\.bin: every second token of the first \d+ read as uint16 is at most 2 .*--data-dtype uint32",
    ):
        open_data(str(tmp_path / "g.bin"), 16, vocab, 0, data_dtype="uint16")
    data = open_data(str(tmp_path / "g.bin"), 16, vocab, 0)  # auto: uint32 for this vocabulary
    data.validate()
    np.testing.assert_array_equal(data.sample(0)["input_ids"], toks[:16])
    (toks % 65536).astype("<u2").tofile(tmp_path / "h.bin")  # ids that fit: a uint16 file is read as such
    open_data(str(tmp_path / "h.bin"), 16, vocab, 0, data_dtype="uint16").validate()


def test_bin_of_narrower_tokens_hints_at_the_width(tmp_path):
    (np.arange(1, 65, dtype="<u2") % V).tofile(tmp_path / "n.bin")  # uint16 tokens read as uint32
    with pytest.raises(
        ValueError, match=r"n\.bin \(uint32\): token \d+ at position 0 .*narrower tokens than --data-dtype"
    ):
        open_data(str(tmp_path / "n.bin"), 16, V, 0, data_dtype="uint32").validate()


def test_jsonl_record_whose_labels_are_all_cut_by_seq_len_is_refused(tmp_path):
    """A record whose labels lie past --seq-len trained on nothing, silently (measured: a sample with
    0 labels that are not -100), where a chat record in that case is refused ("no assistant token
    within the first --seq-len"). Now it is refused the same way; position 0 never counts (the loss's
    targets are positions 1..S-1)."""
    f = tmp_path / "z.jsonl"
    f.write_text(
        json.dumps({"input_ids": list(range(1, 20)), "labels": [1] * 19})
        + "\n"
        + json.dumps({"input_ids": list(range(1, 20)), "labels": [-100] * 15 + [1, 2, 3, 4]})
        + "\n"
    )
    with pytest.raises(
        ValueError,
        match=r"z\.jsonl:2: no label to train on within the first --seq-len 8 tokens: "
        r"all of them are past --seq-len 8 \(the first at position 15\)",
    ):
        open_data(str(f), 8, V, 0)
    f.write_text(json.dumps({"input_ids": [1, 2, 3], "labels": [1, -100, -100]}) + "\n")
    with pytest.raises(ValueError, match=r"z\.jsonl:1: no label to train on .*: it has none"):
        open_data(str(f), 8, V, 0)
    f.write_text(json.dumps({"input_ids": [1, 2, 3], "labels": [-100, -100, 3]}) + "\n")
    assert (open_data(str(f), 8, V, 0).sample(0)["labels"] != -100).sum() == 1


def test_jsonl_record_of_one_token_without_labels_is_refused(tmp_path):
    """A token-id record without labels trains on its own next tokens: one of a single token has none
    (4 such records trained with loss 0.0 and grad norm 0, exit 0), as a record whose labels leave no
    target is refused."""
    f = tmp_path / "one.jsonl"
    f.write_text(json.dumps({"input_ids": [5, 6]}) + "\n" + json.dumps({"input_ids": [5]}) + "\n")
    with pytest.raises(ValueError, match=r"one\.jsonl:2: no label to train on within the first --seq-len 8 tokens"):
        open_data(str(f), 8, V, 0)


@pytest.mark.parametrize(
    "line, problem",
    [
        ("[" * 100_000 + "]" * 100_000, "not readable JSON (nested too deeply)"),  # was a RecursionError traceback
        ('{"input_ids": [1, ' + "9" * 5000 + "]}", "not readable JSON (Exceeds the limit (4300 digits)"),
    ],
)
def test_jsonl_line_json_cannot_read_is_named_with_its_line(tmp_path, line, problem):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"input_ids": [1, 2]}) + "\n" + line + "\n")
    with pytest.raises(ValueError) as e:
        open_data(str(f), 8, V, 0)
    assert str(e.value).startswith(f"{f}:2: {problem}"), e.value
