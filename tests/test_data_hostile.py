"""Training data given in ways that used to go wrong silently: a training and a held-out text file
tokenized onto one path, batches straddling an epoch boundary, a resume evaluating another held-out
set, empty or folder paths, padded data on the toy model, and errors that did not name their flag."""

import json
import zipfile

import numpy as np
import pytest

from paddleformers_glm.cli import main
from paddleformers_glm.tiny import make_tiny_checkpoint, make_tiny_tokenizer
from paddleformers_glm.train import data as data_module
from paddleformers_glm.train.data import check_eval_samples, check_token_range, micro_batches, open_data

TOY = ["train", "--model", "toy", "--seq-len", "8", "--global-batch-size", "4", "--no-progress"]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _one_line_refusal(capsys, out):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("glm52 train: error: "), err
    assert not out.exists()  # the --out folder the command made went with its refused input
    return err[0]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


# ---------------------------------------------------------------- 1. tokenized names that cannot collide
TRAIN_TEXT = ["The quick brown fox jumps over the lazy dog. " * 3, "Hello! How are you today? I am fine. " * 3] * 4
HELD_TEXT = ["Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. " * 3, "Punctuation: , . ; : ! ? ( ) [ ] { } " * 3] * 4


def test_training_and_held_out_text_never_share_a_tokenized_file(tiny_dir, tmp_path):
    """--data eval-x.jsonl and --eval-data x.jsonl were both tokenized to OUT/data/eval-x.seq16.npz:
    the training text replaced the held-out one and the "held-out" loss was the training text's
    (measured before: one file, its row 0 the training text's tokens). Now each lands on its own
    file, and the evaluation equals that of the same texts under names that never met."""
    d = tmp_path / "texts"
    d.mkdir()
    train, held = [{"text": t} for t in TRAIN_TEXT], [{"text": t} for t in HELD_TEXT]
    paths = {n: _jsonl(d / n, r) for n, r in (("eval-x.jsonl", train), ("x.jsonl", held))}
    paths |= {n: _jsonl(d / n, r) for n, r in (("a.jsonl", train), ("b.jsonl", held))}
    common = ["train", "--model", tiny_dir, "--seq-len", "16", "--global-batch-size", "4", "--steps", "1"]
    common += ["--lr", "0", "--eval-at-start", "--no-progress"]
    evals = {}
    for name, (data, ev) in {"collide": ("eval-x.jsonl", "x.jsonl"), "apart": ("a.jsonl", "b.jsonl")}.items():
        out = tmp_path / name
        assert main([*common, "--data", paths[data], "--eval-data", paths[ev], "--out", str(out)]) == 0
        evals[name] = json.loads((out / "loss.json").read_text())["eval"]
    files = sorted((tmp_path / "collide" / "data").iterdir())
    assert len(files) == 2, files
    tok = make_tiny_tokenizer()
    first = {f.name: np.load(f)["input_ids"][0].tolist() for f in files}
    want_held = tok.encode(HELD_TEXT[0], add_special_tokens=False)[:16]
    want_train = tok.encode(TRAIN_TEXT[0], add_special_tokens=False)[:16]
    assert sorted(first.values()) == sorted([want_held, want_train])
    assert evals["collide"] == evals["apart"]  # the held-out text's loss, whatever the files are called


