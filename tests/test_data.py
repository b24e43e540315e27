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
        ([{"text": "Hello there."}, {"text": "Fine."}, {"text": "  "}], r"t.jsonl:3: \"text\" must be a non-empty"),
        ([{"text": "Hello."}, {"messages": CHATS[0]}], r"t.jsonl:2: a \"messages\" record in a file of \"text\""),
        ([{"messages": CHATS[0]}, {"messages": [{"role": "user", "content": "Hi"}]}], r"t.jsonl:2: no assistant"),
        ([{"messages": CHATS[0]}, {"messages": [{"role": "user"}]}], r"t.jsonl:2: message 0 must be an object"),
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
    tests/test_tokenizer.py), so the <|endoftext|> this template leaves outside the block is not trained."""
    tok = make_tiny_tokenizer()
    tok.chat_template = (  # tests/test_tokenizer.py GEN_TEMPLATE: the answer in the block, <|endoftext|> outside
        "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}<|endoftext|>"
        "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    path = _jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in CHATS])
    prepare_jsonl(path, 64, 256, tok, str(tmp_path / "c.npz"))
    data = open_data(str(tmp_path / "c.npz"), 64, 256, 0)
    for i, answers in enumerate([["Paris."], ["Four.", "You are welcome."]]):
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
