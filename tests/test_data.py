"""Text and chat .jsonl training data: tokenization, packing, the assistant-only label mask, and the
whole-file validation that `glm52 train` runs before any worker starts."""

import json

import numpy as np
import paddle
import pytest

from paddleformers_glm.cli import main
from paddleformers_glm.tiny import make_tiny_checkpoint, make_tiny_tokenizer
from paddleformers_glm.train.data import IGNORE_INDEX, open_data, prepare_jsonl

CHATS = [
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ],
    [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "Thank you!"},
        {"role": "assistant", "content": "You are welcome."},
    ],
]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def test_text_documents_are_joined_with_eos_and_packed(tmp_path):
    tok = make_tiny_tokenizer()
    docs = ["Hello world! How are you today?", "The sea is blue.", "Two plus two is four. " * 3]
    path = _jsonl(tmp_path / "t.jsonl", [{"text": d} for d in docs])
    info = prepare_jsonl(path, 16, 256, tok, str(tmp_path / "t.npz"))
    stream = []
    for d in docs:
        stream += tok.encode(d) + [tok.eos_token_id]
    n = len(stream) // 16
    assert info == {"kind": "text", "records": 3, "tokens": len(stream), "samples": n}
    data = open_data(str(tmp_path / "t.npz"), 16, 256, 0)
    assert data.num_samples == n
    got = np.concatenate([data.sample(i)["input_ids"] for i in range(n)])
    np.testing.assert_array_equal(got, stream[: n * 16])
    assert (got == tok.eos_token_id).sum() >= 2  # documents separated by EOS inside the windows
    s0 = data.sample(0)
    np.testing.assert_array_equal(s0["labels"], s0["input_ids"])
    assert s0["attention_mask"].all()


def test_chat_labels_are_the_assistant_tokens_only(tmp_path):
    tok = make_tiny_tokenizer()
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in CHATS])
    info = prepare_jsonl(path, 64, 256, tok, str(tmp_path / "c.npz"))
    assert info["kind"] == "messages" and info["samples"] == 2
    data = open_data(str(tmp_path / "c.npz"), 64, 256, 0)
    # the template's text, written out here: labels must cover exactly the assistant answers and the
    # <|endoftext|> closing each assistant turn
    expected_text = [
        "[gMASK]<sop><|system|>\nYou are a helpful assistant.<|user|>\nWhat is the capital of France?"
        "<|assistant|>\nParis.<|endoftext|>",
        "[gMASK]<sop><|user|>\nWhat is two plus two?<|assistant|>\nFour.<|endoftext|><|user|>\nThank you!"
        "<|assistant|>\nYou are welcome.<|endoftext|>",
    ]
    expected_answers = [["Paris.<|endoftext|>"], ["Four.<|endoftext|>", "You are welcome.<|endoftext|>"]]
    for i in range(2):
        s = data.sample(i)
        n = int(s["attention_mask"].sum())
        assert tok.decode(s["input_ids"][:n].tolist()) == expected_text[i]
        assert (s["input_ids"][n:] == tok.pad_token_id).all() and (s["labels"][n:] == IGNORE_INDEX).all()
        lab = s["labels"][:n]
        keep = lab != IGNORE_INDEX
        np.testing.assert_array_equal(lab[keep], s["input_ids"][:n][keep])  # labels are the tokens themselves
        runs, cur = [], []
        for t, k in zip(s["input_ids"][:n].tolist(), keep):
            if k:
                cur.append(t)
            elif cur:
                runs.append(tok.decode(cur))
                cur = []
        if cur:
            runs.append(tok.decode(cur))
        assert runs == expected_answers[i]


@pytest.mark.parametrize(
    "records,msg",
    [
        ([{"text": "Hello there."}, {"text": "Fine."}, {"text": " \n\t "}], r"t.jsonl:3: \"text\" must be a non-empty"),
        ([{"text": "Hello."}, {"messages": CHATS[0]}], r"t.jsonl:2: a \"messages\" record in a file of \"text\""),
        ([{"messages": CHATS[0]}, {"messages": [{"role": "user", "content": "Hi"}]}], r"t.jsonl:2: no assistant"),
        ([{"messages": CHATS[0]}, {"messages": [{"content": "Hi"}]}], r"t.jsonl:2: message 0 must be an object"),
        ([{"text": "Hello."}, {"foo": 1}], r"t.jsonl:2: expected an object with exactly one of"),
        ([{"text": "Hello."}], r"t.jsonl: \d+ tokens \(EOS included\) make 0 windows of --seq-len 64; 1 are needed"),
    ],
)
def test_bad_records_name_their_line(tmp_path, records, msg):
    path = _jsonl(tmp_path / "t.jsonl", records)
    with pytest.raises(ValueError, match=msg):
        prepare_jsonl(path, 64, 256, make_tiny_tokenizer(), str(tmp_path / "t.npz"))
    assert not (tmp_path / "t.npz").exists()


def test_token_id_records_are_checked_against_the_vocabulary_up_front(tmp_path):
    path = _jsonl(tmp_path / "ids.jsonl", [{"input_ids": [3, 4, 5]}, {"input_ids": [3, 256]}])
    with pytest.raises(ValueError, match=r"ids.jsonl:2: input_ids: token id 256 outside the vocabulary \[0, 256\)"):
        open_data(path, 8, 256, 0)
    ok = open_data(_jsonl(tmp_path / "ok.jsonl", [{"input_ids": [3, 4, 5]}]), 8, 256, 0)
    assert ok.sample(0)["input_ids"][:3].tolist() == [3, 4, 5]


def test_a_record_whose_only_label_lies_past_seq_len_is_refused(tmp_path):
    """A record is cut at --seq-len: a label only at position seq_len or later is cut off with it, and
    the sample would train nothing. Refused, saying where the label lies."""
    path = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [5, 6, 7, 8, 9], "labels": [IGNORE_INDEX] * 4 + [9]}])
    with pytest.raises(
        ValueError, match=r"d\.jsonl:1: no label to train on .* past --seq-len 4 \(the first at position 4\)"
    ):
        open_data(path, 4, 50, 0)
    open_data(path, 5, 50, 0)  # within --seq-len 5: trained


def test_labels_shorter_than_input_ids_are_refused(tmp_path):
    """One label per input token: shorter labels would be padded with -100, so the record's tail
    would train nothing, silently."""
    path = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [5, 6, 7, 8], "labels": [5, 6, 7]}])
    with pytest.raises(ValueError, match=r"d\.jsonl:1: labels has 3 entries, input_ids 4"):
        open_data(path, 4, 50, 0)