# ---------------------------------------------------------------- 2. no sample twice in a batch
@pytest.mark.parametrize("n, G", [(5, 4), (7, 2), (10, 4), (11, 3), (8, 4), (12, 3), (6, 6)])
def test_every_global_batch_holds_distinct_samples_across_epochs(tmp_path, n, G):
    """A global batch straddling an epoch boundary drew from two permutations and could hold a sample
    twice (n 5, G 4: steps 1-3 each did, so data-parallel ranks trained on one row). Now an epoch is
    n // G batches of distinct samples, disjoint from each other; with G dividing n the order is the
    one drawn before (default_rng([seed, epoch]) shuffling arange(n), epoch after epoch)."""
    S, seed = 4, 11
    np.save(tmp_path / "t.npy", np.arange(n * S, dtype=np.int32))  # window i starts with token i * S
    data = open_data(str(tmp_path / "t.npy"), S, n * S, seed)
    per = n // G
    orders = []
    for epoch in range(3):
        order = np.arange(n)
        np.random.default_rng([seed, epoch]).shuffle(order)
        orders.append(order)
    for epoch in range(3):
        seen = []
        for b in range(per):
            step = epoch * per + b
            rows = (data.global_batch(step, G)["input_ids"][:, 0] // S).tolist()
            assert len(set(rows)) == G, (step, rows)
            if G % 2 == 0:  # two data-parallel ranks share no row
                halves = [micro_batches(data.global_batch(step, G), r, 2, 1) for r in range(2)]
                a, c = ({int(m["input_ids"][0, 0]) for m in h} for h in halves)
                assert not a & c
            seen += rows
        assert len(set(seen)) == per * G  # the epoch's batches are disjoint
        if n % G == 0:
            assert seen == orders[epoch].tolist()  # the order of a run before this change
    if n % G == 0:  # sample by sample over consecutive epochs, as drawn before
        flat = np.concatenate(orders)
        for step in range(3 * per):
            rows = (data.global_batch(step, G)["input_ids"][:, 0] // S).tolist()
            assert rows == flat[step * G : (step + 1) * G].tolist()


def test_synthetic_batch_s_is_samples_sG_to_sG_plus_G_all_distinct():
    """The module doc's contract for the unbounded (synthetic) source: global batch s is samples
    s*G .. s*G+G-1, so a resume at step s continues with the rows a run that never stopped would
    have read, and losses stay comparable with earlier runs and the torch reference. Its samples
    differ from each other: one repeated sample would train on a single row forever."""
    data = open_data(None, 16, 64, 3)
    rows = [data.sample(i)["input_ids"] for i in range(6)]
    assert len({r.tobytes() for r in rows}) == 6
    for step in (0, 1, 2):
        np.testing.assert_array_equal(data.global_batch(step, 2)["input_ids"], np.stack(rows[2 * step : 2 * step + 2]))


def test_evaluation_batches_are_the_files_rows_in_order_and_must_all_exist(tmp_path):
    """An evaluation's batch b is samples b*G .. b*G+G-1 unshuffled, so every evaluation (and every
    parallel layout) scores the same rows and the held-out losses of a run compare step to step. A
    held-out file too small for --eval-batches x --global-batch-size is refused before launch, not
    evaluated on fewer (or repeated) rows."""
    np.save(tmp_path / "t.npy", np.arange(8 * 4, dtype=np.int32))  # window i starts with token 4 * i
    data = open_data(str(tmp_path / "t.npy"), 4, 64, 0)
    for b in (0, 1, 3):
        assert (data.batch_in_order(b, 2)["input_ids"][:, 0] // 4).tolist() == [2 * b, 2 * b + 1]
    check_eval_samples(data, 4, 2)  # 8 samples: exactly enough
    with pytest.raises(ValueError, match=r"t\.npy: 8 samples of --seq-len 4, fewer than --eval-batches 3 x"):
        check_eval_samples(data, 3, 3)


def test_micro_batches_refuse_a_rank_share_the_micro_batch_does_not_divide():
    """A data-parallel rank's share (G / dp rows) must be a whole number of micro-batches: 3 rows in
    micro-batches of 2 would leave a short last micro-batch, a gradient step of another size.
    `glm52 train` checks the sizes first; a direct caller of micro_batches gets the same refusal."""
    with pytest.raises(ValueError, match="not divisible"):
        micro_batches({"input_ids": np.arange(6)[:, None]}, 0, 2, 2)


# ---------------------------------------------------------------- 3. a resume evaluating another set
@pytest.fixture()
def saved_run(tmp_path):
    """A toy run of 4 steps evaluating held-out set e1 every 2; its state after step 2 (and that step's
    evaluation) to resume from."""
    np.save(tmp_path / "train.npy", np.random.default_rng(0).integers(0, 64, 400).astype(np.int32))
    np.save(tmp_path / "e1.npy", np.arange(64, dtype=np.int32) % 64)
    np.save(tmp_path / "e2.npy", np.full(64, 7, dtype=np.int32))
    common = [*TOY, "--lr", "1e-3", "--data", str(tmp_path / "train.npy"), "--steps", "4", "--eval-every", "2"]
    out = tmp_path / "a"
    assert main([*common, "--save-every", "2", "--eval-data", str(tmp_path / "e1.npy"), "--out", str(out)]) == 0
    return tmp_path, common, str(out / "checkpoints" / "step_00000002")


def test_a_resume_evaluating_another_held_out_set_is_refused(saved_run, capsys):
    """Measured before: a resume with another --eval-data (or --eval-batches) was taken silently,
    loss.json "eval" mixed the records of two sets, and --eval-at-start was skipped ("the state
    holds step 2's evaluation", of the other set). Now one line naming the setting, saved vs now."""
    tmp, common, ckpt = saved_run
    resume = [*common, "--resume", ckpt, "--eval-at-start"]
    out = tmp / "b"
    assert main([*resume, "--eval-data", str(tmp / "e2.npy"), "--out", str(out)]) == 2
    line = _one_line_refusal(capsys, out)
    assert "eval-data saved 'other samples', now 'these'" in line and "--resume-override eval-data" in line, line
    assert main([*resume, "--eval-data", str(tmp / "e1.npy"), "--eval-batches", "2", "--out", str(out)]) == 2
    line = _one_line_refusal(capsys, out)
    assert "eval-batches saved 1, now 2" in line and "--resume-override eval-batches" in line, line


def test_a_resume_overriding_the_held_out_set_evaluates_it_afresh(saved_run):
    """--resume-override eval-data: the saved set's records leave loss.json "eval" (they are another
    set's) and --eval-at-start evaluates the resumed weights on the new set; its records equal those
    of a run resumed without the old set's state records at all (a run never evaluated before)."""
    tmp, common, ckpt = saved_run
    new = ["--resume", ckpt, "--eval-at-start", "--eval-data", str(tmp / "e2.npy")]
    assert main([*common, *new, "--resume-override", "eval-data", "--out", str(tmp / "b")]) == 0
    got = json.loads((tmp / "b" / "loss.json").read_text())["eval"]
    assert [r["step"] for r in got] == [2, 4], got
    # the same resume, with no evaluation before it: the state saved by a run without --eval-data
    plain = [c for c in common if c not in ("--eval-every", "2")] + ["--save-every", "2"]
    assert main([*plain, "--out", str(tmp / "p")]) == 0
    state = str(tmp / "p" / "checkpoints" / "step_00000002")
    again = ["--resume", state, "--eval-at-start", "--eval-data", str(tmp / "e2.npy")]
    assert main([*common, *again, "--out", str(tmp / "c")]) == 0
    assert json.loads((tmp / "c" / "loss.json").read_text())["eval"] == got


def test_a_state_saved_without_the_held_out_record_resumes_as_before(saved_run):
    tmp, common, ckpt = saved_run
    meta_path = tmp / "a" / "checkpoints" / "step_00000002" / "meta.json"  # (ckpt)
    meta = json.loads(meta_path.read_text())
    assert meta["eval"]["batches"] == 1  # what this version records
    del meta["eval"]
    meta_path.write_text(json.dumps(meta))
    new = ["--resume", ckpt, "--eval-data", str(tmp / "e2.npy"), "--eval-batches", "2"]
    assert main([*common, *new, "--out", str(tmp / "b")]) == 0


@pytest.mark.parametrize("which", ["middle", "last"])
def test_the_data_fingerprint_sees_an_edit_of_the_middle_or_the_last_sample(tmp_path, which):
    """A resume (and the check that every node read the same files) compares the data fingerprint,
    which hashes the sample count and the first, middle and last samples. A file edited only in its
    middle or last sample (same count, same first sample) must not pass as the saved run's data."""
    n, S = 9, 4
    a = np.arange(n * S, dtype=np.int32) % 50
    b = a.copy()
    i = n // 2 if which == "middle" else n - 1
    b[i * S] = (b[i * S] + 1) % 50
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    fingerprints = {open_data(str(tmp_path / f), S, 50, 0).fingerprint() for f in ("a.npy", "b.npy")}
    assert len(fingerprints) == 2


# ---------------------------------------------------------------- 4. / 5. empty and folder paths
@pytest.mark.parametrize("flag", ["--data", "--eval-data"])
def test_an_empty_data_path_is_refused_naming_its_flag(tmp_path, capsys, flag):
    """--data "" (an unset shell variable) trained on the synthetic stream; --eval-data "" ran no
    evaluation; both exit 0. Now one line naming the flag, exit 2."""
    out = tmp_path / "run"
    assert main([*TOY, "--steps", "1", flag, "", "--out", str(out)]) == 2
    line = _one_line_refusal(capsys, out)
    assert f"{flag}: an empty path" in line, line


@pytest.mark.parametrize("flag", ["--data", "--eval-data"])
@pytest.mark.parametrize("name", ["dir.jsonl", "dir.npy"])
def test_a_folder_named_like_data_is_one_line_and_leaves_no_out(tmp_path, capsys, flag, name):
    """A folder named *.jsonl raised a 20-line IsADirectoryError traceback (exit 1) and left --out behind."""
    folder = tmp_path / name
    folder.mkdir()
    out = tmp_path / "run"
    assert main([*TOY, "--steps", "1", flag, str(folder), "--out", str(out)]) == 2
    line = _one_line_refusal(capsys, out)
    assert f"{flag}: {folder} is a directory" in line, line


# ---------------------------------------------------------------- 6. the toy model and padding
PADDED = [[3, 3, 3, 10, 11, 12, 13, 14], [3, 3, 20, 21, 22, 23, 24, 25], [3, 30, 31, 32, 33, 34, 35, 36]]
PADDED += [[3, 3, 3, 3, 40, 41, 42, 43]]


def _left_padded(path):
    pads = [3, 2, 1, 4]
    return _jsonl(
        path, [{"input_ids": r, "attention_mask": [int(i >= p) for i in range(8)]} for r, p in zip(PADDED, pads)]
    )


def test_the_toy_refuses_padded_data_before_launch(tmp_path, capsys):
    """--model toy attends to every position and routes padding as tokens: left-padded rows trained to
    the same loss with the padding masked or not (measured before). Refused, naming --model toy."""
    data = _left_padded(tmp_path / "pad.jsonl")
    for flag in ("--data", "--eval-data"):
        out = tmp_path / "run"
        assert main([*TOY, "--steps", "1", flag, data, "--out", str(out)]) == 2
        line = _one_line_refusal(capsys, out)
        assert f"{flag} {data}: sample 0 holds padding (attention_mask 0)" in line, line
        assert "--model toy ignores attention_mask" in line and "GLM checkpoint" in line, line
    short = _jsonl(tmp_path / "short.jsonl", [{"input_ids": [1, 2, 3]}] + [{"input_ids": list(range(1, 9))}] * 3)
    assert main([*TOY, "--steps", "1", "--data", short, "--out", str(tmp_path / "run")]) == 2
    assert "short.jsonl: sample 0 holds padding" in _one_line_refusal(capsys, tmp_path / "run")
    full = _jsonl(tmp_path / "full.jsonl", [{"input_ids": r, "attention_mask": [1] * 8} for r in PADDED])
    assert main([*TOY, "--steps", "1", "--data", full, "--out", str(tmp_path / "ok")]) == 0  # unpadded: trained


def test_the_toy_stage_refuses_a_padded_batch(tmp_path):
    """run_training (no launch check) reaches the toy's forward: it refuses the batch, not trains on it."""
    from paddleformers_glm.train.loop import run_training
    from paddleformers_glm.train.settings import TrainConfig

    data = _left_padded(tmp_path / "pad.jsonl")
    cfg = TrainConfig(model="toy", steps=1, seq_len=8, global_batch_size=4, data=data, out=str(tmp_path / "o"))
    cfg.progress = False
    with pytest.raises(ValueError, match=r"attention_mask 0\): --model toy ignores attention_mask"):
        run_training(cfg)


def test_a_record_one_token_short_counts_as_padded(tmp_path):
    """A record one token shorter than --seq-len is padded to it: --model toy (which attends to and
    routes padding) must find it before launch, as it finds a record many tokens short."""
    p = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [5, 6, 7, 8]}, {"input_ids": [5, 6, 7]}])
    assert open_data(p, 4, 50, 0).first_padded() == 1
    assert (
        open_data(_jsonl(tmp_path / "full.jsonl", [{"input_ids": [5, 6, 7, 8]}] * 2), 4, 50, 0).first_padded() is None
    )


def test_a_padded_npz_row_is_named_by_its_row_across_scan_chunks(tmp_path, monkeypatch):
    """A .npz is scanned a chunk of rows at a time (16M tokens each): the padded row the refusal
    names is its row in the file, not its row within the chunk (shrunk here to 2 rows of 3)."""
    monkeypatch.setattr(data_module, "_SCAN_CHUNK", 6)
    ids = np.asarray([[1, 2, 3]] * 5, np.int32)
    mask = np.ones_like(ids, dtype=np.int8)
    mask[3, 2] = 0
    np.savez(tmp_path / "d.npz", input_ids=ids, labels=ids, attention_mask=mask)
    assert open_data(str(tmp_path / "d.npz"), 3, 50, 0).first_padded() == 3


# ---------------------------------------------------------------- 7. errors that name their flag
def test_a_bad_data_dtype_is_refused_for_every_source(tmp_path, capsys):
    """--data-dtype uint61 was refused for a .bin only: a .npy or synthetic run took it (exit 0)."""
    from paddleformers_glm.train.settings import TrainConfig

    np.save(tmp_path / "s.npy", np.arange(64, dtype=np.int32) % 64)
    for data in ([], ["--data", str(tmp_path / "s.npy")]):
        out = tmp_path / "run"
        assert main([*TOY, "--steps", "1", *data, "--data-dtype", "uint61", "--out", str(out)]) == 2
        line = _one_line_refusal(capsys, out)
        assert "--data-dtype must be one of auto, uint16, uint32, int32, int64, got 'uint61'" in line, line
    with pytest.raises(ValueError, match="--data-dtype must be one of"):
        TrainConfig(model="toy", data_dtype="uint61").validate()