def test_train_on_chat_masks_non_assistant_tokens(tiny_dir, tmp_path):
    """`glm52 train --data chat.jsonl` on the tiny checkpoint: the first step's loss is the model's
    loss on the assistant tokens only (labels from the template), not on the whole conversation."""
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    out = tmp_path / "run"
    common = ["--model", tiny_dir, "--seq-len", "64", "--global-batch-size", "2", "--micro-batch-size", "2"]
    rc = main(["train", *common, "--data", path, "--steps", "1", "--out", str(out), "--no-progress", "--lr", "0"])
    assert rc == 0
    loss = json.loads((out / "loss.json").read_text())["losses"][0]

    tok = make_tiny_tokenizer()
    rows = [tok.encode_chat_for_training(m) for m in CHATS]
    S = max(len(ids) for ids, _ in rows)
    ids = np.zeros([2, S], np.int64)
    mask = np.zeros([2, S], np.int64)
    lab_asst = np.full([2, S], IGNORE_INDEX, np.int64)
    for b, (r, m) in enumerate(rows):
        ids[b, : len(r)], mask[b, : len(r)] = r, 1
        lab_asst[b, : len(r)] = np.where(m, r, IGNORE_INDEX)
    lab_all = np.where(mask == 1, ids, IGNORE_INDEX)
    model = GlmMoeDsaForCausalLM.from_pretrained(tiny_dir)
    t = paddle.to_tensor
    with paddle.no_grad():
        want = float(model(t(ids), attention_mask=t(mask), labels=t(lab_asst)).loss)
        whole = float(model(t(ids), attention_mask=t(mask), labels=t(lab_all)).loss)
    assert abs(loss - want) <= 1e-4 * max(1.0, abs(want)), (loss, want)
    assert abs(whole - want) > 1e-2  # the mask matters


def test_the_epoch_count_said_is_the_batches_an_epoch_holds(tiny_dir, tmp_path, capsys):
    """An epoch is n // G global batches (train/data.py): three conversations at a global batch of 2
    make one batch an epoch, so three steps read three epochs' orders (it said 2, steps x G / n)."""
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in (CHATS * 2)[:3]])
    common = ["--model", tiny_dir, "--seq-len", "64", "--global-batch-size", "2", "--micro-batch-size", "2"]
    args = ["train", *common, "--data", path, "--steps", "3", "--out", str(tmp_path / "run"), "--no-progress"]
    assert main([*args, "--lr", "0"]) == 0
    assert "the run reads 3 epochs" in capsys.readouterr().out


def test_train_reads_a_small_chat_file_in_epochs(tiny_dir, tmp_path, capsys):
    """Two conversations, a global batch of 2, three steps: the run goes over the data three times
    (each epoch in its own seeded order), as it does over every other source; at lr 0 each step's
    loss is the same two conversations' loss. Before: refused ("2 conversations; 6 are needed")."""
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    out = tmp_path / "run"
    common = ["--model", tiny_dir, "--seq-len", "64", "--global-batch-size", "2", "--micro-batch-size", "2"]
    assert (
        main(["train", *common, "--data", path, "--steps", "3", "--out", str(out), "--no-progress", "--lr", "0"]) == 0
    )
    assert "the run reads 3 epochs" in capsys.readouterr().out
    losses = json.loads((out / "loss.json").read_text())["losses"]
    assert len(losses) == 3 and max(losses) - min(losses) <= 1e-6 * abs(losses[0]), losses
    one = [{"messages": CHATS[0]}]
    assert main(["train", *common, "--data", _jsonl(tmp_path / "one.jsonl", one), "--out", str(out)]) == 2
    assert "1 conversations; 2 are needed for one global batch" in capsys.readouterr().err