@pytest.mark.parametrize("flag", ["--data", "--eval-data"])
def test_a_missing_jsonl_names_its_flag(tmp_path, capsys, flag):
    """A missing .jsonl was a bare "[Errno 2] No such file or directory" (a .npy: "--data: no file ...")."""
    out = tmp_path / "run"
    missing = tmp_path / "missing.jsonl"
    assert main([*TOY, "--steps", "1", flag, str(missing), "--out", str(out)]) == 2
    assert f"{flag}: no file {missing}" in _one_line_refusal(capsys, out)


def test_a_npz_of_another_seq_len_names_seq_len(tmp_path):
    """It said "expected arrays [N, 8], got [[33, 16], ...]", not that --seq-len differs from the file's."""
    ids = np.ones((5, 16), dtype=np.int32)
    np.savez(tmp_path / "p.npz", input_ids=ids, labels=ids, attention_mask=ids.astype(np.int8))
    with pytest.raises(ValueError, match=r"p\.npz: samples of 16 tokens, not --seq-len 8 .* or pass --seq-len 16"):
        open_data(str(tmp_path / "p.npz"), 8, 64, 0)
    np.savez(tmp_path / "q.npz", input_ids=ids, labels=ids[:, :8], attention_mask=ids.astype(np.int8))
    with pytest.raises(ValueError, match=r"q\.npz: expected arrays \[N, 16\] \(--seq-len 16\), got"):
        open_data(str(tmp_path / "q.npz"), 16, 64, 0)


def test_export_dtype_is_refused_where_it_would_do_nothing(tmp_path, capsys):
    """``--export-dtype bfloat16`` without ``--export``, or with ``--model toy`` (which exports its
    own float32 format), exited 0 having done nothing of what it asked."""
    from paddleformers_glm.train.settings import TrainConfig

    out = tmp_path / "run"
    assert main([*TOY, "--steps", "1", "--export-dtype", "bfloat16", "--out", str(out)]) == 2
    assert "--export-dtype bfloat16 sets the dtype of --export" in _one_line_refusal(capsys, out)
    assert main([*TOY, "--steps", "1", "--export", "--export-dtype", "bfloat16", "--out", str(out)]) == 2
    assert "--model toy exports its own float32 format" in _one_line_refusal(capsys, out)
    TrainConfig(model="toy", export=True, export_dtype="float32").validate()  # what it writes: taken
    TrainConfig(model="glm", model_args={"model_dir": "x"}, export=True, export_dtype="auto").validate()


# ---------------------------------------------------------------- 8. damaged and out-of-range data, before launch
def _npz(path, ids, labels, mask):
    np.savez(
        path,
        input_ids=np.asarray(ids, np.int32),
        labels=np.asarray(labels, np.int32),
        attention_mask=np.asarray(mask, np.int8),
    )
    return str(path)