def test_train_refuses_a_bad_record_before_launch(tiny_dir, tmp_path, capsys):
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": CHATS[0]}, {"messages": CHATS[1]}, {"messages": []}])
    out = tmp_path / "run"
    rc = main(["train", "--model", tiny_dir, "--data", path, "--steps", "1", "--tp", "2", "--out", str(out)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "chat.jsonl:3" in err and "non-empty list" in err
    assert not (out / "logs").exists() and not (out / "loss.json").exists()  # no worker was started


def test_chat_labels_follow_the_templates_generation_blocks(tmp_path):
    """A template with `{% generation %}` blocks (it used to stop prepare_jsonl with "unknown tag
    'generation'"): the labels are HF's assistant_masks (transformers 5.23, measured in
    tests/test_tokenizer.py) plus the <|endoftext|> this template leaves outside the block: it ends
    the turn and generation stops on it, so it is trained (as GLM's fine-tuning script trains the
    token after each assistant message; before, it was not, and nothing taught the model to stop)."""
    tok = make_tiny_tokenizer()
    tok.chat_template = (  # tests/test_tokenizer.py GEN_TEMPLATE: the answer in the block, <|endoftext|> outside
        "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}<|endoftext|>"
        "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in CHATS])
    prepare_jsonl(path, 64, 256, tok, str(tmp_path / "c.npz"))
    data = open_data(str(tmp_path / "c.npz"), 64, 256, 0)
    for i, answers in enumerate([["Paris.<|endoftext|>"], ["Four.<|endoftext|>", "You are welcome.<|endoftext|>"]]):
        s = data.sample(i)
        keep = s["labels"] != IGNORE_INDEX
        np.testing.assert_array_equal(s["labels"][keep], s["input_ids"][keep])
        got = [tok.decode(s["input_ids"][a:b].tolist()) for a, b in _true_runs(keep)]
        assert got == answers


def _true_runs(mask):
    """[start, end) of each run of True."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def test_a_chat_records_tools_reach_the_template(tmp_path):
    """A {"messages", "tools"} record (the tool-calling SFT format): the tools are the template's
    `tools`, as in HF's apply_chat_template(messages, tools=tools). They used to be dropped silently:
    the sample began "[gMASK]<sop><|user|>..." where transformers 5.23 renders the text below."""
    from paddleformers_glm.tiny import TINY_CHAT_TEMPLATE

    tok = make_tiny_tokenizer()
    tok.chat_template = "{% if tools %}<|system|>\nTools: {% for t in tools %}{{ t['name'] }} {% endfor %}{% endif %}"
    tok.chat_template += TINY_CHAT_TEMPLATE
    msgs = [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."}]
    tools = [{"name": "plus", "description": "add two numbers", "parameters": {"type": "object", "properties": {}}}]
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": msgs, "tools": tools}])
    prepare_jsonl(path, 64, 256, tok, str(tmp_path / "c.npz"))
    s = open_data(str(tmp_path / "c.npz"), 64, 256, 0).sample(0)
    n = int(s["attention_mask"].sum())
    assert tok.decode(s["input_ids"][:n].tolist()) == (
        "<|system|>\nTools: plus [gMASK]<sop><|user|>\nWhat is two plus two?<|assistant|>\nFour.<|endoftext|>"
    )
    keep = s["labels"] != IGNORE_INDEX
    assert tok.decode(s["input_ids"][keep].tolist()) == "Four.<|endoftext|>"
    path = _jsonl(tmp_path / "b.jsonl", [{"messages": msgs, "tools": "plus"}])
    with pytest.raises(ValueError, match=r'b\.jsonl:1: "tools" must be a list of objects'):
        prepare_jsonl(path, 64, 256, tok, str(tmp_path / "b.npz"))


def test_npz_samples_are_memory_mapped_not_loaded_whole_per_rank(tmp_path):
    """The .npz that text/chat data is tokenized into was loaded whole, as int64, by the launcher and
    again by every worker (each rank held the dataset three times over: input_ids, labels, mask).
    Measured before: 26.0 MiB traced peak and 24.2 MiB still held for this 24 MiB file; an 805 MB
    file took 7.6 s and +760 MB of anonymous memory per process to open. Now the uncompressed
    members are memory-mapped (as .npy / .bin streams are): the samples are the same, a compressed
    .npz is still read, and a damaged member still fails its CRC in validate."""
    import struct
    import tracemalloc
    import zipfile

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, (2048, 512))
    labels = np.where(rng.random(ids.shape) < 0.3, IGNORE_INDEX, ids)
    labels[-1, -1] = 10
    arrays = {"input_ids": ids, "labels": labels, "attention_mask": np.ones_like(ids)}
    np.savez(tmp_path / "p.npz", **arrays)
    tracemalloc.start()
    try:
        data = open_data(str(tmp_path / "p.npz"), 512, 1000, 0)
        data.validate()
        batch = data.global_batch(3, 8)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 6 << 20 and held < 1 << 20, (held, peak)  # the arrays are 24 MiB
    rows = [int(np.flatnonzero((ids == r).all(1))[0]) for r in batch["input_ids"]]
    for k, v in arrays.items():
        np.testing.assert_array_equal(batch[k], v[rows])
    np.savez_compressed(tmp_path / "c.npz", **arrays)
    np.testing.assert_array_equal(open_data(str(tmp_path / "c.npz"), 512, 1000, 0).sample(5)["labels"], labels[5])
    with zipfile.ZipFile(tmp_path / "p.npz") as zf:
        info = zf.getinfo("labels.npy")
    raw = bytearray((tmp_path / "p.npz").read_bytes())
    n_name, n_extra = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
    end = info.header_offset + 30 + n_name + n_extra + info.compress_size
    raw[end - 8] ^= 1  # the last label, 10, now 11: in range, only the CRC tells
    (tmp_path / "p.npz").write_bytes(bytes(raw))
    with pytest.raises(Exception, match="CRC"):
        open_data(str(tmp_path / "p.npz"), 512, 1000, 0).validate()


def test_token_id_jsonl_is_held_as_arrays_not_parsed_lists(tmp_path):
    """A .jsonl of input_ids records was parsed whole into Python lists (about 40 B a token) by the
    launcher and again by every rank, and kept so. Measured before: 2.05 M tokens +79 MB anonymous
    memory per process; this test's 0.5 M tokens 18.4 MiB (19319455 B) held after open_data. Now each record is
    parsed one line at a time and kept as int32 arrays: the same samples, at about 4 B a token."""
    import tracemalloc

    rng = np.random.default_rng(0)
    recs = [{"input_ids": rng.integers(0, 154880, 256).tolist()} for _ in range(2000)]
    recs[7]["labels"] = [IGNORE_INDEX] * 100 + recs[7]["input_ids"][100:]
    path = _jsonl(tmp_path / "r.jsonl", recs)
    tracemalloc.start()
    try:
        data = open_data(path, 128, 154880, 0, pad_id=3)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 6 * 256 * 2000, held
    assert data.num_samples == 2000
    np.testing.assert_array_equal(data.sample(0)["input_ids"], recs[0]["input_ids"][:128])
    np.testing.assert_array_equal(data.sample(7)["labels"], recs[7]["labels"][:128])
    np.testing.assert_array_equal(data.sample(8)["labels"], recs[8]["input_ids"][:128])


def test_prepared_text_npz_holds_narrow_tokens(tmp_path):
    """prepare_jsonl held the whole tokenized text as a Python list in the launcher and wrote int64
    input_ids, a copy as labels and an int64 mask: 24 B a token on disk (measured before: 24.0 B a
    token for this file, dtypes int64 x3; the launcher's traced peak for 3000 such documents 48.0 B a
    token, now 9.1). Now int32 ids and labels and an int8 mask, 9 B a token, the
    same samples (open_data converts them to int64)."""
    tok = make_tiny_tokenizer()
    docs = [f"Document {i}: the sea is blue and two plus two is four. " * 4 for i in range(300)]
    path = _jsonl(tmp_path / "t.jsonl", [{"text": d} for d in docs])
    info = prepare_jsonl(path, 32, 256, tok, str(tmp_path / "t.npz"))
    stream = [t for d in docs for t in tok.encode(d) + [tok.eos_token_id]]
    assert info == {"kind": "text", "records": 300, "tokens": len(stream), "samples": len(stream) // 32}
    with np.load(tmp_path / "t.npz") as z:
        assert {k: z[k].dtype.name for k in z.files} == {
            "input_ids": "int32",
            "labels": "int32",
            "attention_mask": "int8",
        }
    n_tok = info["samples"] * 32
    assert (tmp_path / "t.npz").stat().st_size < 10 * n_tok
    data = open_data(str(tmp_path / "t.npz"), 32, 256, 0)
    data.validate()
    got = np.concatenate([data.sample(i)["input_ids"] for i in range(data.num_samples)])
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, stream[:n_tok])


def test_prepared_chat_npz_peaks_near_its_stored_bytes(tmp_path):
    """The chat branch kept a list of per-record arrays and np.stack-ed them, and np.savez copied each
    array whole into the zip: a traced peak of 37.4 B a stored token for 4000 two-turn records at
    --seq-len 64 (docs/scale.md says 9 B a token are written). Now typed streams written in slices:
    measured 20.5 at 4000 records (the tokenizer's fixed share included), 11.6 at 12000."""
    import tracemalloc

    from tests.test_tokenizer import GLM_TEMPLATE, TWO_TURNS

    tok = make_tiny_tokenizer()
    tok.chat_template = GLM_TEMPLATE
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": TWO_TURNS}] * 4000)
    tracemalloc.start()
    try:
        info = prepare_jsonl(path, 64, 256, tok, str(tmp_path / "c.npz"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    per_token = peak / (info["samples"] * 64)
    assert per_token < 28, per_token
    with np.load(tmp_path / "c.npz") as z:
        assert {k: (z[k].dtype.name, z[k].shape) for k in z.files} == {
            "input_ids": ("int32", (4000, 64)),
            "labels": ("int32", (4000, 64)),
            "attention_mask": ("int8", (4000, 64)),
        }
        one = tmp_path / "one.jsonl"
        _jsonl(one, [{"messages": TWO_TURNS}])
        prepare_jsonl(str(one), 64, 256, tok, str(tmp_path / "one.npz"))
        with np.load(tmp_path / "one.npz") as o:  # every row the one record's
            for k in z.files:
                np.testing.assert_array_equal(z[k], np.repeat(o[k], 4000, axis=0))


def test_chat_turn_ends_survive_the_seq_len_cut(tmp_path):
    """GLM's template (tests/test_tokenizer.py GLM_TEMPLATE) with its stop tokens: the full record is
    trained as GLM's fine-tuning script trains it (the <|user|> after turn 1, an <|endoftext|> appended
    after turn 2); a --seq-len that cuts the record keeps the first S of those tokens and labels (the
    appended EOS or the closing <|user|> cut off with the rest), a longer one pads after the EOS."""
    from tests.test_tokenizer import GLM_STOPS, GLM_TEMPLATE, TWO_TURNS

    tok = make_tiny_tokenizer()
    tok.chat_template = GLM_TEMPLATE
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": TWO_TURNS}])
    rendered = tok.apply_chat_template(TWO_TURNS, return_dict=False)
    ids = rendered + [tok.eos_token_id]
    u, a = tok.token_to_id("<|user|>"), tok.token_to_id("<|assistant|>")
    first_a, second_u, second_a = ids.index(a), ids.index(u, 3), len(ids) - 1 - ids[::-1].index(a)
    labels = [-100] * len(ids)
    for t in [*range(first_a + 1, second_u + 1), *range(second_a + 1, len(ids))]:
        labels[t] = ids[t]  # "\nFour." <|user|>, "\nYou are welcome." <|endoftext|>
    for S in (len(ids) + 3, len(ids) - 1, second_u, second_u + 1):
        info = prepare_jsonl(path, S, 256, tok, str(tmp_path / "c.npz"), stop_ids=GLM_STOPS)
        s = open_data(str(tmp_path / "c.npz"), S, 256, 0).sample(0)
        n = min(S, len(ids))
        assert info["tokens"] == n and int(s["attention_mask"].sum()) == n
        assert s["input_ids"][:n].tolist() == ids[:n] and s["labels"][:n].tolist() == labels[:n], S
        assert (s["labels"][n:] == IGNORE_INDEX).all()
    assert labels[-1] == tok.eos_token_id and labels[second_u] == u


def test_a_conversation_trained_only_at_position_0_is_refused(tmp_path):
    """Position 0 is never a target (nothing comes before it to predict it). A conversation whose only
    assistant token within --seq-len is the first would be a sample with no target at all; GLM's
    template opens with [gMASK] <sop>, so this takes a template that starts with the assistant's text."""
    tok = make_tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    msgs = [{"role": "assistant", "content": "a"}, {"role": "user", "content": "Hello world, the sea is blue."}]
    ids, mine = tok.encode_chat_for_training(msgs)
    assert mine[0] and not any(mine[1:4]), (ids, mine)
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": msgs}])
    with pytest.raises(ValueError, match="no assistant token within the first --seq-len 4"):
        prepare_jsonl(path, 4, 256, tok, str(tmp_path / "o.npz"))


def test_train_reads_the_stop_tokens_of_the_checkpoint(tiny_dir, tmp_path):
    """`glm52 train` hands prepare_jsonl what generation stops on: the checkpoint's
    generation_config.json eos_token_id, else its config.json's (the tiny one: [1, 2]), and a
    --tokenizer folder's generation_config.json."""
    import shutil

    from paddleformers_glm.train.command import _stop_token_ids

    assert _stop_token_ids(tiny_dir, None) == [1, 2]
    ckpt = shutil.copytree(tiny_dir, tmp_path / "ckpt")
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2, 5]}))
    tok_dir = tmp_path / "tok"
    make_tiny_tokenizer().save_pretrained(tok_dir)
    assert _stop_token_ids(str(ckpt), str(tok_dir)) == [1, 2, 5]
    (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
    assert _stop_token_ids(str(ckpt), str(tok_dir)) == [1, 2, 5, 4]
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match="eos_token_id must be an int or a list of ints"):
        _stop_token_ids(str(ckpt), None)


def test_epoch_order_is_the_seeded_permutation_held_in_four_bytes_a_sample(tmp_path):
    """Each epoch's sample order is ``default_rng([seed, epoch]).permutation(num_samples)`` (the
    order a resumed run relies on: the data position of a checkpoint is its step), held by every
    rank. It was that int64 permutation: 8 B a sample (a 1 TB uint32 .bin at --seq-len 2048,
    1.2e8 samples: 915 MB per rank); now the same order shuffled in place in int32. Measured before
    on this test's 2,000,000 samples: 16.7 MB traced peak; now 8.9 MB (numpy's shuffle adds ~1 MB)."""
    import tracemalloc

    n, seq = 2_000_000, 2
    tokens = (np.arange(n * seq + 1) % 50).astype(np.uint16)
    tokens.tofile(tmp_path / "t.bin")
    data = open_data(str(tmp_path / "t.bin"), seq, 50, 7)
    assert data.num_samples == n
    tracemalloc.start()
    try:
        first = data.global_batch(0, 2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 6 * n, peak  # 4 B a sample and the batch; the int64 order alone is 8 B a sample
    for epoch in (0, 1):
        want = np.random.default_rng([7, epoch]).permutation(n)
        got = data.global_batch(epoch * n // 2, 2)["input_ids"]
        np.testing.assert_array_equal(got, np.stack([data.sample(int(k))["input_ids"] for k in want[:2]]))
    np.testing.assert_array_equal(first["input_ids"], data.global_batch(0, 2)["input_ids"])


def test_token_file_smaller_than_one_global_batch_is_refused(tmp_path, capsys):
    """A .npy of 2 samples, a global batch of 4 over dp 2: the batch repeated the 2 samples (the next
    epoch's order filled it), so both data-parallel ranks trained on the same rows, silently (before:
    rank 0 and rank 1 both got the windows starting with tokens [0, 8]). A text / chat .jsonl was
    already refused ("N are needed for one global batch"); every finite source now is, before launch,
    and a batch is never drawn from it (an epoch is n // G batches of distinct samples: none)."""
    from paddleformers_glm.train.data import check_batch_samples

    np.save(tmp_path / "small.npy", np.arange(20, dtype=np.int32))  # 2 windows of 8 (a tail of 4 unused)
    data = open_data(str(tmp_path / "small.npy"), 8, 64, 0)
    with pytest.raises(ValueError, match=r"small\.npy: 2 samples of --seq-len 8, fewer than one global batch of 4"):
        data.global_batch(0, 4)
    with pytest.raises(ValueError, match=r"small\.npy: 2 samples of --seq-len 8, fewer than one global batch of 4"):
        check_batch_samples(data, 4)
    check_batch_samples(data, 2)  # one batch of distinct samples: taken
    check_batch_samples(open_data(None, 8, 64, 0), 10**6)  # the synthetic stream is unbounded
    rows = "".join(json.dumps({"input_ids": [1, 2, 3]}) + "\n" for _ in range(3))
    (tmp_path / "ids.jsonl").write_text(rows)
    with pytest.raises(ValueError, match=r"ids\.jsonl: 3 samples of --seq-len 8, fewer than one global batch of 4"):
        check_batch_samples(open_data(str(tmp_path / "ids.jsonl"), 8, 64, 0), 4)
    args = ["train", "--model", "toy", "--seq-len", "8", "--global-batch-size", "4", "--dp", "2", "--steps", "1"]
    out = tmp_path / "run"
    assert main([*args, "--data", str(tmp_path / "small.npy"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fewer than one global batch of 4" in err[0], err
    assert not (out / "logs").exists()  # no worker was started


# A tokenizer's padding="max_length" output, dumped as token-id records: "abc" on the tiny tokenizer
# (74 75 76), pad id 0, right- and left-padded to 6.
PADDED = [
    {"input_ids": [74, 75, 76, 0, 0, 0], "attention_mask": [1, 1, 1, 0, 0, 0]},
    {"input_ids": [0, 0, 0, 74, 75, 76], "attention_mask": [0, 0, 0, 1, 1, 1]},
]
# transformers 5.23 DataCollatorForLanguageModeling(tokenizer, mlm=False) on those rows (measured on the
# tiny checkpoint's tokenizer): the attention_mask passes through and padding gets label -100
HF_COLLATED_LABELS = [[74, 75, 76, -100, -100, -100], [-100, -100, -100, 74, 75, 76]]


def test_token_id_records_keep_their_attention_mask(tmp_path, tiny_dir):
    """A token-id .jsonl record's `attention_mask` was ignored: its padding was attended and trained
    as targets (before: labels [74, 75, 76, 0, 0, 0] and mask all 1 for the right-padded row, the
    tiny model's loss 5.5153 where the unpadded "abc" gives 5.6078). Now padding (mask 0) is neither
    attended nor a target, as transformers' collator labels it (HF_COLLATED_LABELS, measured)."""
    path = _jsonl(tmp_path / "padded.jsonl", PADDED)
    data = open_data(path, 7, 256, 0)
    rows = [data.sample(i) for i in range(2)]
    assert [r["labels"][:6].tolist() for r in rows] == HF_COLLATED_LABELS
    assert [r["attention_mask"].tolist() for r in rows] == [[1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1, 0]]
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(tiny_dir)
    t = paddle.to_tensor
    with paddle.no_grad():
        row = {k: t(v[None]) for k, v in rows[0].items()}
        got = float(model(row["input_ids"], attention_mask=row["attention_mask"], labels=row["labels"]).loss)
        want = float(model(t(np.array([[74, 75, 76]])), labels=t(np.array([[74, 75, 76]]))).loss)
    assert abs(got - want) <= 1e-6 * abs(want), (got, want)  # right padding trains what the unpadded row does
    given = {"input_ids": [74, 75, 0], "attention_mask": [1, 1, 0], "labels": [74, 75, 9]}  # labels as given
    row = open_data(_jsonl(tmp_path / "given.jsonl", [given]), 4, 256, 0).sample(0)
    assert row["labels"].tolist() == [74, 75, 9, -100] and row["attention_mask"].tolist() == [1, 1, 0, 0]
    for bad, msg in (
        ({"input_ids": [1, 2], "attention_mask": [1, 2]}, "attention_mask: expected a list of 0 / 1"),
        ({"input_ids": [1, 2], "attention_mask": [1]}, "attention_mask has 1 entries, input_ids 2"),
        ({"input_ids": [1, 2, 0], "attention_mask": [1, 0, 0]}, "no label to train on"),
    ):
        with pytest.raises(ValueError, match=rf"bad\.jsonl:1: {msg}"):
            open_data(_jsonl(tmp_path / "bad.jsonl", [bad]), 8, 256, 0)


def test_padded_records_are_labelled_as_transformers_collator_does(tiny_dir):
    """The live twin of HF_COLLATED_LABELS: transformers' DataCollatorForLanguageModeling on PADDED."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    assert tok(["abc"])["input_ids"] == [[74, 75, 76]] and tok.pad_token_id == 0
    batch = transformers.DataCollatorForLanguageModeling(tok, mlm=False)([dict(r) for r in PADDED])
    assert batch["labels"].tolist() == HF_COLLATED_LABELS
    assert batch["attention_mask"].tolist() == [r["attention_mask"] for r in PADDED]


# valid JSON whose string holds half a surrogate pair (scraped text cut inside an emoji, written with
# ensure_ascii): it parses to a lone surrogate, which no tokenizer encodes
LONE_SURROGATE = b'{"text": "hello \\ud83d world"}\n'


def test_a_lone_surrogate_is_named_not_a_traceback(tiny_dir, tmp_path, capsys):
    """Before: `glm52 train` died with a traceback (TypeError: TextInputSequence must be str, exit 1),
    naming neither file nor line; transformers' tokenizer raises a TypeError on the same text
    (measured, test_a_lone_surrogate_is_refused_by_transformers_too). Now one line, exit 2."""
    (tmp_path / "t.jsonl").write_bytes(b'{"text": "fine"}\n' + LONE_SURROGATE)
    out = tmp_path / "run"
    args = ["train", "--model", tiny_dir, "--seq-len", "8", "--global-batch-size", "1", "--steps", "1"]
    assert main([*args, "--data", str(tmp_path / "t.jsonl"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 't.jsonl:2: "text" holds an unpaired surrogate \\ud83d at character 6' in err[0], err
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok \ud83d"}]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": chat}) + "\n")  # ensure_ascii writes the escape
    with pytest.raises(ValueError, match=r'c\.jsonl:1: "messages"\[1\]\.content holds an unpaired surrogate'):
        prepare_jsonl(str(tmp_path / "c.jsonl"), 16, 256, make_tiny_tokenizer(), str(tmp_path / "c.npz"))


def test_a_lone_surrogate_is_refused_by_transformers_too(tiny_dir):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    with pytest.raises(TypeError):
        tok(json.loads(LONE_SURROGATE)["text"])


def test_a_negative_seed_is_refused_before_launch(tmp_path, capsys):
    """`--seed -1` started the workers, which died in paddle.seed (TypeError, exit 1; the data order's
    numpy.random.default_rng([-1, 0]) raises "expected non-negative integer" too). Refused in one
    line before launch, exit 2; the largest seed both take, 2**64 - 1, is accepted."""
    from paddleformers_glm.train import TrainConfig

    out = tmp_path / "run"
    args = ["train", "--model", "toy", "--seq-len", "8", "--global-batch-size", "2", "--steps", "1", "--out", str(out)]
    assert main([*args, "--seed", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["glm52 train: error: --seed must be an integer in [0, 2**64), got -1"], err
    assert not (out / "logs").exists()  # no worker was started
    with pytest.raises(ValueError, match=r"--seed must be an integer in \[0, 2\*\*64\), got 18446744073709551616"):
        TrainConfig("toy", seed=2**64).validate()
    TrainConfig("toy", seed=2**64 - 1).validate()
    TrainConfig("toy", seed=np.int64(7)).validate()
    np.random.default_rng([2**64 - 1, 0])  # what the data order draws


def test_a_utf8_byte_order_mark_opening_the_file_is_skipped(tmp_path):
    """A .jsonl saved by a Windows editor opens with EF BB BF; before, its first line was refused
    ("t.jsonl:1: not JSON: Unexpected UTF-8 BOM"). It now reads as the same file without the mark
    (Python's "utf-8-sig"); a mark inside a later line is still not JSON."""
    rows = [{"text": "hello world"}, {"text": "abc def"}]
    plain = _jsonl(tmp_path / "plain.jsonl", rows)
    (tmp_path / "bom.jsonl").write_bytes(
        b"\xef\xbb\xbf" + (tmp_path / "plain.jsonl").read_bytes().replace(b"\n", b"\r\n")
    )
    tok = make_tiny_tokenizer()
    a = prepare_jsonl(plain, 8, 256, tok, str(tmp_path / "a.npz"))
    b = prepare_jsonl(str(tmp_path / "bom.jsonl"), 8, 256, tok, str(tmp_path / "b.npz"))
    assert a == b
    za, zb = np.load(tmp_path / "a.npz"), np.load(tmp_path / "b.npz")
    assert all(np.array_equal(za[k], zb[k]) for k in za.files)
    ids = [{"input_ids": [1, 2, 3]}]
    (tmp_path / "ids.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps(ids[0]).encode() + b"\n")
    assert open_data(str(tmp_path / "ids.jsonl"), 4, 64, 0).sample(0)["input_ids"].tolist() == [1, 2, 3, 0]
    (tmp_path / "late.jsonl").write_bytes(json.dumps(ids[0]).encode() + b"\n\xef\xbb\xbf" + json.dumps(ids[0]).encode())
    with pytest.raises(ValueError, match=r"late\.jsonl:2: not JSON"):
        open_data(str(tmp_path / "late.jsonl"), 4, 64, 0)


def test_labels_already_shifted_by_one_are_refused(tmp_path):
    """PaddleFormers' / Megatron's convention feeds input tokens[:-1] with labels tokens[1:] (labels[i]
    is position i's target); glm52 and transformers take labels aligned with the input and shift them
    in the loss (test_transformers_shifts_the_labels_in_the_loss), so such labels trained every
    position on the token two ahead, silently (before: the record and the .npz were taken). Refused
    naming the line / row; labels aligned with the input, with -100 anywhere, still pass, and so does
    a record with a single label equal to the next token (at least 2 such labels make a shift)."""
    tokens = [5, 9, 17, 4, 30, 11, 8, 21]
    shifted = {"input_ids": tokens[:-1], "labels": tokens[1:]}
    aligned = {"input_ids": tokens, "labels": [-100, -100, *tokens[2:]]}
    path = _jsonl(tmp_path / "ids.jsonl", [aligned, shifted])
    with pytest.raises(ValueError, match=r"ids\.jsonl:2: labels are input_ids shifted by one .* at all 6 labelled"):
        open_data(path, 16, 64, 0)
    # one repeated token, and a single label that happens to equal the next token: nothing proves a shift
    one_label = {"input_ids": [5, 6, 7], "labels": [-100, 7, -100]}
    ok = [aligned, {"input_ids": [3, 3, 3], "labels": [3, 3, 3]}, one_label]
    assert open_data(_jsonl(tmp_path / "ok.jsonl", ok), 16, 64, 0).num_samples == 3
    ids = np.array([tokens, tokens[1:] + [1]], dtype=np.int64)
    labels = ids.copy()
    labels[1, :-1] = ids[1, 1:]  # row 1 pre-shifted
    np.savez(tmp_path / "p.npz", input_ids=ids, labels=labels, attention_mask=np.ones_like(ids))
    with pytest.raises(ValueError, match=r"p\.npz: row 1: labels are input_ids shifted by one"):
        open_data(str(tmp_path / "p.npz"), 8, 64, 0).validate()
    np.savez(tmp_path / "q.npz", input_ids=ids, labels=ids, attention_mask=np.ones_like(ids))
    open_data(str(tmp_path / "q.npz"), 8, 64, 0).validate()


def test_transformers_shifts_the_labels_in_the_loss():
    """transformers 5.23 ForCausalLMLoss: position i is scored against labels[i + 1] (labels aligned
    with the input); measured here against a plain cross entropy."""
    torch = pytest.importorskip("torch")
    from transformers.loss.loss_utils import ForCausalLMLoss

    logits = torch.randn(1, 4, 11, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[3, 7, 1, 9]])
    want = torch.nn.functional.cross_entropy(logits[0, :3], labels[0, 1:])
    assert torch.allclose(ForCausalLMLoss(logits, labels, vocab_size=11), want)


# a GLM-like template that renders an assistant turn's tool calls (the tiny one prints content only)
TOOL_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}{{ tc.function.arguments | tojson }}"
    "</tool_call>{% endfor %}{% if m['role'] == 'assistant' %}<|endoftext|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# OpenAI's / transformers' tool-calling format: the assistant turn that calls a tool has content null
TOOL_CHAT = [
    {"role": "user", "content": "What is two plus two?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "plus", "arguments": {"a": 2, "b": 2}}}],
    },
    {"role": "tool", "content": "4"},
    {"role": "assistant", "content": "Four."},
]
# transformers 5.23 apply_chat_template(TOOL_CHAT, tokenize=False) with TOOL_TEMPLATE on the tiny
# checkpoint's tokenizer (measured; test_tool_call_chat_renders_as_transformers checks it live)
HF_TOOL_TEXT = (
    '[gMASK]<sop><|user|>\nWhat is two plus two?<|assistant|>\n<tool_call>plus{"a": 2, "b": 2}</tool_call>'
    "<|endoftext|><|tool|>\n4<|assistant|>\nFour.<|endoftext|>"
)


def test_a_tool_call_turn_with_null_content_is_trained(tmp_path):
    """Before: refused ('message 1 must be an object with string "role" and "content"'), so no
    tool-calling SFT data in OpenAI's format could be trained, where transformers' apply_chat_template
    renders it (HF_TOOL_TEXT). Now the sample is that text, and the trained tokens are what the
    assistant wrote (the tool call, the answer) and each turn's <|endoftext|>. A template that fails
    on a record (here: a field it reads is absent) is one error naming the line, not a traceback."""
    tok = make_tiny_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    path = _jsonl(tmp_path / "t.jsonl", [{"messages": TOOL_CHAT}])
    prepare_jsonl(path, 128, 256, tok, str(tmp_path / "t.npz"))
    s = open_data(str(tmp_path / "t.npz"), 128, 256, 0).sample(0)
    n = int(s["attention_mask"].sum())
    assert tok.decode(s["input_ids"][:n].tolist()) == HF_TOOL_TEXT
    keep = s["labels"] != IGNORE_INDEX
    got = [tok.decode(s["input_ids"][a:b].tolist()) for a, b in _true_runs(keep)]
    assert got == ['<tool_call>plus{"a": 2, "b": 2}</tool_call><|endoftext|>', "Four.<|endoftext|>"]
    bad = [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]
    with pytest.raises(ValueError, match=r'b\.jsonl:1: message 0: "content" must be a string, a list of parts or null, got int'):  # fmt: skip
        prepare_jsonl(_jsonl(tmp_path / "b.jsonl", [{"messages": bad}]), 128, 256, tok, str(tmp_path / "b.npz"))
    tok.chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content.strip() }}{% endfor %}"
    with pytest.raises(ValueError, match=r"t\.jsonl:1: the chat template fails on this record: UndefinedError"):
        prepare_jsonl(path, 128, 256, tok, str(tmp_path / "u.npz"))


def test_tool_call_chat_renders_as_transformers(tiny_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    hf.chat_template = TOOL_TEMPLATE
    assert hf.apply_chat_template(TOOL_CHAT, tokenize=False) == HF_TOOL_TEXT


# GLM's way with reasoning (its chat template): an assistant turn before the last user message is
# rendered with its reasoning dropped ("<think></think>"), the ones after it with theirs
GLM_THINK_TEMPLATE = (
    "[gMASK]<sop>{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}{% if m.role == 'user' %}"
    "<|user|>{{ m.content }}{% elif m.role == 'assistant' %}<|assistant|>{% generation %}"
    "{% if loop.index0 > ns.last and m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
    "{% else %}<think></think>{% endif %}{{ m.content }}{% endgeneration %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
THINK_CHAT = [
    {"role": "user", "content": "Two plus two?"},
    {"role": "assistant", "reasoning_content": "2+2=4", "content": "Four."},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "reasoning_content": "polite", "content": "Welcome."},
]
# transformers 5.23 apply_chat_template(THINK_CHAT, return_assistant_tokens_mask=True, return_dict=True)
# with GLM_THINK_TEMPLATE on the tiny tokenizer: the decoded tokens its assistant_masks marks (measured)
HF_THINK_MASKED = "<think></think>Four.<think>polite</think>Welcome."


def test_multi_turn_reasoning_needs_generation_blocks_and_says_so(tmp_path):
    """A multi-turn conversation with reasoning under a GLM-style template does not render prefix by
    prefix (the first answer's reasoning is dropped once a later user message follows), so without
    `{% generation %}` blocks its assistant tokens cannot be found: refused naming the line, and now
    saying what to do (before: no hint). With the blocks, the trained tokens are HF's assistant_masks
    (HF_THINK_MASKED) and the EOS that ends the conversation."""
    tok = make_tiny_tokenizer()
    tok.chat_template = GLM_THINK_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    path = _jsonl(tmp_path / "t.jsonl", [{"messages": THINK_CHAT}])
    with pytest.raises(ValueError, match=r"t\.jsonl:1: message 1: .* prefix by prefix .* with \{% generation %\}"):
        prepare_jsonl(path, 64, 256, tok, str(tmp_path / "a.npz"))
    tok.chat_template = GLM_THINK_TEMPLATE
    prepare_jsonl(path, 64, 256, tok, str(tmp_path / "b.npz"))
    s = open_data(str(tmp_path / "b.npz"), 64, 256, 0).sample(0)
    keep = s["labels"] != IGNORE_INDEX
    assert tok.decode(s["input_ids"][keep].tolist()) == HF_THINK_MASKED + "<|endoftext|>"


def test_multi_turn_reasoning_masks_as_transformers(tiny_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    hf.chat_template = GLM_THINK_TEMPLATE
    enc = hf.apply_chat_template(THINK_CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert hf.decode([t for t, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]) == HF_THINK_MASKED


@pytest.mark.parametrize(
    "record,msg",
    [
        (
            {"txt": "hi"},
            r"expected an object with exactly one of \"input_ids\", \"text\" or \"messages\", got an object with keys \['txt'\]",
        ),
        ([1, 2], r"expected an object with exactly one of .* got \[1, 2\]"),
        ({"text": 5}, r"\"text\" must be a non-empty string, got 5"),
        ({"text": None}, r"\"text\" must be a non-empty string, got null"),
        ({"text": True}, r"\"text\" must be a non-empty string, got true"),
        ({"messages": "hi"}, r"\"messages\" must be a non-empty list, got 'hi'"),
    ],
)
def test_a_bad_record_names_what_it_held(tmp_path, record, msg):
    """A bad record's error names the line, what was expected and what the record held (before: the
    expectation only, e.g. 't.jsonl:2: "text" must be a non-empty string' for {"text": 5})."""
    path = _jsonl(
        tmp_path / "t.jsonl", [{"messages": CHATS[0]} if "messages" in str(record) else {"text": "ok"}, record]
    )
    with pytest.raises(ValueError, match=r"t\.jsonl:2: " + msg):
        prepare_jsonl(path, 64, 256, make_tiny_tokenizer(), str(tmp_path / "t.npz"))


def test_a_bad_token_id_record_names_what_it_held(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", [{"input_ids": [1, 2]}, {"input_ids": "1 2 3"}])
    with pytest.raises(
        ValueError, match=r"t\.jsonl:2: expected an object with a non-empty list `input_ids`, got '1 2 3'"
    ):
        open_data(path, 8, 64, 0)


def test_conversations_cut_by_seq_len_are_counted_and_said(tiny_dir, tmp_path, capsys):
    """A conversation (or token-id record) longer than --seq-len (64 by default) is cut to it, and what is cut is not
    trained; this happened silently (before: the command printed the records, tokens and samples
    only). Now the summary counts them and the command says how many and the longest's length."""
    tok = make_tiny_tokenizer()
    lengths = [len(tok.encode_chat_for_training(m)[0]) for m in CHATS]
    S = min(lengths)  # the longer conversation is cut, the shorter is not (34 and 35 tokens)
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    info = prepare_jsonl(path, S, 256, tok, str(tmp_path / "c.npz"))
    assert (info["cut"], info["longest"]) == (1, max(lengths))
    out = tmp_path / "run"
    args = ["train", "--model", tiny_dir, "--seq-len", str(S), "--global-batch-size", "2", "--steps", "1"]
    assert main([*args, "--data", path, "--out", str(out), "--no-progress", "--lr", "0"]) == 0
    said = (
        f"1 of 2 conversations are longer than --seq-len {S} and were cut to it (the longest has {max(lengths)} tokens)"
    )
    assert said in capsys.readouterr().out
    # (no record shorter than --seq-len: the toy refuses padding, test_data_hostile.py)
    ids = _jsonl(tmp_path / "ids.jsonl", [{"input_ids": list(range(1, n + 1))} for n in (8, 12, 9)])
    toy = ["train", "--model", "toy", "--seq-len", "8", "--global-batch-size", "2", "--steps", "1", "--no-progress"]
    assert main([*toy, "--data", ids, "--out", str(tmp_path / "r2")]) == 0
    assert (
        "2 of 3 records are longer than --seq-len 8 and were cut to it (the longest has 12 tokens)"
        in capsys.readouterr().out
    )


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--eval-every", "2"], "--eval-every needs --eval-data (the held-out tokens to evaluate on)"),
        (["--eval-at-start"], "--eval-at-start needs --eval-data"),
        (["--steps", "0"], "--steps 0 trains nothing: it evaluates --eval-data only (give it, or --steps >= 1)"),
        (["--steps", "-1"], "--steps must be >= 0, got -1"),
        (["--eval-data", "{small}", "--eval-batches", "2"], "small.npy: 2 samples of --seq-len 8, fewer than "
         "--eval-batches 2 x --global-batch-size 2 = 4; use fewer --eval-batches or more data"),
        (["--eval-data", "{small}", "--eval-batches", "0"], "--eval-batches must be >= 1, got 0"),
        (["--eval-data", "{missing}"], "--eval-data: no file "),
        (["--eval-data", "{wide}"], "wide.npy: token 300 at position 0 is outside the vocabulary [0, 64)"),
        # before: evaluated, "losses 0.000000 over 0 tokens", exit 0
        (["--eval-data", "{bare}"], "bare.npz: row 0: no label to train on within the first --seq-len 8 tokens"),
    ],
)  # fmt: skip
def test_unusable_eval_data_is_one_line_before_launch(tmp_path, capsys, flags, needle):
    """--eval-data is checked as --data is, before any worker starts: one line, exit 2, nothing launched."""
    np.save(tmp_path / "small.npy", np.arange(20, dtype=np.int32))  # 2 windows of 8
    np.save(tmp_path / "wide.npy", np.full(40, 300, dtype=np.int32))  # outside the toy's vocabulary
    ids = np.ones((4, 8), dtype=np.int32)
    np.savez(tmp_path / "bare.npz", input_ids=ids, labels=np.full_like(ids, -100), attention_mask=ids)  # no target
    paths = {"small": tmp_path / "small.npy", "wide": tmp_path / "wide.npy", "missing": tmp_path / "none.npy"}
    paths["bare"] = tmp_path / "bare.npz"
    flags = [f.format(**paths) for f in flags]
    args = ["train", "--model", "toy", "--seq-len", "8", "--global-batch-size", "2", "--dp", "2", "--steps", "1"]
    out = tmp_path / "run"
    assert main([*args, *flags, "--out", str(out)]) == 2  # (a later --steps replaces the first)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (out / "logs").exists()


@pytest.mark.parametrize("key", ["loss_mask", "position_ids"])
def test_per_token_data_the_trainer_does_not_read_is_refused_not_dropped(tmp_path, key):
    """A token-id record or a .npz sample carrying one more entry per token (a Megatron-style
    ``loss_mask``, ``position_ids`` of documents packed in one row) trained as if it were not there:
    measured, tiny checkpoint, one step: loss 5.567415 with and without the loss mask (all 16 tokens
    trained; the same mask given as labels -100: 5.557776), and the two packed documents attended to
    each other, exit 0 and no word.  Each is refused naming the file, the record and the key;
    metadata that is not per token (an id, a source name) is still accepted."""
    ids = list(range(3, 19))
    extra = [1] * 8 + [0] * 8 if key == "loss_mask" else list(range(8)) * 2
    _jsonl(tmp_path / "d.jsonl", [{"input_ids": ids, "id": "doc-1"}, {"input_ids": ids, key: extra}])
    with pytest.raises(ValueError) as e:
        open_data(str(tmp_path / "d.jsonl"), 16, 256, seed=0)
    assert str(e.value).startswith(f"{tmp_path / 'd.jsonl'}:2: `{key}` is per-token data that is not read"), e
    assert "labels -100 where no target" in str(e.value)
    # one entry per label position (one less), or nested: refused by name all the same
    _jsonl(tmp_path / "d1.jsonl", [{"input_ids": ids, key: extra[:-1]}, {"input_ids": ids, key: [extra]}])
    with pytest.raises(ValueError, match=f":1: `{key}` is per-token data"):
        open_data(str(tmp_path / "d1.jsonl"), 16, 256, seed=0)
    # metadata, also a list of strings as long as a short record, and a tokenizer's token_type_ids: read as before
    ok = [{"input_ids": ids, "id": "doc-1", "source": "web", "token_type_ids": [0] * 16}, {"input_ids": [5, 6] * 8}]
    ok[1]["tags"] = ["news", "en"] * 8
    _jsonl(tmp_path / "ok.jsonl", ok)
    assert open_data(str(tmp_path / "ok.jsonl"), 16, 256, seed=0).num_samples == 2
    a = np.array([ids, ids], dtype=np.int32)
    np.savez(tmp_path / "d.npz", input_ids=a, labels=a, attention_mask=np.ones_like(a), **{key: np.array([extra] * 2)})
    with pytest.raises(ValueError) as e:
        open_data(str(tmp_path / "d.npz"), 16, 256, seed=0)
    assert str(e.value).startswith(f"{tmp_path / 'd.npz'}: arrays ['{key}'] are not read"), e


def test_per_token_numbers_under_any_key_are_refused_not_dropped(tmp_path):
    """Not only the known names (loss_mask, position_ids): any key holding one number per input token
    (per-token loss weights, say) would be dropped without a word, training every token at weight 1.
    Refused naming the line and the key."""
    path = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [5, 6, 7], "weights": [1.0, 0.5, 1.0]}])
    with pytest.raises(ValueError, match=r"d\.jsonl:1: `weights` is per-token data that is not read"):
        open_data(path, 4, 50, 0)