def _member_data_offset(path, name):
    """Where member ``name``'s stored bytes start in the zip file ``path``."""
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(name)
    raw = open(path, "rb").read(info.header_offset + 30)
    n_name, n_extra = int.from_bytes(raw[-4:-2], "little"), int.from_bytes(raw[-2:], "little")
    return info.header_offset + 30 + n_name + n_extra


def _flip(path, offset, mask):
    raw = bytearray(open(path, "rb").read())
    raw[offset] ^= mask
    open(path, "wb").write(bytes(raw))


def test_a_npz_with_a_damaged_member_header_is_one_error_naming_the_file(tmp_path):
    """One flipped byte in a member's .npy header: the memory-mapped reader cannot parse it and the
    file is read whole by np.load, whose zip reader raised zipfile.BadZipFile ("Bad CRC-32 for file
    'input_ids.npy'", measured before): no ValueError, so `glm52 train` ended in a traceback. Now
    one error names the file and the member."""
    p = _npz(tmp_path / "d.npz", [[1, 2, 3]] * 2, [[1, 2, 3]] * 2, [[1, 1, 1]] * 2)
    _flip(p, _member_data_offset(p, "input_ids.npy") + 20, 0x20)
    with pytest.raises(ValueError, match=r"d\.npz: member input_ids: expected a readable \.npy array, got a damaged"):
        open_data(p, 3, 50, 0)


def test_a_damaged_compressed_npz_is_one_error_naming_the_file(tmp_path, capsys):
    """np.savez_compressed data with one damaged byte: np.load raised zlib.error ("Error -3 while
    decompressing data", measured before), a traceback from `glm52 train`. Now one error names the
    file and the member, and the command refuses it in one line before launch."""
    a = np.arange(64, dtype=np.int32).reshape(8, 8) % 50
    p = str(tmp_path / "c.npz")
    np.savez_compressed(p, input_ids=a, labels=a, attention_mask=np.ones((8, 8), np.int8))
    _flip(p, _member_data_offset(p, "input_ids.npy") + 20, 0xFF)  # inside the deflate stream
    with pytest.raises(ValueError, match=r"c\.npz: member input_ids: expected a readable \.npy array"):
        open_data(p, 8, 50, 0)
    out = tmp_path / "run"
    assert main([*TOY, "--steps", "1", "--data", p, "--out", str(out)]) == 2
    assert "c.npz: member input_ids" in _one_line_refusal(capsys, out)


def test_an_intact_npz_numpy_will_not_read_and_an_npz_named_npy_are_one_error_naming_the_file(tmp_path, capsys):
    """A ragged (object) member is never unpickled: numpy's refusal names neither the file nor the
    member, and it is no damage, so it is passed on with both named and not called damaged. A .npz
    archive saved under a .npy name (np.load reads by content) ended `glm52 train` in an
    AttributeError traceback (measured before); refused in one line, saying what it is."""
    ragged = np.empty(2, dtype=object)
    ragged[:] = [[1, 2, 3], [4, 5]]
    ids = np.array([[1, 2, 3]] * 2, np.int32)
    p = str(tmp_path / "o.npz")
    np.savez_compressed(p, input_ids=ragged, labels=ids, attention_mask=ids)
    with pytest.raises(ValueError, match=r"o\.npz: member input_ids: Object arrays cannot be loaded") as e:
        open_data(p, 3, 50, 0)
    assert "damaged" not in str(e.value)
    archive = tmp_path / "a.npy"
    np.savez(tmp_path / "a.npz", input_ids=np.arange(100))
    archive.write_bytes((tmp_path / "a.npz").read_bytes())
    out = tmp_path / "run"
    assert main([*TOY, "--steps", "1", "--data", str(archive), "--out", str(out)]) == 2
    assert "a.npy: expected a .npy array, got a .npz archive (name it .npz)" in _one_line_refusal(capsys, out)


def test_a_token_equal_to_the_vocabulary_size_is_out_of_range(monkeypatch):
    """Ids run 0 .. vocab_size - 1: a token equal to vocab_size would index one row past the
    embedding, so the pre-launch scan refuses it and names its position; vocab_size - 1 passes.
    The scan reads a file a chunk at a time (16M tokens): a bad id in a later chunk is caught
    before launch too, not when its batch is drawn mid-run (the chunk is shrunk here to 4)."""
    with pytest.raises(ValueError, match="token 50 at position 1"):
        check_token_range(np.array([3, 50, 2]), 50, "x")
    check_token_range(np.array([0, 49]), 50, "x")
    monkeypatch.setattr(data_module, "_SCAN_CHUNK", 4)
    with pytest.raises(ValueError, match="position 9"):
        check_token_range(np.array([1] * 9 + [99] + [1] * 3), 50, "x")


def test_npz_validate_refuses_labels_outside_the_vocabulary_and_a_mask_not_0_or_1(tmp_path):
    """The pre-launch check of a .npz covers its labels (an out-of-range target crashes or trains
    garbage in the cross-entropy mid-run) and its attention_mask (a 2 would pass into the mask)."""
    p = _npz(tmp_path / "l.npz", [[1, 2, 3]], [[1, 2, 99]], [[1, 1, 1]])
    with pytest.raises(ValueError, match="labels: token 99"):
        open_data(p, 3, 50, 0).validate()
    p = _npz(tmp_path / "m.npz", [[1, 2, 3]], [[1, 2, 3]], [[1, 2, 1]])
    with pytest.raises(ValueError, match="other than 0 and 1"):
        open_data(p, 3, 50, 0).validate()
    open_data(_npz(tmp_path / "ok.npz", [[1, 2, 3]], [[-100, 2, 49]], [[1, 1, 0]]), 3, 50, 0).validate()


def test_bin_token_width_at_the_uint16_boundary(tmp_path):
    """--data-dtype auto reads a .bin as uint16 up to a vocabulary of 65536 (ids 0 .. 65535 fit):
    at exactly 65536 a uint16 file read as uint32 would give half the tokens, garbage ids. A uint32
    file of small ids read as uint16 (every other token 0) is refused, naming --data-dtype uint32,
    not trained on interleaved high halves."""
    (np.arange(64, dtype=np.uint16) * 1000).tofile(tmp_path / "t.bin")
    data = open_data(str(tmp_path / "t.bin"), 4, 65536, 0)
    assert "uint16" in data.describe and data.num_samples == 16
    np.arange(1, 65, dtype=np.uint32).tofile(tmp_path / "w.bin")
    with pytest.raises(ValueError, match="--data-dtype uint32"):
        open_data(str(tmp_path / "w.bin"), 4, 1000, 0)
