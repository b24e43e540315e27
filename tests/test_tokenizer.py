"""The checkpoint tokenizer: loading, the tiny BPE tokenizer, the chat template and its assistant mask,
and `glm52 generate`."""

import json
from pathlib import Path

import numpy as np
import paddle
import pytest

from paddleformers_glm.cli import main
from paddleformers_glm.tiny import (
    TINY_CHAT_TEMPLATE,
    TINY_SPECIAL_TOKENS,
    make_tiny_checkpoint,
    make_tiny_tokenizer,
    tiny_config,
)
from paddleformers_glm.tokenizer import GlmTokenizer, TokenizerError

CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And two plus two?"},
    {"role": "assistant", "content": "Four."},
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def _hf_and_ours(folder):
    """transformers' AutoTokenizer and ours on ``folder`` (skips without the reference extra)."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(folder), GlmTokenizer.from_pretrained(folder)


def test_tiny_tokenizer_is_deterministic_and_fits_the_config():
    a, b = make_tiny_tokenizer(), make_tiny_tokenizer()
    assert a.tokenizer.to_str() == b.tokenizer.to_str()
    cfg = tiny_config()
    assert a.vocab_size == cfg.vocab_size == 256
    assert a.pad_token_id == cfg.pad_token_id == 0
    assert a.eos_token_id in cfg.eos_token_id
    assert a.token_to_id("<|user|>") in cfg.eos_token_id  # GLM stops on a new user turn too


def test_encode_decode_round_trip():
    tok = make_tiny_tokenizer()
    text = "Hello world! The sea is blue.\nNumbers: 42, 7; (x + y) = z?"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) < len(text)  # merges learned
    assert tok.decode(ids) == text
    assert tok.token_to_id("<|unk|>") not in ids


def test_from_pretrained_reads_the_folder(tiny_dir, tmp_path):
    tok = GlmTokenizer.from_pretrained(tiny_dir)
    assert tok.encode("Hello there") == make_tiny_tokenizer().encode("Hello there")
    assert tok.chat_template == TINY_CHAT_TEMPLATE
    cfg = json.loads((Path(tiny_dir) / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|endoftext|>"
    # chat_template.jinja, as newer exports write it, wins over the config's template
    folder = tmp_path / "tpl"
    tok.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert GlmTokenizer.from_pretrained(folder).apply_chat_template(CHAT[:2], tokenize=False) == (
        "[You are a helpful assistant.][What is the capital of France?]"
    )


def test_bad_folders_are_named(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        GlmTokenizer.from_pretrained(tmp_path)
    make_tiny_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        GlmTokenizer.from_pretrained(tmp_path)


def test_chat_template_text():
    tok = make_tiny_tokenizer()
    text = tok.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert text == (
        "[gMASK]<sop><|system|>\nYou are a helpful assistant.<|user|>\nWhat is the capital of France?<|assistant|>\n"
    )
    assert tok.apply_chat_template(CHAT[:2], add_generation_prompt=True)["input_ids"] == tok.encode(text)
    assert tok.apply_chat_template(CHAT[:2], add_generation_prompt=True, return_dict=False) == tok.encode(text)


def test_assistant_mask_covers_exactly_the_assistant_turns():
    tok = make_tiny_tokenizer()
    ids, mask = tok.encode_chat_for_training(CHAT)
    assert len(ids) == len(mask)
    assert ids == tok.apply_chat_template(CHAT, return_dict=False)
    # the masked tokens, read back: each assistant answer and the <|endoftext|> that closes its turn
    assert _runs(tok, ids, mask) == ["The capital of France is Paris.<|endoftext|>", "Four.<|endoftext|>"]
    # and nothing of the prompt side: the role tokens are all outside the mask
    role_ids = {tok.token_to_id(t) for t in ("<|system|>", "<|user|>", "<|assistant|>", "[gMASK]", "<sop>")}
    assert not any(m and i in role_ids for i, m in zip(ids, mask))


def test_template_that_is_not_prefix_stable_is_refused():
    tok = make_tiny_tokenizer()
    tok.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(TokenizerError, match="message 2"):
        tok.encode_chat_for_training(CHAT[:3])


@pytest.mark.reference
def test_hf_fast_tokenizer_reads_the_same_files(tiny_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(tiny_dir)
    ours = GlmTokenizer.from_pretrained(tiny_dir)
    text = "Hello! What is the capital of France?"
    assert hf.encode(text, add_special_tokens=False) == ours.encode(text)
    assert hf.apply_chat_template(CHAT, tokenize=False) == ours.apply_chat_template(CHAT, tokenize=False)


def test_generate_command_streams_the_greedy_text(tiny_dir, capsys):
    prompt = "What is the capital of France?"
    assert main(["generate", "--model", tiny_dir, "--prompt", prompt, "--chat", "--max-new-tokens", "6"]) == 0
    printed = capsys.readouterr().out
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    tok = GlmTokenizer.from_pretrained(tiny_dir)
    model = GlmMoeDsaForCausalLM.from_pretrained(tiny_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=False)
    out = model.generate(paddle.to_tensor([ids]), max_new_tokens=6, eos_token_id=[1, 2]).numpy()[0, len(ids) :]
    out = out[: np.argmax(np.isin(out, [1, 2])) + 1] if np.isin(out, [1, 2]).any() else out
    assert printed == tok.decode(out.tolist(), skip_special_tokens=True) + "\n"


def test_generate_command_without_tokenizer_fails_cleanly(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_dict()))
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "tokenizer.json" in err and len(err.strip().splitlines()) == 1


def test_generate_command_speculative_prints_the_same_text(tiny_dir, capsys):
    args = ["generate", "--model", tiny_dir, "--prompt", "Hello there", "--max-new-tokens", "5"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--speculative"]) == 0
    cap = capsys.readouterr()
    assert cap.out == plain
    assert "acceptance rate" in cap.err


def test_generate_command_speculative_takes_the_checkpoint_lengths_and_every_option(tiny_dir, tmp_path, capsys):
    """--speculative generates as many tokens as the plain command (generation_config.json's
    max_new_tokens: before, the default 20 instead of the file's 3) and, as it runs generate's own
    loop with the MTP layer drafting, honours every option the plain command does: the same text
    with a repetition penalty, a stop string or seeded sampling (before: refused, exit 2)."""
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    args = ["generate", "--model", str(folder), "--prompt", "Hello there"]
    for extra in ([], ["--repetition-penalty", "3.0"], ["--stop", "e"], ["--do-sample", "--seed", "4", "--top-k", "5"]):
        assert main([*args, *extra]) == 0
        plain = capsys.readouterr().out
        assert main([*args, *extra, "--speculative"]) == 0
        cap = capsys.readouterr()
        assert cap.out == plain and "main forwards" in cap.err, extra


def test_generate_command_runs_the_beam_search_of_its_generation_config(tiny_dir, tmp_path, capsys):
    """generation_config.json's num_beams > 1: the command prints the text of the model's beam
    search (which has no stream: printed at its end). Before: refused (beam search unsupported)."""
    import shutil

    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"num_beams": 3, "max_new_tokens": 5}))
    assert main(["generate", "--model", str(folder), "--prompt", "Hello there", "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out
    tok = GlmTokenizer.from_pretrained(str(folder))
    model = GlmMoeDsaForCausalLM.from_pretrained(folder, dtype="float32")
    ids = tok.encode("Hello there", add_special_tokens=False)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    out = model.generate(paddle.to_tensor([ids]), num_beams=3, max_new_tokens=5, eos_token_id=eos).numpy()
    greedy = model.generate(paddle.to_tensor([ids]), num_beams=1, max_new_tokens=5, eos_token_id=eos).numpy()
    assert printed == tok.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True) + "\n"
    assert out.tolist() != greedy.tolist()  # the beam search's own text, not the greedy one
    # --num-beams (before: no such flag) over a checkpoint without num_beams; 1 over one with it
    args = ["generate", "--model", tiny_dir, "--prompt", "Hello there", "--max-new-tokens", "5"]
    assert main([*args, "--num-beams", "3"]) == 0 and capsys.readouterr().out == printed
    assert main([*args, "--model", str(folder), "--num-beams", "1"]) == 0
    assert capsys.readouterr().out == tok.decode(greedy[0, len(ids) :].tolist(), skip_special_tokens=True) + "\n"
    assert main([*args, "--num-beams", "0"]) == 2
    assert "--num-beams must be >= 1, got 0" in capsys.readouterr().err
    # a stop string ends beam continuations, as transformers' stopping criteria do (refused before)
    assert main([*args, "--num-beams", "2", "--stop", "e"]) == 0
    stopped = model.generate(paddle.to_tensor([ids]), num_beams=2, max_new_tokens=5, eos_token_id=eos,
                             stop_strings=["e"], tokenizer=tok).numpy()  # fmt: skip
    assert capsys.readouterr().out == tok.decode(stopped[0, len(ids) :].tolist(), skip_special_tokens=True) + "\n"


def test_generate_command_streams_characters_split_across_byte_tokens(tiny_dir, tmp_path, capsys, monkeypatch):
    """A byte-level BPE (as GLM's tokenizer is) splits an emoji or a rare character over several
    tokens; decoding the tokens so far then ends in U+FFFD until the character is complete. The
    streamed text is the decoded text whatever the split (before: the first partial character
    was printed as U+FFFD and nothing after it, since no later text started with it: measured
    '\ufffd' for 'é🙂a, done')."""
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from paddleformers_glm import generation

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(["hello"], trainers.BpeTrainer(vocab_size=256, initial_alphabet=alphabet))
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, folder)
    (folder / "tokenizer.json").write_text(bpe.to_str())  # ids < 256: the tiny model's vocabulary
    text = "é🙂a, done"
    ids = bpe.encode(text).ids
    assert bpe.decode(ids[:1]).endswith("\ufffd") and len(ids) > len(text)

    cut = next(k for k in range(len(ids), 0, -1) if bpe.decode(ids[:k]).endswith("\ufffd"))
    for stream_ids in (ids, ids[:cut]):  # the whole text; one ending inside a character (flushed as is)

        def fake_generate(model, prompt, *, streamer, _ids=stream_ids, **kwargs):  # streams these ids
            for i in _ids:
                streamer(np.asarray([i]))

        monkeypatch.setattr(generation, "generate", fake_generate)
        assert main(["generate", "--model", str(folder), "--prompt", "hello"]) == 0
        assert capsys.readouterr().out == bpe.decode(stream_ids) + "\n"


# ---------------------------------------------------------------------- the transformers-style call
TEXTS = ["Hello there", "The capital of France is Paris.", "Two plus two is four. Thank you for reading this text."]


@pytest.mark.parametrize("side", ["left", "right"])
def test_batch_call_pads_with_a_mask_and_decodes_back(side):
    tok = make_tiny_tokenizer()
    alone = [tok.encode(t) for t in TEXTS]
    enc = tok(TEXTS, padding=True, return_tensors="np", padding_side=side)
    ids, mask = enc["input_ids"], enc.attention_mask
    S = max(len(a) for a in alone)
    assert ids.shape == mask.shape == (3, S) and ids.dtype == np.int64
    for row, m, a in zip(ids, mask, alone):
        assert m.sum() == len(a)
        real = row[m == 1].tolist()
        assert real == a
        assert (row[m == 0] == tok.pad_token_id).all()
        pads = np.flatnonzero(m == 0)
        if len(pads):  # the padding sits on the asked side
            assert (pads < len(row) - len(a)).all() if side == "left" else (pads >= len(a)).all()
    assert tok.batch_decode(ids, skip_special_tokens=True) == TEXTS
    pd = tok(TEXTS, padding="longest", return_tensors="pd", padding_side=side)
    assert isinstance(pd["input_ids"], paddle.Tensor) and (pd["input_ids"].numpy() == ids).all()


def test_single_text_gives_lists_or_a_one_row_tensor():
    tok = make_tiny_tokenizer()
    enc = tok("Hello there")
    assert enc["input_ids"] == tok.encode("Hello there") and enc["attention_mask"] == [1] * len(enc["input_ids"])
    assert list(tok("Hello there", return_tensors="pd")["input_ids"].shape) == [1, len(enc["input_ids"])]


def test_truncation_and_max_length_padding():
    tok = make_tiny_tokenizer()
    full = tok.encode(TEXTS[2])
    assert tok(TEXTS[2], truncation=True, max_length=4)["input_ids"] == full[:4]
    tok.truncation_side = "left"
    assert tok(TEXTS[2], truncation=True, max_length=4)["input_ids"] == full[-4:]
    enc = tok(TEXTS[:2], padding="max_length", max_length=20, return_tensors="np")
    assert enc["input_ids"].shape == (2, 20)
    assert tok(TEXTS[:1], padding=True, pad_to_multiple_of=8)["input_ids"][0][-1] == tok.pad_token_id
    with pytest.raises(ValueError, match="different lengths"):
        tok(TEXTS, return_tensors="np")
    with pytest.raises(ValueError, match="return_tensors"):
        tok(TEXTS, padding=True, return_tensors="pt2")


def test_pad_for_data_collators():
    tok = make_tiny_tokenizer()
    feats = [{"input_ids": tok.encode(t)} for t in TEXTS[:2]]
    out = tok.pad(feats, return_tensors="np", padding_side="left")
    assert out["input_ids"].shape[0] == 2 and out["attention_mask"][0].sum() == len(feats[0]["input_ids"])


# transformers 5.23 tokenizer.pad(..., return_tensors="pt") on features whose labels differ in length
# (measured on the tiny checkpoint): ValueError "... Perhaps your features (`labels` in this case) have
# excessive nesting ..."; without return_tensors both pass the labels through unpadded
HF_PAD_RAGGED_LABELS = "Perhaps your features (`labels` in this case)"


def test_pad_names_a_ragged_key_it_does_not_pad():
    """Before: "pad: rows of different lengths ([1, 3]) cannot form one tensor; pass padding=True" --
    padding was already on, and the rows at fault (labels, which pad leaves alone, as transformers'
    does: HF_PAD_RAGGED_LABELS) were not named."""
    tok = make_tiny_tokenizer()
    feats = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    assert tok.pad([dict(f) for f in feats])["labels"] == [[5, 6, 7], [8]]  # passed through, as transformers
    with pytest.raises(ValueError, match=r"pad: 'labels' rows have different lengths \(\[1, 3\]\)"):
        tok.pad([dict(f) for f in feats], return_tensors="np")
    out = tok.pad(
        [{"input_ids": [5, 6, 7], "labels": [1, 2, 3]}, {"input_ids": [8], "labels": [4, 5, 6]}], return_tensors="np"
    )
    assert out["labels"].tolist() == [[1, 2, 3], [4, 5, 6]] and out["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]


# what transformers 5.23's tokenizer.pad returns for keys it does not pad (measured on the tiny
# checkpoint): the values as given, converted as given with return_tensors
_PASSED_FEATURES = [
    {"input_ids": [5, 6, 7], "label": 1, "score": 0.5, "weights": [0.5, 0.5, 1.0], "name": "abc"},
    {"input_ids": [8], "label": 0, "score": 1.5, "weights": [0.25], "name": "d"},
]


def test_pad_passes_the_keys_it_does_not_pad_through_as_given():
    """transformers' pad leaves every key but input_ids, attention_mask, token_type_ids and
    special_tokens_mask as given (a label per row, float weights, strings, offsets): measured,
    label [1, 0] (np shape (2,)), score [0.5, 1.5], weights [[0.5, 0.5, 1.0], [0.25]], name ['abc', 'd'].
    Before: every key went through int(): labels [[1], [0]], weights cut to [[0, 0, 1], [0]], a float
    label or a string a TypeError / ValueError."""
    tok = make_tiny_tokenizer()
    out = tok.pad([dict(f) for f in _PASSED_FEATURES])
    assert out["label"] == [1, 0] and out["score"] == [0.5, 1.5] and out["name"] == ["abc", "d"]
    assert out["weights"] == [[0.5, 0.5, 1.0], [0.25]] and out["input_ids"] == [[5, 6, 7], [8, 0, 0]]
    arr = tok.pad([{k: f[k] for k in ("input_ids", "label", "score")} for f in _PASSED_FEATURES], return_tensors="np")
    assert arr["label"].shape == (2,) and arr["score"].dtype.kind == "f" and arr["score"].tolist() == [0.5, 1.5]
    enc = tok(TEXTS[:2], return_offsets_mapping=True)
    padded = tok.pad(enc)
    assert padded["offset_mapping"] == enc["offset_mapping"]


@pytest.mark.reference
def test_pad_passes_the_keys_it_does_not_pad_through_as_transformers(tiny_dir):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    want = hf.pad([dict(f) for f in _PASSED_FEATURES])
    got = GlmTokenizer.from_pretrained(tiny_dir).pad([dict(f) for f in _PASSED_FEATURES])
    assert {k: list(v) for k, v in got.items()} == {k: list(v) for k, v in want.items()}


def test_pad_of_ragged_labels_as_transformers(tiny_dir):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    feats = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    with pytest.raises(ValueError) as e:
        hf.pad(feats, return_tensors="pt")
    assert HF_PAD_RAGGED_LABELS in str(e.value)


def test_chat_template_batch_with_tensors():
    tok = make_tiny_tokenizer()
    convs = [CHAT[:2], [{"role": "user", "content": "Hi"}]]
    enc = tok.apply_chat_template(convs, add_generation_prompt=True, padding=True, return_tensors="pd")
    texts = tok.apply_chat_template(convs, add_generation_prompt=True, tokenize=False)
    assert len(texts) == 2 and list(enc["input_ids"].shape)[0] == 2
    assert tok.batch_decode(enc["input_ids"].numpy()[1][enc["attention_mask"].numpy()[1] == 1][None]) == [texts[1]]
    one = tok.apply_chat_template(CHAT[:2], add_generation_prompt=True, return_tensors="np", return_dict=False)
    assert one.shape == (1, len(tok.encode(texts[0])))


def test_left_padded_batch_generates_what_each_prompt_generates_alone(tiny_dir):
    """A batch of texts -> left-padded tensors -> generate -> text: each row as that prompt alone."""
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    tok = GlmTokenizer.from_pretrained(tiny_dir, padding_side="left")
    model = GlmMoeDsaForCausalLM.from_pretrained(tiny_dir)
    enc = tok(TEXTS, padding=True, return_tensors="pd")
    out = model.generate(**enc, max_new_tokens=5, eos_token_id=[])
    S = enc["input_ids"].shape[1]
    texts = tok.batch_decode(out[:, S:])
    for t, got in zip(TEXTS, texts):
        ids = paddle.to_tensor([tok.encode(t)])
        alone = model.generate(ids, max_new_tokens=5, eos_token_id=[])
        assert got == tok.decode(alone[0, ids.shape[1] :])


@pytest.mark.reference
@pytest.mark.parametrize("side", ["left", "right"])
def test_call_equals_transformers_fast_tokenizer(tiny_dir, side):
    """The same files through transformers' PreTrainedTokenizerFast: ids, masks, truncation, chat."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(tiny_dir, padding_side=side)
    ours = GlmTokenizer.from_pretrained(tiny_dir, padding_side=side)
    for kw in ({"padding": True}, {"padding": "max_length", "max_length": 24}, {"truncation": True, "max_length": 5}):
        a = hf(TEXTS, return_tensors="np", **kw) if "padding" in kw else hf(TEXTS, **kw)
        b = ours(TEXTS, return_tensors="np", **kw) if "padding" in kw else ours(TEXTS, **kw)
        for key in ("input_ids", "attention_mask"):
            np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))
    conv = [CHAT[:2], CHAT[:4]]
    a = hf.apply_chat_template(conv, padding=True, return_tensors="np")
    b = ours.apply_chat_template(conv, padding=True, return_tensors="np")
    for key in ("input_ids", "attention_mask"):
        np.testing.assert_array_equal(a[key], b[key])
    assert hf.batch_decode(a["input_ids"]) == ours.batch_decode(b["input_ids"])


# `{% generation %}` blocks mark what HF's apply_chat_template(..., return_assistant_tokens_mask=True)
# trains on. GEN_TEMPLATE: the answer in the block, the <|endoftext|> closing the turn outside it;
# GEN_STRADDLE: a block that starts inside the word "Paris", so the token "is" straddles its start.
GEN_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}<|endoftext|>"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
GEN_STRADDLE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}Pari{% generation %}{{ m['content'] }}<|endoftext|>"
    "{% endgeneration %}{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{% endif %}{% endfor %}"
)
GEN_CHAT = [  # a system turn, an empty answer, an answer that is not last, a conversation ending on a user turn
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "Thank you!"},
    {"role": "assistant", "content": ""},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hello! How are you today?"},
    {"role": "user", "content": "Fine."},
]
# (template, chat, runs of HF's assistant_masks, runs encode_chat_for_training trains): the latter add
# the stop token that follows a turn when the turn holds none (GEN_TEMPLATE's <|endoftext|>, after the
# empty answer too), as GLM's fine-tuning script trains the token after each assistant message
GEN_CASES = [
    (
        GEN_TEMPLATE,
        GEN_CHAT,
        ["Four.", "Hello! How are you today?"],
        ["Four.<|endoftext|>", "<|endoftext|>", "Hello! How are you today?<|endoftext|>"],
    ),
    (
        GEN_STRADDLE,
        [{"role": "user", "content": "The capital of France?"}, {"role": "assistant", "content": "s."}],
        ["is.<|endoftext|>"],
        ["is.<|endoftext|>"],
    ),
]


def _runs(tok, ids, mask):
    """The decoded runs of consecutive masked tokens."""
    pieces, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            pieces.append(tok.decode(cur))
            cur = []
    return pieces + ([tok.decode(cur)] if cur else [])


@pytest.mark.parametrize("template,chat,answers,trained", GEN_CASES)
def test_generation_blocks_are_the_assistant_mask(template, chat, answers, trained):
    """A template with `{% generation %}` blocks renders (it used to be a syntax error: "unknown tag
    'generation'"); its assistant_masks are HF's: measured with transformers 5.23, the runs
    ``answers`` (no <|endoftext|> where the template leaves it outside the block; the token "is"
    that straddles a block's start is marked). Training takes those plus each turn's closing stop token."""
    tok = make_tiny_tokenizer()
    tok.chat_template = template
    hf_mask = tok.apply_chat_template(chat, return_assistant_tokens_mask=True)["assistant_masks"]
    ids, mask = tok.encode_chat_for_training(chat)
    assert ids == tok.apply_chat_template(chat, return_dict=False)
    assert _runs(tok, ids, hf_mask) == answers
    assert _runs(tok, ids, mask) == trained


@pytest.mark.reference
@pytest.mark.parametrize("template,chat,answers,trained", GEN_CASES)
def test_generation_mask_equals_hf_assistant_masks(tiny_dir, template, chat, answers, trained):
    """Ours and HF's assistant_masks agree; the training mask is that plus exactly the <|endoftext|>
    tokens a block leaves outside (each closes an assistant turn in these templates)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(tiny_dir)
    hf.chat_template = template
    want = hf.apply_chat_template(chat, return_dict=True, return_assistant_tokens_mask=True)
    tok = GlmTokenizer.from_pretrained(tiny_dir)
    tok.chat_template = template
    ours = tok.apply_chat_template(chat, return_assistant_tokens_mask=True)
    assert ours["assistant_masks"] == want["assistant_masks"]
    ids, mask = tok.encode_chat_for_training(chat)
    assert ids == want["input_ids"]
    eos_outside = [i == tok.eos_token_id and not m for i, m in zip(ids, want["assistant_masks"])]
    assert [int(m) for m in mask] == [int(m or e) for m, e in zip(want["assistant_masks"], eos_outside)]


# GLM's own chat template renders no end of an assistant turn: the next message's role token follows it
# (a stop token of its generation_config.json: <|endoftext|>, <|user|>, <|observation|>), or nothing.
# GLM_TEMPLATE is its shape on the tiny tokenizer (GLM-4's: "<|role|>\ncontent", generation prompt
# "<|assistant|>"). GLM's fine-tuning script (THUDM/GLM-4 finetune_demo/finetune.py, process_batch)
# masks each assistant message's tokens, appends the tokenizer's EOS to the conversation and shifts the
# mask one token right: it trains the "\n" and the answer after <|assistant|> and the token after them.
GLM_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
GLM_STOPS = [1, 2, 5]  # <|endoftext|>, <|user|>, <|observation|>, as GLM's generation_config.json lists them
TWO_TURNS = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "Thank you!"},
    {"role": "assistant", "content": "You are welcome."},
]


def _glm_labels(tok, pieces):
    """(ids, labels) from (text or special token, trained) pieces, each tokenized alone."""
    ids, labels = [], []
    for text, trained in pieces:
        piece = [tok.token_to_id(text)] if text.startswith(("<|", "[gMASK]", "<sop>")) else tok.encode(text)
        ids += piece
        labels += piece if trained else [-100] * len(piece)
    return ids, labels


@pytest.mark.parametrize(
    "chat,pieces",
    [
        (  # turn 1 closed by the <|user|> that follows it, turn 2 by an appended <|endoftext|>
            TWO_TURNS,
            [("[gMASK]", 0), ("<sop>", 0), ("<|user|>", 0), ("\nWhat is two plus two?", 0), ("<|assistant|>", 0)]
            + [("\nFour.", 1), ("<|user|>", 1), ("\nThank you!", 0), ("<|assistant|>", 0)]
            + [("\nYou are welcome.", 1), ("<|endoftext|>", 1)],
        ),
        (  # a tool call closed by the <|observation|> of the tool's answer
            [
                {"role": "user", "content": "What is two plus two?"},
                {"role": "assistant", "content": "plus(2, 2)"},
                {"role": "observation", "content": "4"},
                {"role": "assistant", "content": "Four."},
            ],
            [("[gMASK]", 0), ("<sop>", 0), ("<|user|>", 0), ("\nWhat is two plus two?", 0), ("<|assistant|>", 0)]
            + [("\nplus(2, 2)", 1), ("<|observation|>", 1), ("\n4", 0), ("<|assistant|>", 0)]
            + [("\nFour.", 1), ("<|endoftext|>", 1)],
        ),
        (  # a conversation that ends with a user message: nothing appended after it
            TWO_TURNS[:3],
            [("[gMASK]", 0), ("<sop>", 0), ("<|user|>", 0), ("\nWhat is two plus two?", 0), ("<|assistant|>", 0)]
            + [("\nFour.", 1), ("<|user|>", 1), ("\nThank you!", 0)],
        ),
    ],
)
def test_glm_template_trains_the_stop_token_ending_each_assistant_turn(chat, pieces):
    """The labels GLM's fine-tuning script gives (built here by hand from its rule, see GLM_TEMPLATE).
    Before, only the answers were trained ("\nFour.", "\nYou are welcome."): no stop token at all,
    so a model tuned on them never learnt to end its turn."""
    tok = make_tiny_tokenizer()
    tok.chat_template = GLM_TEMPLATE
    want_ids, want_labels = _glm_labels(tok, pieces)
    ids, mine = tok.encode_chat_for_training(chat, stop_ids=GLM_STOPS)
    assert ids == want_ids
    assert [i if m else -100 for i, m in zip(ids, mine)] == want_labels
    rendered = tok.apply_chat_template(chat, return_dict=False)
    assert ids[: len(rendered)] == rendered and ids[len(rendered) :] == want_ids[len(rendered) :]


def test_a_token_that_follows_a_turn_is_trained_only_when_generation_stops_on_it():
    """Two assistant messages in a row: the <|assistant|> between them is no stop token, so it stays
    untrained; <|user|> without GLM's stop list (the tokenizer's EOS alone) is not trained either."""
    tok = make_tiny_tokenizer()
    tok.chat_template = GLM_TEMPLATE
    chat = [TWO_TURNS[0], {"role": "assistant", "content": "Four."}, {"role": "assistant", "content": "Yes."}]
    ids, mine = tok.encode_chat_for_training(chat, stop_ids=GLM_STOPS)
    assert _runs(tok, ids, mine) == ["\nFour.", "\nYes.<|endoftext|>"]
    ids, mine = tok.encode_chat_for_training(TWO_TURNS)
    assert _runs(tok, ids, mine) == ["\nFour.", "\nYou are welcome.<|endoftext|>"]


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_GEN = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize(
    "template,runs",
    [
        (CHATML, ["Four.<|im_end|>\n", "You are welcome.<|im_end|>\n"]),
        (CHATML_GEN, ["Four.<|im_end|>", "You are welcome.<|im_end|>"]),
    ],
)
def test_a_template_that_closes_its_turns_with_a_stop_token_gets_nothing_more(template, runs):
    """ChatML ends each turn with <|im_end|> (a stop token: Qwen's generation_config.json lists it)
    inside the assistant's span or block: the labels are what they were, the assistant's span (the
    runs below), nothing appended after the last turn."""
    tok = make_tiny_tokenizer()
    tok.tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.chat_template = template
    im_end = tok.token_to_id("<|im_end|>")
    ids, mine = tok.encode_chat_for_training(TWO_TURNS, stop_ids=[im_end])
    assert ids == tok.apply_chat_template(TWO_TURNS, return_dict=False)
    assert _runs(tok, ids, mine) == runs


# HF's jinja environment: jinja's loop controls, strftime_now, and a template's final newline dropped
# (keep_trailing_newline False); the rendered text of each, measured with transformers 5.23
ENV_CASES = [
    ("{% for m in messages %}{% if loop.index0 > 0 %}{% break %}{% endif %}{{ m['content'] }}{% endfor %}", "Hi"),
    ("{{ strftime_now('%Y') | length }}{{ messages[0]['content'] }}", "4Hi"),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}{{ eos_token }}\n", "HiFour.<|endoftext|>"),
]


@pytest.mark.parametrize("template,text", ENV_CASES)
def test_template_environment_is_hfs(template, text):
    tok = make_tiny_tokenizer()
    tok.chat_template = template
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Four."}]
    assert tok.apply_chat_template(chat, tokenize=False) == text


@pytest.mark.reference
@pytest.mark.parametrize("template,text", ENV_CASES)
def test_template_environment_renders_as_hf(tiny_dir, template, text):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(tiny_dir)
    hf.chat_template = template
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Four."}]
    assert hf.apply_chat_template(chat, tokenize=False) == text


def test_save_pretrained_keeps_the_padding_and_length_settings(tiny_dir, tmp_path):
    """transformers 5.23 ``AutoTokenizer.from_pretrained(d, padding_side="left", model_max_length=64)
    .save_pretrained(out)`` writes ``padding_side: "left"`` and ``model_max_length: 64`` (measured), so
    the saved tokenizer pads and truncates as the one in use did. Ours wrote the file's config back
    unchanged (measured: padding_side absent, model_max_length 4096): a reload padded on the right."""
    tok = GlmTokenizer.from_pretrained(tiny_dir, padding_side="left", truncation_side="left", model_max_length=64)
    tok.save_pretrained(tmp_path / "a")
    back = GlmTokenizer.from_pretrained(tmp_path / "a")
    assert (back.padding_side, back.truncation_side, back.model_max_length) == ("left", "left", 64)
    cfg = json.loads((tmp_path / "a" / "tokenizer_config.json").read_text())
    assert (cfg["padding_side"], cfg["truncation_side"], cfg["model_max_length"]) == ("left", "left", 64)
    # unchanged settings write the file's config as it was (no key added)
    GlmTokenizer.from_pretrained(tiny_dir).save_pretrained(tmp_path / "b")
    assert (tmp_path / "b" / "tokenizer_config.json").read_text() == (
        Path(tiny_dir) / "tokenizer_config.json"
    ).read_text()


# ---------------------------------------------------------------------- tokenizer.json's own settings
def _with_post_processor(tok, single):
    """The tiny tokenizer with a TemplateProcessing post-processor (``single``, e.g. "[gMASK] <sop> $A")."""
    from tokenizers import processors

    specials = [(t, tok.tokenizer.token_to_id(t)) for t in single.split() if t != "$A"]
    tok.tokenizer.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    return tok


@pytest.mark.parametrize("single", ["[gMASK] <sop> $A", "$A <|endoftext|>"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_truncation_keeps_the_post_processor_special_tokens(single, side):
    """transformers 5.23 truncates with the ``tokenizers`` library's own truncation, which keeps the
    tokens the post-processor adds and cuts the text (measured on a byte-level BPE with
    ``[gMASK] <sop> $A``, max_length 4: [[2, 4, 10, 365], ...] on the left side, the prefix kept;
    with ``$A <|endoftext|>`` on the right: [[368, 351, 10, 0], ...], the EOS kept). Ours cut the
    encoded row, post-processor tokens included: left truncation dropped [gMASK]<sop>
    ([368, 351, 10, 365]), right truncation dropped the EOS ([368, 351, 10, 365])."""
    tok = _with_post_processor(make_tiny_tokenizer(), single)
    tok.truncation_side = side
    specials = {tok.token_to_id(t) for t in single.split() if t != "$A"}
    text_ids = tok.encode(TEXTS[2], add_special_tokens=False)
    full = tok.encode(TEXTS[2], add_special_tokens=True)
    assert len(full) == len(text_ids) + len(specials)
    for n in (4, 5, len(full) - 1):
        got = tok(TEXTS[2], truncation=True, max_length=n)["input_ids"]
        keep = n - len(specials)
        cut = text_ids[-keep:] if side == "left" else text_ids[:keep]
        want = [i for i in full if i in specials][: full.index(text_ids[0])] + cut
        want += [i for i in full[full.index(text_ids[0]) :] if i in specials]
        assert got == want, (n, got, want)
        # without the special tokens the text itself is cut to max_length
        assert tok(TEXTS[2], truncation=True, max_length=n, add_special_tokens=False)["input_ids"] == (
            text_ids[-n:] if side == "left" else text_ids[:n]
        )


def test_truncation_and_padding_saved_in_tokenizer_json_are_not_applied(tmp_path):
    """A tokenizer.json saved with ``"truncation": {"max_length": 5, ...}`` and ``"padding": {...}``
    (the ``tokenizers`` library writes them after ``enable_truncation`` / ``enable_padding``):
    transformers 5.23 turns both off for every call that does not ask for them (measured: the call
    and ``encode`` give the 12 tokens of "Hello world! ..." and unpadded rows). Ours encoded through
    them: every text cut to 5 tokens (``tok.encode`` too, so ``glm52 train`` silently cut each
    document of a text .jsonl) and every batch padded to its longest row."""
    tok = make_tiny_tokenizer()
    full = [tok.encode(t) for t in TEXTS]
    tok.tokenizer.enable_truncation(5)
    tok.tokenizer.enable_padding(pad_id=0, pad_token="<|pad|>")
    tok.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "tokenizer.json").read_text())["truncation"]["max_length"] == 5
    back = GlmTokenizer.from_pretrained(tmp_path)
    assert [back.encode(t) for t in TEXTS] == full
    assert back(TEXTS)["input_ids"] == full
    ids, _ = back.encode_chat_for_training(CHAT)
    assert ids == make_tiny_tokenizer().apply_chat_template(CHAT, return_dict=False) and len(ids) > 5
    # truncation when asked, and the settings do not stick to the next call
    assert back(TEXTS, truncation=True, max_length=3)["input_ids"] == [f[:3] for f in full]
    assert back(TEXTS)["input_ids"] == full


# ---------------------------------------------------------------------- transformers' chat rendering
REASONING_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
    "{% endif %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}<|endoftext|>"
    "{% else %}{{ m.content }}{% endif %}{% endfor %}[{{ bos_token }}|{{ tools is defined }}|{{ documents is none }}]"
)
REASONING_CHAT = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four.", "reasoning": "Two and two"},
]


def test_chat_rendering_is_transformers():
    """What transformers 5.23 renders (measured, AutoTokenizer on the tiny folder with this template):
    a message's ``reasoning`` (or ``thinking``) also reaches the template as ``reasoning_content``
    (GLM's templates read that name), ``tools`` and ``documents`` are defined (None) when not given,
    and a special token the config does not set is undefined (renders ''):
    '<|user|>What is two plus two?<|assistant|><think>Two and two</think>Four.<|endoftext|>[|True|True]'.
    Ours rendered '<|user|>What is two plus two?<|assistant|>Four.<|endoftext|>[None|False|False]': the
    reasoning dropped from training text, a literal 'None' for bos_token."""
    tok = make_tiny_tokenizer()
    tok.chat_template = REASONING_TEMPLATE
    want = "<|user|>What is two plus two?<|assistant|><think>Two and two</think>Four.<|endoftext|>[|True|True]"
    assert tok.apply_chat_template(REASONING_CHAT, tokenize=False) == want
    assert tok.render_chat(REASONING_CHAT) == want
    assert REASONING_CHAT[1] == {"role": "assistant", "content": "Four.", "reasoning": "Two and two"}  # not edited
    # template variables win over the special tokens (ours: "got multiple values for keyword argument")
    assert tok.apply_chat_template(REASONING_CHAT, tokenize=False, bos_token="B").endswith("[B|True|True]")
    ids, mine = tok.encode_chat_for_training(REASONING_CHAT)
    # the block's "Four." and the <|endoftext|> closing the turn outside it (a stop token: trained)
    assert tok.decode(ids) == want and _runs(tok, ids, mine) == ["Four.<|endoftext|>"]


def test_chat_template_arguments_of_transformers():
    """``chat_template=``, ``continue_final_message`` and ``return_assistant_tokens_mask`` are
    transformers' arguments (measured with 5.23 on the tiny folder); ours passed them to the template
    as variables and ignored them: the checkpoint's template rendered instead of the given one, the
    final message closed with <|endoftext|> instead of left open, no ``assistant_masks``."""
    tok = make_tiny_tokenizer()
    assert tok.apply_chat_template(CHAT, tokenize=False, chat_template="{{ messages[1]['content'] }}") == (
        "What is the capital of France?"
    )
    open_turn = tok.apply_chat_template(CHAT, tokenize=False, continue_final_message=True)
    assert open_turn == tok.apply_chat_template(CHAT, tokenize=False)[: -len("<|endoftext|>")]
    assert tok.apply_chat_template(CHAT, continue_final_message=True, return_dict=False) == tok.encode(open_turn)
    with pytest.raises(ValueError, match="add_generation_prompt"):
        tok.apply_chat_template(CHAT, continue_final_message=True, add_generation_prompt=True)
    tok.chat_template = REASONING_TEMPLATE
    assert tok.apply_chat_template(REASONING_CHAT, tokenize=False, continue_final_message="reasoning") == (
        "<|user|>What is two plus two?<|assistant|><think>Two and two"
    )
    # HF's assistant_masks: the {% generation %} tokens, padded on the padding side (5.23, left padding:
    # the second row's 9 answer tokens at 19-27, after 11 pads)
    convs = [REASONING_CHAT, REASONING_CHAT[:1] + [{"role": "assistant", "content": "The capital of France is Paris."}]]
    for side in ("left", "right"):
        tok.padding_side = side
        enc = tok.apply_chat_template(convs, return_assistant_tokens_mask=True, padding=True)
        for ids, att, mask, conv in zip(enc["input_ids"], enc["attention_mask"], enc["assistant_masks"], convs):
            assert len(mask) == len(ids) and all(m <= a for m, a in zip(mask, att))
            assert _runs(tok, ids, mask) == [conv[1]["content"]]
    one = tok.apply_chat_template(REASONING_CHAT, return_assistant_tokens_mask=True)
    assert one["assistant_masks"] == [0] * 25 + [1] * 3 + [0] * 11
    tok.padding_side = "left"
    left = tok.apply_chat_template(convs, return_assistant_tokens_mask=True, padding=True)["assistant_masks"]
    assert left[1] == [0] * 19 + [1] * 9 + [0] * 11
    np_enc = tok.apply_chat_template(REASONING_CHAT, return_assistant_tokens_mask=True, return_tensors="np")
    assert np_enc["assistant_masks"].tolist() == [one["assistant_masks"]]


_OPEN_CHAT = [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "Hello there "}]


def test_continue_final_message_keeps_the_trailing_space_the_template_kept():
    """transformers 5.23 (``apply_chat_template``, continue_final_message) cuts the rendering after the
    final message as the template rendered it: where the template kept the message's trailing space,
    so does the open turn.  Measured with AutoTokenizer on the tiny folder: a final assistant message
    "Hello there " -> text ending "<|assistant|>\nHello there " and ids [6, 7, 2, 9, 60, 168, 104, 107,
    254, 88, 4, 9, 219, 254, 88, 109, 136, 104] (the last, 104, the space).  Stripping the space would
    give another prompt than transformers', so a continuation would start with a different token."""
    tok = make_tiny_tokenizer()
    text = tok.apply_chat_template(_OPEN_CHAT, tokenize=False, continue_final_message=True)
    assert text == "[gMASK]<sop><|user|>\nSay hello<|assistant|>\nHello there "
    ids = tok.apply_chat_template(_OPEN_CHAT, continue_final_message=True, return_dict=False)
    assert ids == [6, 7, 2, 9, 60, 168, 104, 107, 254, 88, 4, 9, 219, 254, 88, 109, 136, 104]


@pytest.mark.reference
def test_continue_final_message_with_a_trailing_space_equals_transformers(tiny_dir):
    hf, ours = _hf_and_ours(tiny_dir)
    for tokenize in (False, True):
        want = hf.apply_chat_template(_OPEN_CHAT, tokenize=tokenize, continue_final_message=True, return_dict=False)
        got = ours.apply_chat_template(_OPEN_CHAT, tokenize=tokenize, continue_final_message=True, return_dict=False)
        assert (list(got) if tokenize else got) == (list(want) if tokenize else want)


# ---------------------------------------------------------------------- special tokens as transformers reads them
_TOKEN = {"lstrip": False, "rstrip": False, "normalized": False, "single_word": False}


def _tiny_folder(path, drop=(), config=None, special_map=None, added_tokens_decoder=None, think=False, post=None):
    """The tiny tokenizer saved to ``path``, its tokenizer_config.json without the keys ``drop`` and
    with ``config`` over it, a special_tokens_map.json, ``<think>`` added as a non-special token
    (id 256), a ``post`` post-processor."""
    from tokenizers import AddedToken

    tok = make_tiny_tokenizer()
    if think:
        tok.tokenizer.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    if post:
        tok = _with_post_processor(tok, post)
    tok.save_pretrained(path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k not in drop} | (config or {})
    if added_tokens_decoder is not None:
        cfg["added_tokens_decoder"] = added_tokens_decoder
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    if special_map is not None:
        (path / "special_tokens_map.json").write_text(json.dumps(special_map))
    return path


def test_special_tokens_map_is_read_as_transformers_reads_it(tmp_path):
    """transformers 5.23 (``_from_pretrained``) reads special_tokens_map.json when tokenizer_config.json
    has no ``added_tokens_decoder``, its values over the config's. Measured with AutoTokenizer on the
    tiny folder: a config without eos/pad and a map giving ``<|endoftext|>`` and ``{"content":
    "<|pad|>"}`` -> (eos, pad) ids (1, 0); a map with eos ``<|user|>`` over the config's
    ``<|endoftext|>`` -> (2, 0); with ``added_tokens_decoder`` in the config the map is ignored ->
    (None, 0). Ours ignored the file: (None, None), (1, 0), so a text .jsonl was refused for lacking
    an EOS and padding for lacking a pad token."""
    only = _tiny_folder(
        tmp_path / "a",
        drop=("eos_token", "pad_token"),
        special_map={"eos_token": "<|endoftext|>", "pad_token": {"content": "<|pad|>", **_TOKEN}},
    )
    tok = GlmTokenizer.from_pretrained(only)
    assert (tok.eos_token_id, tok.pad_token_id) == (1, 0)
    assert tok(["Hello there", "Hi"], padding=True)["input_ids"][1][-1] == 0
    over = _tiny_folder(tmp_path / "b", special_map={"eos_token": "<|user|>"})
    assert (GlmTokenizer.from_pretrained(over).eos_token_id, GlmTokenizer.from_pretrained(over).pad_token_id) == (2, 0)
    ignored = _tiny_folder(
        tmp_path / "c",
        drop=("eos_token",),
        special_map={"eos_token": "<|user|>"},
        added_tokens_decoder={"0": {"content": "<|pad|>", "special": True, **_TOKEN}},
    )
    assert (GlmTokenizer.from_pretrained(ignored).eos_token_id, GlmTokenizer.from_pretrained(ignored).pad_token_id) == (
        None,
        0,
    )


def test_special_tokens_only_in_the_config_are_added(tmp_path):
    """Special tokens the config names that tokenizer.json lacks: transformers 5.23 adds them as
    special tokens (TokenizersBackend.__init__). Measured with AutoTokenizer on the tiny folder (256
    entries) with ``additional_special_tokens: ["<|user|>", "<newtok>"]`` and ``eos_token: "<eos>"``:
    258 tokens, eos id 256, "Hi <newtok> there <|user|>" -> [49, 82, 104, 257, 109, 136, 104, 2],
    decoded with skip_special_tokens -> "Hi  there ". Ours: 256 tokens, eos None, <newtok> split
    into 8 byte pieces [49, 82, 104, 37, 87, 78, 96, 93, 88, 84, 39, 109, 136, 104, 2] and kept."""
    d = _tiny_folder(tmp_path, config={"additional_special_tokens": ["<|user|>", "<newtok>"], "eos_token": "<eos>"})
    tok = GlmTokenizer.from_pretrained(d)
    ids = tok.encode("Hi <newtok> there <|user|>", add_special_tokens=False)
    assert (len(tok), tok.eos_token_id, ids) == (258, 256, [49, 82, 104, 257, 109, 136, 104, 2])
    assert tok.vocab_size == 256  # transformers' vocab_size: the model's vocabulary, the added tokens left out
    assert tok.decode(ids, skip_special_tokens=True) == "Hi  there "
    # saved and read back: the same ids
    tok.save_pretrained(tmp_path / "back")
    assert GlmTokenizer.from_pretrained(tmp_path / "back").encode("Hi <newtok>", add_special_tokens=False) == [
        49,
        82,
        104,
        257,
    ]


_MASK_NOT_SPECIAL = {"mask_token": {"__type": "AddedToken", "content": "<|mask_x|>", "special": False, **_TOKEN}}


def test_a_named_special_token_flagged_not_special_is_added_as_special(tmp_path):
    """A named special token (here ``mask_token``) that tokenizer.json lacks, given in
    tokenizer_config.json as an AddedToken with ``"special": false``: transformers 5.23 adds it as a
    special token all the same.  Measured with AutoTokenizer on the tiny folder: 257 tokens, mask id
    256, "Hello <|mask_x|> there" -> [219, 254, 88, 104, 256, 109, 136], decoded with
    skip_special_tokens -> "Hello  there".  Kept as an ordinary token, the mask would survive in the
    decoded text of a skip_special_tokens decode."""
    tok = GlmTokenizer.from_pretrained(_tiny_folder(tmp_path, config=_MASK_NOT_SPECIAL))
    ids = tok.encode("Hello <|mask_x|> there", add_special_tokens=False)
    assert (len(tok), tok.mask_token_id, ids) == (257, 256, [219, 254, 88, 104, 256, 109, 136])
    assert 256 in tok.all_special_ids
    assert tok.decode(ids, skip_special_tokens=True) == "Hello  there"
    assert tok.decode(ids) == "Hello <|mask_x|> there"


@pytest.mark.reference
def test_a_named_special_token_flagged_not_special_equals_transformers(tmp_path):
    hf, ours = _hf_and_ours(_tiny_folder(tmp_path, config=_MASK_NOT_SPECIAL))
    text = "Hello <|mask_x|> there"
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    assert (len(ours), ours.mask_token_id) == (len(hf), hf.mask_token_id)


def test_added_tokens_decoder_special_flag_overrides_tokenizer_json(tmp_path):
    """tokenizer.json holds ``<think>`` (id 256) as a non-special token; tokenizer_config.json's
    ``added_tokens_decoder`` marks it special. transformers 5.23 adds the config's entry over it:
    "<think>Hi" -> [256, 49, 82], decoded with skip_special_tokens -> "Hi" (measured; "<think>Hi"
    without the config entry). Ours kept tokenizer.json's flag: "<think>Hi"."""
    entry = {"content": "<think>", "special": True, **_TOKEN}
    tok = GlmTokenizer.from_pretrained(_tiny_folder(tmp_path / "a", think=True, added_tokens_decoder={"256": entry}))
    ids = tok.encode("<think>Hi", add_special_tokens=False)
    assert (len(tok), ids, tok.decode(ids, skip_special_tokens=True)) == (257, [256, 49, 82], "Hi")
    plain = GlmTokenizer.from_pretrained(_tiny_folder(tmp_path / "b", think=True))
    assert plain.decode(ids, skip_special_tokens=True) == "<think>Hi"


def test_encode_adds_the_post_processor_tokens_by_default_and_the_package_does_not(tmp_path):
    """``encode(text)``: transformers 5.23's default is add_special_tokens=True (measured on the tiny
    folder with a ``[gMASK] <sop> $A`` post-processor: "Hello there" -> [6, 7, 219, 254, 88, 109, 136]);
    ours defaulted to False ([219, 254, 88, 109, 136]). The package's own callers (text training data,
    ``glm52 generate``, the demo) ask for False explicitly, so their ids are what they were: the text
    .jsonl stream is each document's text ids and the EOS, no [gMASK]<sop>."""
    from paddleformers_glm.train.data import open_data, prepare_jsonl

    tok = GlmTokenizer.from_pretrained(_tiny_folder(tmp_path, post="[gMASK] <sop> $A"))
    assert tok.encode("Hello there") == [6, 7, 219, 254, 88, 109, 136]
    assert tok.encode("Hello there", add_special_tokens=False) == [219, 254, 88, 109, 136]
    docs = ["Hello there, how are you today?", "The sea is blue and two plus two is four."]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    stream = [i for d in docs for i in tok.encode(d, add_special_tokens=False) + [tok.eos_token_id]]
    info = prepare_jsonl(str(tmp_path / "t.jsonl"), 8, 256, tok, str(tmp_path / "t.npz"))
    assert info["tokens"] == len(stream)
    data = open_data(str(tmp_path / "t.npz"), 8, 256, 0)
    got = np.concatenate([data.sample(i)["input_ids"] for i in range(data.num_samples)])
    np.testing.assert_array_equal(got, stream[: len(got)])


def test_tokenizer_json_truncation_and_padding_give_the_default_sides_and_pad_token(tmp_path):
    """tokenizer.json saved with ``truncation: {direction: left}`` and ``padding: {direction: left,
    pad_token: "<|user|>"}``, a config without pad_token or sides: transformers 5.23
    (TokenizersBackend.__init__'s setdefault) takes them as truncation_side "left", padding_side
    "left" and pad token "<|user|>" (id 2), yet applies neither to a call (measured: padding=True ->
    [[219, 254, 88, 109, 136, 118, 91, 82, 123, 77], [2, 2, 2, 2, 2, 2, 2, 2, 49, 82]]); the config's
    own sides and pad token win over them (measured: "right", "right", "<|pad|>"). Ours: "right",
    "right", no pad token (padding refused)."""
    tok = make_tiny_tokenizer()
    tok.tokenizer.enable_truncation(5, direction="left")
    tok.tokenizer.enable_padding(pad_id=2, pad_token="<|user|>", direction="left")
    tok.save_pretrained(tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "tokenizer_config.json").read_text())
    (tmp_path / "a" / "tokenizer_config.json").write_text(
        json.dumps({k: v for k, v in cfg.items() if k != "pad_token"})
    )
    back = GlmTokenizer.from_pretrained(tmp_path / "a")
    assert (back.truncation_side, back.padding_side, back.pad_token, back.pad_token_id) == (
        "left",
        "left",
        "<|user|>",
        2,
    )
    assert back(["Hello there friend", "Hi"], padding=True)["input_ids"] == [
        [219, 254, 88, 109, 136, 118, 91, 82, 123, 77],
        [2, 2, 2, 2, 2, 2, 2, 2, 49, 82],
    ]
    cfg |= {"truncation_side": "right", "padding_side": "right"}
    (tmp_path / "a" / "tokenizer_config.json").write_text(json.dumps(cfg))
    back = GlmTokenizer.from_pretrained(tmp_path / "a")
    assert (back.truncation_side, back.padding_side, back.pad_token, back.pad_token_id) == (
        "right",
        "right",
        "<|pad|>",
        0,
    )


def test_model_specific_special_tokens_are_template_variables_and_special_tokens(tmp_path):
    """A config with ``image_token: "<img>"`` and ``extra_special_tokens: {"video_token": "<vid>"}``
    (transformers 5's model-specific special tokens): transformers 5.23 adds both as special tokens
    and passes both to the chat template (its special_tokens_map). Measured on the tiny folder:
    "{{ image_token }}|{{ video_token is defined }}|..." -> "<img>|True|hi", "a<img><vid>" ->
    [74, 256, 257]. Ours rendered "|False|hi" and split both into byte pieces
    [74, 37, 82, 86, 80, 39, 37, 95, 82, 77, 39]."""
    d = _tiny_folder(tmp_path, config={"image_token": "<img>", "extra_special_tokens": {"video_token": "<vid>"}})
    tok = GlmTokenizer.from_pretrained(d)
    template = "{{ image_token }}|{{ video_token is defined }}|{{ messages[0]['content'] }}"
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, tokenize=False, chat_template=template) == "<img>|True|hi"
    assert tok.encode("a<img><vid>", add_special_tokens=False) == [74, 256, 257]


def test_split_special_tokens_splits_them_as_transformers_does(tmp_path):
    """tokenizer_config.json ``split_special_tokens: true``: transformers 5.23 sets the backend's
    ``encode_special_tokens``, so a special token in a text (a chat template's output included) is
    tokenized as plain text. Measured on the tiny folder: "a<|user|>b" -> [74, 37, 101, 94, 92, 112,
    101, 39, 75] (encode and the call), a one-message chat -> 22 ids starting [68, 80, 54, ...]. Ours
    ignored the key: [74, 2, 75] and [6, 7, 2, 9, 81, 82]."""
    tok = GlmTokenizer.from_pretrained(_tiny_folder(tmp_path, config={"split_special_tokens": True}))
    split = [74, 37, 101, 94, 92, 112, 101, 39, 75]
    assert tok.encode("a<|user|>b") == split and tok("a<|user|>b")["input_ids"] == split
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], return_dict=False)
    assert chat == [68, 80, 54, 42, 60, 52, 70, 37, 92, 88, 89, 39, 37, 101, 94, 92, 112, 101, 39, 9, 81, 82]
    assert make_tiny_tokenizer().encode("a<|user|>b") == [74, 2, 75]  # the default keeps them whole


# ---------------------------------------------------------------------- None-valued message keys
NONE_KEYS_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}:{% if m.content is defined %}{{ m.content }}{% else %}-{% endif %}"
    "{% if m.tool_calls is defined %}TC{% endif %}]{% endfor %}"
)
NONE_KEYS_CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": None}]


def test_none_valued_message_keys_are_dropped_as_transformers_drops_them():
    """transformers 5.23's apply_chat_template drops a message's keys whose value is None (OpenAI's
    ``content=None``, ``tool_calls=None``) before rendering. Measured with AutoTokenizer on the tiny
    folder: this template renders '[user:hi][assistant:-]' and the tiny GLM-style template
    '[gMASK]<sop><|user|>\\nhi<|assistant|>\\n<|endoftext|>'; ours rendered '[user:hi][assistant:NoneTC]'
    and a literal 'None' as the answer (trained on by encode_chat_for_training)."""
    tok = make_tiny_tokenizer()
    assert tok.apply_chat_template(NONE_KEYS_CHAT, tokenize=False, chat_template=NONE_KEYS_TEMPLATE) == (
        "[user:hi][assistant:-]"
    )
    assert tok.apply_chat_template(NONE_KEYS_CHAT, tokenize=False) == (
        "[gMASK]<sop><|user|>\nhi<|assistant|>\n<|endoftext|>"
    )
    ids, _ = tok.encode_chat_for_training(NONE_KEYS_CHAT)
    assert "None" not in tok.decode(ids)
    assert NONE_KEYS_CHAT[1] == {"role": "assistant", "content": None, "tool_calls": None}  # not edited


@pytest.mark.reference
def test_none_valued_message_keys_render_as_transformers(tiny_dir):
    hf, ours = _hf_and_ours(tiny_dir)
    for template in (NONE_KEYS_TEMPLATE, None):
        a = hf.apply_chat_template(NONE_KEYS_CHAT, tokenize=False, chat_template=template)
        assert ours.apply_chat_template(NONE_KEYS_CHAT, tokenize=False, chat_template=template) == a


# ---------------------------------------------------------------------- max_length and truncation as transformers reads them
LONG_AND_SHORT = ["hello world this is long", "hi"]


def test_max_length_alone_truncates_and_a_multiple_that_undoes_truncation_is_refused():
    """transformers 5.23 (``_get_padding_truncation_strategies``), measured with AutoTokenizer on the
    tiny folder: ``max_length=4`` with no padding and no ``truncation`` truncates
    ([[107, 254, 88, 120], [81, 82]]); ours ignored it (the first row's 13 ids). ``truncation=True,
    max_length=5, padding=True, pad_to_multiple_of=4`` raises "Truncation and padding are both activated
    but truncation length (5) is not a multiple of pad_to_multiple_of (4)."; ours padded the rows to 8,
    past max_length."""
    tok = make_tiny_tokenizer()
    full = tok(LONG_AND_SHORT)["input_ids"]
    assert len(full[0]) == 13
    assert tok(LONG_AND_SHORT, max_length=4)["input_ids"] == [full[0][:4], full[1]]
    assert tok(LONG_AND_SHORT, max_length=4, truncation=False)["input_ids"] == full  # asked not to
    assert tok(LONG_AND_SHORT, max_length=4, padding=True)["input_ids"][0] == full[0]  # padding: max_length ignored
    with pytest.raises(ValueError, match=r"truncation length \(5\) is not a multiple of pad_to_multiple_of \(4\)"):
        tok(LONG_AND_SHORT, truncation=True, max_length=5, padding=True, pad_to_multiple_of=4)
    assert (
        len(tok(LONG_AND_SHORT, truncation=True, max_length=8, padding=True, pad_to_multiple_of=4)["input_ids"][1]) == 8
    )


@pytest.mark.reference
def test_max_length_and_truncation_as_transformers(tiny_dir):
    hf, ours = _hf_and_ours(tiny_dir)
    for kw in (
        {"max_length": 4},
        {"max_length": 4, "truncation": False},
        {"max_length": 4, "padding": True},
        {"max_length": 4, "padding": "do_not_pad"},
        {"truncation": True, "max_length": 8, "padding": True, "pad_to_multiple_of": 4},
    ):
        assert dict(ours(LONG_AND_SHORT, **kw)) == dict(hf(LONG_AND_SHORT, **kw)), kw
    kw = {"truncation": True, "max_length": 5, "padding": True, "pad_to_multiple_of": 4}
    with pytest.raises(ValueError) as want:
        hf(LONG_AND_SHORT, **kw)
    with pytest.raises(ValueError) as got:
        ours(LONG_AND_SHORT, **kw)
    assert str(got.value) == str(want.value)


# ---------------------------------------------------------------------- apply_chat_template's tokenizer_kwargs
KW_CONVS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
    [{"role": "user", "content": "hello there world"}, {"role": "assistant", "content": "fine thanks"}],
]


def test_chat_template_tokenizer_kwargs_reach_the_tokenizer_call():
    """transformers 5.23 passes apply_chat_template's ``tokenizer_kwargs`` to the tokenizer call and
    refuses ``return_assistant_tokens_mask`` without ``tokenize`` and ``return_dict``. Measured with
    AutoTokenizer on the tiny folder, GEN_TEMPLATE, ``padding=True, tokenizer_kwargs={"padding_side":
    "left", "pad_to_multiple_of": 8}``: rows of 24 ids, 13 and 2 pads on the left, assistant_masks 1 at
    21-22 and 17-22; ``tokenize=False`` (or ``return_dict=False``) with the mask raises ValueError.
    Ours took ``tokenizer_kwargs`` as a template variable (right padding to 22, no multiple) and
    returned the text / ids without a mask."""
    tok = make_tiny_tokenizer()
    kw = {"padding_side": "left", "pad_to_multiple_of": 8}
    enc = tok.apply_chat_template(
        KW_CONVS, chat_template=GEN_TEMPLATE, padding=True, return_assistant_tokens_mask=True, tokenizer_kwargs=kw
    )
    assert [len(r) for r in enc["input_ids"]] == [24, 24]
    assert [m.index(1) for m in enc["attention_mask"]] == [13, 2]
    assert enc["assistant_masks"] == [[0] * 21 + [1] * 2 + [0], [0] * 17 + [1] * 6 + [0]]
    assert _runs(tok, enc["input_ids"][1], enc["assistant_masks"][1]) == ["fine thanks"]
    for bad in ({"tokenize": False}, {"return_dict": False}):
        with pytest.raises(ValueError, match="requires `return_dict=True` and `tokenize=True`"):
            tok.apply_chat_template(KW_CONVS[0], return_assistant_tokens_mask=True, **bad)
    with pytest.raises(TypeError, match="add_special_tokens"):  # as transformers: given twice
        tok.apply_chat_template(KW_CONVS[0], tokenizer_kwargs={"add_special_tokens": True})


@pytest.mark.reference
def test_chat_template_tokenizer_kwargs_as_transformers(tiny_dir):
    hf, ours = _hf_and_ours(tiny_dir)
    for kw in ({"padding_side": "left", "pad_to_multiple_of": 8}, {"padding_side": "right"}):
        args = dict(chat_template=GEN_TEMPLATE, padding=True, return_assistant_tokens_mask=True, tokenizer_kwargs=kw)
        assert dict(ours.apply_chat_template(KW_CONVS, **args)) == dict(hf.apply_chat_template(KW_CONVS, **args))


def test_save_pretrained_over_a_chat_template_jinja_keeps_the_template_saved(tmp_path):
    """A folder holding a chat_template.jinja (as transformers 5.23's save_pretrained writes it): the
    file wins over tokenizer_config.json's template on loading, in transformers as here. Measured:
    load such a folder ('OLD...'), set ``chat_template = 'NEW...'``, save_pretrained back into it;
    transformers' own save reloads 'NEW...'; ours wrote the template only into the config, so ours and
    AutoTokenizer both reloaded 'OLD...'."""
    make_tiny_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("OLD{{ messages[0].content }}")
    tok = GlmTokenizer.from_pretrained(tmp_path)
    assert tok.chat_template == "OLD{{ messages[0].content }}"
    tok.chat_template = "NEW{{ messages[0].content }}"
    tok.save_pretrained(tmp_path)
    assert GlmTokenizer.from_pretrained(tmp_path).chat_template == "NEW{{ messages[0].content }}"
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"] == tok.chat_template
    transformers = pytest.importorskip("transformers")  # the live reading, where installed
    pytest.importorskip("torch")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path).chat_template == "NEW{{ messages[0].content }}"


def test_pad_of_one_row_and_of_token_type_ids_and_special_tokens_mask():
    """transformers 5.23's ``pad``, measured with AutoTokenizer on the tiny folder: one row
    ``{"input_ids": [1, 2]}`` gives one row back ({'input_ids': [1, 2], 'attention_mask': [1, 1]};
    with ``return_tensors="np"`` of shape (2,)); ``token_type_ids`` are padded with 0 and
    ``special_tokens_mask`` with 1 ({'input_ids': [[1, 2], [3, 0]], 'token_type_ids': [[0, 0], [1, 0]],
    'special_tokens_mask': [[0, 1], [0, 1]], ...}). Ours took the row as two rows of one id each
    ([[1], [2]]) and left the two keys unpadded (rows of different lengths)."""
    tok = make_tiny_tokenizer()
    assert dict(tok.pad({"input_ids": [1, 2]})) == {"input_ids": [1, 2], "attention_mask": [1, 1]}
    one = tok.pad({"input_ids": [1, 2]}, padding="max_length", max_length=4, padding_side="left")
    assert dict(one) == {"input_ids": [0, 0, 1, 2], "attention_mask": [0, 0, 1, 1]}
    assert {k: v.shape for k, v in tok.pad({"input_ids": [1, 2]}, return_tensors="np").items()} == {
        "input_ids": (2,),
        "attention_mask": (2,),
    }
    both = tok.pad({"input_ids": [[1, 2], [3]], "token_type_ids": [[0, 0], [1]], "special_tokens_mask": [[0, 1], [0]]})
    assert dict(both) == {
        "input_ids": [[1, 2], [3, 0]],
        "attention_mask": [[1, 1], [1, 0]],
        "token_type_ids": [[0, 0], [1, 0]],
        "special_tokens_mask": [[0, 1], [0, 1]],
    }
    rows = [{"input_ids": np.array([1, 2, 3])}, {"input_ids": paddle.to_tensor([4])}]  # rows as arrays stay rows
    assert tok.pad(rows)["input_ids"] == [[1, 2, 3], [4, 0, 0]]


def test_decode_of_rows_and_batch_decode_of_one_sequence():
    """transformers 5.23, measured on the tiny folder: ``decode`` of rows (a list of lists, a 2-D
    array) gives a list of texts (['hi', 'j'], ['hi', 'jk']) and ``batch_decode`` of one sequence of ids
    gives its one text (``batch_decode(np.array([81, 82]))`` == ['hi'], ``batch_decode([])`` == ['']).
    Ours: decode of rows raised TypeError ("int() argument must be ..."), batch_decode of one sequence
    decoded each id alone (['h', 'i'])."""
    tok = make_tiny_tokenizer()
    assert tok.decode([[81, 82], [83]]) == ["hi", "j"]
    assert tok.decode(np.array([[81, 82], [83, 84]])) == ["hi", "jk"]
    assert tok.batch_decode(np.array([81, 82])) == tok.batch_decode([81, 82]) == ["hi"]
    assert tok.batch_decode([]) == [""]
    assert tok.batch_decode(paddle.to_tensor([[81, 82], [83, 84]])) == ["hi", "jk"]
    assert tok.decode(paddle.to_tensor([81, 82])) == "hi" and tok.decode(81) == "h"


# ids decode refuses, as transformers 5.23's decode does (TypeError from its tokenizers backend, measured
# on the tiny folder: "'float' object cannot be interpreted as an integer", "'str' object ...")
NOT_IDS = ([1.7, 2.2], np.array([1.7, 2.2]), np.array([[0.9, 2.5]]), ["1", "2"], 1.0, [np.float32(3)], [[81, 1.5]])


def test_decode_refuses_ids_that_are_not_integers():
    """A float id was cut by ``int()`` and decoded: ``decode([1.7, 2.2])`` gave '<|endoftext|><|user|>',
    a float array of sampled ids (or logits passed by mistake) plausible text with no error, and
    ``["1", "2"]`` was taken as two rows of ids. transformers 5.23 raises TypeError on each (NOT_IDS);
    so does ours now, naming the value. Integer ids of any kind (bools too, as transformers takes
    them: ``decode([True, False])`` is ids 1 and 0) decode as before."""
    tok = make_tiny_tokenizer()
    for ids in NOT_IDS:
        with pytest.raises(TypeError, match="expected integer token ids, got (float|str)"):
            tok.decode(ids)
        with pytest.raises(TypeError, match="expected integer token ids"):
            tok.batch_decode(ids)
    assert tok.decode([True, False]) == tok.decode([1, 0])
    assert tok.decode([np.int64(81), 82]) == tok.decode(np.array([81, 82], np.int32)) == "hi"
    assert tok.decode(paddle.to_tensor([81, 82], dtype="int64")) == "hi"
    for dt in ("float32", "float16", "bfloat16"):  # numpy() of bfloat16 gives its bit patterns: integers
        with pytest.raises(TypeError, match=f"expected integer token ids, got a tensor of paddle.{dt}"):
            tok.decode(paddle.to_tensor([81.0, 82.0]).astype(dt))


def test_decode_takes_the_ids_a_sampling_loop_builds_and_an_encoding():
    """transformers 5.23 converts the ids element by element (``to_py_obj``), and an encoding by its
    ``input_ids``: measured with AutoTokenizer on the tiny tokenizer, each form of [81, 82] below
    (torch tensors in place of Paddle's) decodes to 'hi': a list a loop built by appending each
    step's 0-d argmax, the elements of a 1-d tensor, bytes (their integers), an encoding."""
    tok = make_tiny_tokenizer()
    forms = [[81, paddle.to_tensor(82)], [81, np.array(82)], list(paddle.to_tensor([81, 82]))]
    forms += [[paddle.to_tensor(81), paddle.to_tensor(82)], b"QR", {"input_ids": [81, 82], "attention_mask": [1, 1]}]
    for ids in forms:
        assert tok.decode(ids) == "hi", ids
    assert tok.batch_decode([[81, paddle.to_tensor(82)], np.array([82, 81])]) == ["hi", "ih"]
    with pytest.raises(KeyError, match="input_ids"):  # as transformers: a mapping is an encoding
        tok.decode({"attention_mask": [1, 1]})
    # convert_ids_to_tokens takes a float tensor by its values, as transformers does (a bfloat16
    # tensor's numpy() is its bit patterns: [None, None] before)
    assert tok.convert_ids_to_tokens(paddle.to_tensor([81.0, 82.0]).astype("bfloat16")) == ["h", "i"]


@pytest.mark.reference
def test_decode_refuses_what_transformers_refuses(tiny_dir):
    hf, ours = _hf_and_ours(tiny_dir)
    for ids in NOT_IDS:
        with pytest.raises(TypeError):
            hf.decode(ids)
        with pytest.raises(TypeError):
            ours.decode(ids)
    for ids in ([True, False], np.array([True]), [np.int64(3)], 5, np.int64(5), (81, 82), range(3)):
        assert ours.decode(ids) == hf.decode(ids), ids


@pytest.mark.reference
def test_pad_and_decode_as_transformers(tiny_dir):
    hf, ours = _hf_and_ours(tiny_dir)
    for inputs, kw in (
        ({"input_ids": [1, 2]}, {}),
        ({"input_ids": [1, 2]}, {"padding": "max_length", "max_length": 4, "padding_side": "left"}),
        ({"input_ids": [[1, 2], [3]], "token_type_ids": [[0, 0], [1]], "special_tokens_mask": [[0, 1], [0]]}, {}),
        ({"input_ids": [[1, 2], [3]], "special_tokens_mask": [[0, 1], [0]]}, {"padding_side": "left"}),
    ):
        assert dict(ours.pad(inputs, **kw)) == dict(hf.pad(inputs, **kw)), (inputs, kw)
    for ids in ([[81, 82], [83]], np.array([[81, 82], [83, 84]]), [81, 82], np.array([81, 82]), []):
        assert ours.decode(ids) == hf.decode(ids)
        assert ours.batch_decode(ids) == hf.batch_decode(ids)


def test_tools_given_as_python_functions_are_refused_by_name():
    """transformers 5.23 turns a tool given as a Python function into its JSON schema (from the
    signature and docstring; measured on the tiny folder: '{"type": "function", "function": {"name": "f",
    "description": "Get weather.", ...}}' in the rendered tools). Ours passed the function to the
    template, whose ``tojson`` failed with "TypeError: Object of type function is not JSON serializable";
    it is refused, naming ``tools``, and a JSON schema renders."""

    def f(city: str):
        """Get weather.

        Args:
            city: the city
        """

    tok = make_tiny_tokenizer()
    template = "{{ tools | tojson }}"
    with pytest.raises(TokenizerError, match="tools: a Python function is not supported"):
        tok.apply_chat_template(CHAT[:2], chat_template=template, tokenize=False, tools=[f])
    schema = {"type": "function", "function": {"name": "f", "description": "Get weather."}}
    assert tok.apply_chat_template(CHAT[:2], chat_template=template, tokenize=False, tools=[schema]) == (
        '[{"type": "function", "function": {"name": "f", "description": "Get weather."}}]'
    )


def test_vocab_size_len_and_token_id_conversions_are_transformers(tmp_path):
    """transformers 5.23, measured with AutoTokenizer on the tiny folder (256 entries) whose config adds
    ``<eos>`` and ``<newtok>`` (ids 256, 257): ``vocab_size`` 256 (the model's vocabulary, the added
    tokens left out), ``len`` 258, ``get_vocab`` 258 entries; ``convert_tokens_to_ids(["<newtok>",
    "zzz_unknown", "<|user|>"])`` -> [257, 8, 2] (an unknown token: unk_token_id 8; without an
    unk_token: None); ``convert_ids_to_tokens([256, 257, 2, 81])`` -> ['<eos>', '<newtok>', '<|user|>', 'h'],
    of 81 -> 'h', of 999 -> [None]; ``bos_token`` None. Ours counted the added tokens in ``vocab_size``
    (258) and had no ``len``, conversions, ``unk_token`` or ``bos_token``."""
    d = _tiny_folder(
        tmp_path / "a", config={"additional_special_tokens": ["<|user|>", "<newtok>"], "eos_token": "<eos>"}
    )
    tok = GlmTokenizer.from_pretrained(d)
    assert (tok.vocab_size, len(tok), len(tok.get_vocab())) == (256, 258, 258)
    assert tok.convert_tokens_to_ids(["<newtok>", "zzz_unknown", "<|user|>"]) == [257, 8, 2]
    assert tok.convert_tokens_to_ids("zzz") == 8 == tok.unk_token_id and tok.unk_token == "<|unk|>"
    assert tok.convert_ids_to_tokens([256, 257, 2, 81]) == ["<eos>", "<newtok>", "<|user|>", "h"]
    assert tok.convert_ids_to_tokens(81) == "h" and tok.convert_ids_to_tokens([999]) == [None]
    assert tok.bos_token is None and tok.bos_token_id is None
    no_unk = GlmTokenizer.from_pretrained(_tiny_folder(tmp_path / "b", drop=("unk_token",)))
    assert no_unk.unk_token_id is None and no_unk.convert_tokens_to_ids(["zzz", "<|user|>"]) == [None, 2]
    transformers = pytest.importorskip("transformers")  # the live reading, where installed
    pytest.importorskip("torch")
    hf = transformers.AutoTokenizer.from_pretrained(d)
    assert (hf.vocab_size, len(hf)) == (tok.vocab_size, len(tok)) and hf.get_vocab() == tok.get_vocab()
    for tokens in (["<newtok>", "zzz_unknown", "<|user|>"], "zzz"):
        assert hf.convert_tokens_to_ids(tokens) == tok.convert_tokens_to_ids(tokens)
    for ids in ([256, 257, 2, 81], 81, [999]):
        assert hf.convert_ids_to_tokens(ids) == tok.convert_ids_to_tokens(ids)


ADDED_TEXT = "a<new1>b<new2> hello wörld <bos><x1>"


def _add_some(tok):
    return [
        tok.add_tokens(["<new1>", "hello", "wörld"]),
        tok.add_tokens("<new2>", special_tokens=True),
        tok.add_tokens([]),
        tok.add_special_tokens({"bos_token": "<bos>", "extra_special_tokens": ["<x1>", "<|user|>"]}),
    ]


def test_add_tokens_and_special_tokens_then_save_and_load(tmp_path):
    """transformers 5.23's ``add_tokens`` / ``add_special_tokens``, measured with AutoTokenizer on the tiny
    folder: 3, 1, 0 and 2 tokens added; len 262 (vocab_size 256); ADDED_TEXT -> [74, 256, 75, 259, 104,
    257, 104, 258, 104, 260, 261], decoded with skip_special_tokens -> 'a<new1>b hello wörld ';
    bos_token '<bos>' (id 260), a template variable; the same after save_pretrained and loading (by
    AutoTokenizer or GlmTokenizer). Ours had neither method (AttributeError)."""
    tok = make_tiny_tokenizer()
    assert _add_some(tok) == [3, 1, 0, 2]
    want = [74, 256, 75, 259, 104, 257, 104, 258, 104, 260, 261]
    tok.save_pretrained(tmp_path)
    for t in (tok, GlmTokenizer.from_pretrained(tmp_path)):
        assert (len(t), t.vocab_size, t.encode(ADDED_TEXT), t.bos_token, t.bos_token_id) == (
            262,
            256,
            want,
            "<bos>",
            260,
        )
        assert t.decode(want, skip_special_tokens=True) == "a<new1>b hello wörld "
        assert t.apply_chat_template(CHAT[:1], chat_template="{{ bos_token }}|", tokenize=False) == "<bos>|"
    with pytest.raises(ValueError, match="add_special_tokens: eop_token"):
        tok.add_special_tokens({"eop_token": "<eop>"})


@pytest.mark.reference
def test_add_tokens_then_save_and_load_as_transformers(tiny_dir, tmp_path):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf, ours = transformers.AutoTokenizer.from_pretrained(tiny_dir), GlmTokenizer.from_pretrained(tiny_dir)
    assert _add_some(hf) == _add_some(ours)
    hf.save_pretrained(tmp_path / "hf")
    ours.save_pretrained(tmp_path / "ours")
    for folder in ("hf", "ours"):
        for t in (
            transformers.AutoTokenizer.from_pretrained(tmp_path / folder),
            GlmTokenizer.from_pretrained(tmp_path / folder),
        ):
            ids = t.encode(ADDED_TEXT)
            assert ids == hf.encode(ADDED_TEXT) and len(t) == len(hf) and t.bos_token_id == hf.bos_token_id
            assert t.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_encode_takes_a_text_pair_second_as_transformers():
    """transformers 5.23's ``encode(text, text_pair)``, measured with AutoTokenizer on the tiny tokenizer
    with the post-processor ``single="[gMASK] <sop> $A", pair="[gMASK] <sop> $A <|endoftext|> $B:1"``:
    ``encode("hello", "world")`` -> [6, 7, 107, 254, 88, 1, 96, 130, 85, 77] (without special tokens
    [107, 254, 88, 96, 130, 85, 77]). Ours took "world" as ``add_special_tokens`` and silently dropped
    it: [6, 7, 107, 254, 88]."""
    from tokenizers import processors

    tok = make_tiny_tokenizer()
    specials = [(t, tok.tokenizer.token_to_id(t)) for t in ("[gMASK]", "<sop>", "<|endoftext|>")]
    tok.tokenizer.post_processor = processors.TemplateProcessing(
        single="[gMASK] <sop> $A", pair="[gMASK] <sop> $A <|endoftext|> $B:1", special_tokens=specials
    )
    assert tok.encode("hello", "world") == [6, 7, 107, 254, 88, 1, 96, 130, 85, 77]
    assert tok.encode("hello", "world", add_special_tokens=False) == [107, 254, 88, 96, 130, 85, 77]
    assert tok.encode("hello") == [6, 7, 107, 254, 88]
    with pytest.raises(TypeError, match="text_pair must be a string"):
        tok.encode("hello", ["world"])


PAIR_A, PAIR_B = ["hello world this is long", "hi"], ["short", "a much longer second text here"]


def _pair_tokenizer(tok):
    from tokenizers import processors

    specials = [(t, tok.tokenizer.token_to_id(t)) for t in ("[gMASK]", "<sop>", "<|endoftext|>")]
    tok.tokenizer.post_processor = processors.TemplateProcessing(
        single="[gMASK] <sop> $A", pair="[gMASK] <sop> $A <|endoftext|> $B:1", special_tokens=specials
    )
    return tok


def test_call_takes_text_pairs_as_transformers():
    """transformers 5.23's call takes ``text_pair`` second (measured with AutoTokenizer on the tiny
    tokenizer with a pair template "[gMASK] <sop> $A <|endoftext|> $B:1"): ``tok(PAIR_A[0], PAIR_B[1])``
    -> [6, 7, 107, 254, 88, 120, 130, 85, 77, 191, 110, 132, 88, 87, 80, 1, 74, 126, 94, 76, 81, 132, 88,
    87, 80, 112, 119, 78, 76, 88, 87, 77, 209, 104, 107, 136] (the second text's 20 ids after the
    <|endoftext|>); ``truncation="only_second", max_length=12`` on (PAIR_A[1], PAIR_B[1]) -> [6, 7, 81,
    82, 1, 74, 126, 94, 76, 81, 132, 88]; ``truncation=True, max_length=12`` on (PAIR_A[0], PAIR_B[0]) ->
    [6, 7, 107, 254, 88, 120, 130, 85, 1, 92, 171, 93]. Ours took the second argument as ``padding``
    and raised "padding must be True, False, ..."."""
    tok = _pair_tokenizer(make_tiny_tokenizer())
    second = tok.encode(PAIR_B[1], add_special_tokens=False)
    assert len(second) == 20
    assert tok(PAIR_A[0], PAIR_B[1])["input_ids"] == (
        [6, 7, 107, 254, 88, 120, 130, 85, 77, 191, 110, 132, 88, 87, 80, 1] + second
    )
    enc = tok(PAIR_A[1], PAIR_B[1], truncation="only_second", max_length=12)
    assert enc["input_ids"] == [6, 7, 81, 82, 1, 74, 126, 94, 76, 81, 132, 88]
    assert tok(PAIR_A[0], PAIR_B[0], truncation=True, max_length=12)["input_ids"] == (
        [6, 7, 107, 254, 88, 120, 130, 85, 1, 92, 171, 93]
    )
    batch = tok(PAIR_A, PAIR_B, padding=True)
    assert [len(r) for r in batch["input_ids"]] == [len(batch["input_ids"][0])] * 2
    with pytest.raises(ValueError, match="text_pair must be a string for a string text"):
        tok(PAIR_A, PAIR_B[0])


@pytest.mark.reference
def test_call_with_text_pairs_equals_transformers(tmp_path):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    _pair_tokenizer(make_tiny_tokenizer()).save_pretrained(tmp_path)
    for side in ("left", "right"):
        hf = transformers.AutoTokenizer.from_pretrained(tmp_path, padding_side=side, truncation_side=side)
        ours = GlmTokenizer.from_pretrained(tmp_path, padding_side=side, truncation_side=side)
        for args in ((PAIR_A[0], PAIR_B[1]), (PAIR_A, PAIR_B)):
            for kw in (
                {},
                {"padding": True},
                {"truncation": True, "max_length": 9},
                {"truncation": "only_second", "max_length": 12},
                {"truncation": "only_first", "max_length": 12},
                {"max_length": 8},
                {"truncation": "longest_first", "max_length": 12, "padding": "max_length"},
                {"add_special_tokens": False, "truncation": True, "max_length": 5},
            ):
                try:
                    want = dict(hf(*args, **kw))
                except Exception:  # noqa: BLE001 - the tokenizers library's refusal, ours names max_length
                    with pytest.raises(ValueError, match="truncation to max_length"):
                        ours(*args, **kw)
                    continue
                assert dict(ours(*args, **kw)) == want, (side, args, kw)


def test_an_empty_text_pair_of_one_text_is_no_pair():
    """transformers 5.23 encodes one text with ``text_pair=""`` as no pair (``[(text, text_pair)] if
    text_pair else [text]``); measured with AutoTokenizer on the tiny tokenizer with the pair template
    "[gMASK] <sop> $A <|endoftext|> $B:1": ``tok("hello", text_pair="")`` and ``encode("hello", "")`` ->
    [6, 7, 107, 254, 88], the ids of "hello" alone. Ours applied the pair template to the empty second
    text: [6, 7, 107, 254, 88, 1], an <|endoftext|> the caller never asked for. A batch keeps its
    empty pairs, as transformers does ([[6, 7, 107, 254, 88, 1]] for ``tok(["hello"], [""])``)."""
    tok = _pair_tokenizer(make_tiny_tokenizer())
    alone = [6, 7, 107, 254, 88]
    assert tok("hello")["input_ids"] == alone
    assert tok("hello", text_pair="")["input_ids"] == alone
    assert tok("hello", "", return_token_type_ids=True)["token_type_ids"] == [0] * 5
    assert tok.encode("hello", "") == alone
    assert tok.encode("hello", "", max_length=8, padding="max_length") == alone + [0, 0, 0]
    assert tok(text_target="hello", text_pair_target="")["input_ids"] == alone
    assert tok.tokenize("hello", pair="", add_special_tokens=True) == ["[gMASK]", "<sop>", "he", "ll", "o"]
    words = ["hello", "world"]
    assert (
        tok(words, text_pair=[], is_split_into_words=True)["input_ids"]
        == tok(words, is_split_into_words=True)["input_ids"]
    )
    assert tok(["hello"], [""])["input_ids"] == tok([("hello", "")])["input_ids"] == [alone + [1]]
    with pytest.raises(ValueError):  # a batch of one text with no pairs is a length mismatch, as in transformers
        tok(["hello"], [])


@pytest.mark.reference
def test_an_empty_text_pair_equals_transformers(tmp_path):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    _pair_tokenizer(make_tiny_tokenizer()).save_pretrained(tmp_path)
    hf, ours = transformers.AutoTokenizer.from_pretrained(tmp_path), GlmTokenizer.from_pretrained(tmp_path)
    for args, kw in (
        (("hello",), {"text_pair": ""}),
        (("hello", ""), {"return_token_type_ids": True}),
        ((["hello"], [""]), {}),
        (([("hello", "")],), {}),
        ((["hello", "world"],), {"text_pair": [], "is_split_into_words": True}),
        ((), {"text_target": "hello", "text_pair_target": ""}),
    ):
        assert dict(ours(*args, **kw)) == dict(hf(*args, **kw)), (args, kw)
    assert ours.encode("hello", "") == hf.encode("hello", "")
    assert ours.tokenize("hello", pair="", add_special_tokens=True) == hf.tokenize(
        "hello", pair="", add_special_tokens=True
    )


def test_offsets_mapping_as_transformers():
    """transformers 5.23's ``return_offsets_mapping``, measured with AutoTokenizer on the tiny folder,
    left padding: ``tok(["hello world", "hi"], padding=True)`` -> [[(0, 2), (2, 4), (4, 5), (5, 7), (7, 9),
    (9, 10), (10, 11)], [(0, 0), (0, 0), (0, 0), (0, 0), (0, 0), (0, 1), (1, 2)]] (with ``return_tensors="np"``
    an int64 array [2, 7, 2]); a pair ("hello", "world") -> [(0, 2), (2, 4), (4, 5), (0, 1), (1, 3), (3, 4),
    (4, 5)], each in its own text. Ours refused the argument (TypeError)."""
    tok = make_tiny_tokenizer()
    tok.padding_side = "left"
    enc = tok(["hello world", "hi"], return_offsets_mapping=True, padding=True)
    assert enc["offset_mapping"] == [
        [(0, 2), (2, 4), (4, 5), (5, 7), (7, 9), (9, 10), (10, 11)],
        [(0, 0)] * 5 + [(0, 1), (1, 2)],
    ]
    arr = tok(["hello world", "hi"], return_offsets_mapping=True, padding=True, return_tensors="np")["offset_mapping"]
    assert arr.shape == (2, 7, 2) and arr.dtype == np.int64 and arr.tolist()[1][5] == [0, 1]
    pair = [(0, 2), (2, 4), (4, 5), (0, 1), (1, 3), (3, 4), (4, 5)]
    assert tok("hello", "world", return_offsets_mapping=True)["offset_mapping"] == pair
    assert "offset_mapping" not in tok("hello")


@pytest.mark.reference
def test_offsets_mapping_equals_transformers(tiny_dir):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for side in ("left", "right"):
        hf = transformers.AutoTokenizer.from_pretrained(tiny_dir, padding_side=side)
        ours = GlmTokenizer.from_pretrained(tiny_dir, padding_side=side)
        for args, kw in (
            ((["hello world", "héllo 😀 世界"],), {"padding": True}),
            (("hello", "world"), {}),
            ((["hello world foo", "hi"],), {"truncation": True, "max_length": 4, "padding": "max_length"}),
        ):
            assert dict(ours(*args, return_offsets_mapping=True, **kw)) == dict(
                hf(*args, return_offsets_mapping=True, **kw)
            )


CLEANUP_TEXT = "a , b . do n't I 'm ? ! x ' x 's 've 're"


def _word_level_folder(path):
    """A word-level tokenizer (not BPE) whose config sets clean_up_tokenization_spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", *dict.fromkeys(CLEANUP_TEXT.split())]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"clean_up_tokenization_spaces": True, "unk_token": "<unk>"})
    )
    return path


def test_decode_clean_up_tokenization_spaces_as_transformers(tmp_path):
    """transformers 5.23's ``decode(..., clean_up_tokenization_spaces=)``, measured: a BPE tokenizer (the
    tiny one, GLM's) ignores it ("a , b . c ' s" either way); a word-level one whose config sets it
    decodes CLEANUP_TEXT's ids to "a, b. don't I'm?! x'x's've're" (``False``: the words joined by spaces).
    Ours refused the argument (TypeError) and, for the word-level one, ignored the config's setting."""
    tok = make_tiny_tokenizer()
    ids = tok.encode("a , b . c ' s")
    for cleanup in (None, True, False):
        assert tok.decode(ids, clean_up_tokenization_spaces=cleanup) == "a , b . c ' s"
        assert tok.batch_decode([ids], clean_up_tokenization_spaces=cleanup) == ["a , b . c ' s"]
    words = GlmTokenizer.from_pretrained(_word_level_folder(tmp_path))
    ids = words.encode(CLEANUP_TEXT)
    assert words.decode(ids) == words.decode(ids, clean_up_tokenization_spaces=True) == "a, b. don't I'm?! x'x's've're"
    assert words.decode(ids, clean_up_tokenization_spaces=False) == CLEANUP_TEXT
    assert words.batch_decode([ids, ids[:2]]) == ["a, b. don't I'm?! x'x's've're", "a,"]


@pytest.mark.reference
def test_decode_clean_up_tokenization_spaces_equals_transformers(tiny_dir, tmp_path):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for folder in (tiny_dir, _word_level_folder(tmp_path)):
        hf, ours = transformers.AutoTokenizer.from_pretrained(folder), GlmTokenizer.from_pretrained(folder)
        ids = hf.encode(CLEANUP_TEXT)
        for cleanup in (None, True, False):
            assert ours.decode(ids, clean_up_tokenization_spaces=cleanup) == hf.decode(
                ids, clean_up_tokenization_spaces=cleanup
            )


NAMED_TEMPLATES = [
    {"name": "default", "template": "D{{ messages[0].content }}"},
    {"name": "tool_use", "template": "T{{ tools | length }}"},
    {"name": "other", "template": "O"},
]


def _named_templates_folder(path, named):
    make_tiny_tokenizer().save_pretrained(path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": named}))
    return path


def test_named_chat_templates_are_picked_as_transformers_picks_them(tmp_path):
    """A config's list of named chat templates, as transformers 5.23's ``get_chat_template`` picks them
    (measured with AutoTokenizer): 'Dhi' by default, 'T1' with tools (the "tool_use" one), 'O' for
    ``chat_template="other"`` (a name, tools or not); without a "default" one and no name given, a
    ValueError ("multiple chat templates with no default specified"). Ours always rendered the default
    (else the first: 'T' + an error), and rendered a name as the template text ('other')."""
    chat, tools = [{"role": "user", "content": "hi"}], [{"type": "function", "function": {"name": "f"}}]
    tok = GlmTokenizer.from_pretrained(_named_templates_folder(tmp_path / "a", NAMED_TEMPLATES))
    assert tok.apply_chat_template(chat, tokenize=False) == "Dhi"
    assert tok.apply_chat_template(chat, tokenize=False, tools=tools) == "T1"
    assert tok.apply_chat_template(chat, tokenize=False, chat_template="other", tools=tools) == "O"
    assert tok.apply_chat_template(chat, tokenize=False, chat_template="X{{ 1 }}") == "X1"
    tok.save_pretrained(tmp_path / "saved")  # the named templates are kept
    back = GlmTokenizer.from_pretrained(tmp_path / "saved")
    assert [back.apply_chat_template(chat, tokenize=False, **kw) for kw in ({}, {"tools": tools})] == ["Dhi", "T1"]
    no_default = GlmTokenizer.from_pretrained(_named_templates_folder(tmp_path / "b", NAMED_TEMPLATES[1:]))
    with pytest.raises(ValueError, match="none named 'default'"):
        no_default.apply_chat_template(chat, tokenize=False)
    assert no_default.apply_chat_template(chat, tokenize=False, tools=tools) == "T1"


def _assert_same_chat_text(hf, ours, chat, options) -> None:
    """Our apply_chat_template's text equals transformers' for each options dict (or both raise ValueError)."""
    for kw in options:
        try:
            want = hf.apply_chat_template(chat, tokenize=False, **kw)
        except ValueError:
            with pytest.raises(ValueError):
                ours.apply_chat_template(chat, tokenize=False, **kw)
            continue
        assert ours.apply_chat_template(chat, tokenize=False, **kw) == want


@pytest.mark.reference
def test_named_chat_templates_equal_transformers(tmp_path):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    chat, tools = [{"role": "user", "content": "hi"}], [{"type": "function", "function": {"name": "f"}}]
    for i, named in enumerate((NAMED_TEMPLATES, NAMED_TEMPLATES[1:])):
        d = _named_templates_folder(tmp_path / str(i), named)
        hf, ours = transformers.AutoTokenizer.from_pretrained(d), GlmTokenizer.from_pretrained(d)
        _assert_same_chat_text(
            hf,
            ours,
            chat,
            ({}, {"tools": tools}, {"chat_template": "other"}, {"chat_template": "other", "tools": tools}),
        )


# ---------------------------------------------------------------------- from_pretrained keywords as AutoTokenizer's
LOAD_TEXT, LOAD_PAIR = "Hello <x> there <y>", "Bye <|user|>"


def _load_record(tok):
    return (
        tok(LOAD_TEXT)["input_ids"],
        tok(LOAD_TEXT, LOAD_PAIR)["input_ids"],
        tok([LOAD_TEXT, LOAD_PAIR], truncation=True, max_length=4, padding="max_length")["input_ids"],
        (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id, len(tok)),
        tok.decode(tok(LOAD_TEXT + LOAD_PAIR)["input_ids"], skip_special_tokens=True),
    )


LOAD_CASES = [  # (post-processor of tokenizer.json, keywords)
    (None, {"add_bos_token": False}),
    ("[gMASK] <sop> $A", {"add_bos_token": False}),
    ("[gMASK] <sop> $A", {"add_bos_token": True}),
    ("[gMASK] <sop> $A", {"add_bos_token": True, "bos_token": "[gMASK]"}),
    (None, {"add_eos_token": True}),
    (None, {"add_bos_token": True, "add_eos_token": True, "bos_token": "<sop>", "eos_token": "<|user|>"}),
    (None, {"pad_token": "<|endoftext|>", "unk_token": "<|pad|>"}),
    (None, {"extra_special_tokens": ["<x>"]}),
    (None, {"additional_special_tokens": ["<y>"]}),
    (None, {"split_special_tokens": True}),
    (None, {"use_fast": False, "trust_remote_code": True, "revision": "main", "local_files_only": True}),
]


def test_from_pretrained_takes_autotokenizer_keywords(tmp_path):
    """transformers 5.23's ``AutoTokenizer.from_pretrained(folder, **kw)`` takes every keyword: download
    and class-choice ones are ignored for a local folder, the rest go over tokenizer_config.json, and
    ``add_bos_token`` / ``add_eos_token`` replace tokenizer.json's post-processor by ``[bos] $A [eos]``.
    Ours raised TypeError ("unknown options ['add_bos_token']") for any keyword but padding_side,
    truncation_side and model_max_length. Measured with AutoTokenizer on the tiny tokenizer,
    "Hello <x> there <y>" (+ the pair "Bye <|user|>"): the ids below."""
    text = [219, 254, 88, 104, 37, 97, 39, 109, 136, 104, 37, 98, 39]  # the text's own ids
    pair = [43, 98, 78, 104, 2]
    post = "[gMASK] <sop> $A"
    # [gMASK]<sop> post-processor, add_bos_token=False (or True without a bos_token): no prefix
    for kw in ({"add_bos_token": False}, {"add_bos_token": True}):
        tok = GlmTokenizer.from_pretrained(_tiny_folder(tmp_path / f"p{len(kw)}{kw['add_bos_token']}", post=post), **kw)
        assert tok(LOAD_TEXT)["input_ids"] == text and tok.add_bos_token is False
    folder = _tiny_folder(tmp_path / "post", post=post)
    assert GlmTokenizer.from_pretrained(folder)(LOAD_TEXT)["input_ids"] == [6, 7, *text]  # untouched without them
    tok = GlmTokenizer.from_pretrained(folder, add_bos_token=True, bos_token="[gMASK]")
    assert tok(LOAD_TEXT)["input_ids"] == [6, *text] and tok.bos_token_id == 6
    assert tok(LOAD_TEXT, LOAD_PAIR)["input_ids"] == [6, *text, 6, *pair]
    # add_eos_token=True: the eos after each text, kept by truncation
    tok = GlmTokenizer.from_pretrained(_tiny_folder(tmp_path / "plain"), add_eos_token=True)
    assert tok(LOAD_TEXT)["input_ids"] == [*text, 1]
    assert tok(LOAD_TEXT, LOAD_PAIR)["input_ids"] == [*text, 1, *pair, 1]
    assert tok([LOAD_TEXT, LOAD_PAIR], truncation=True, max_length=4)["input_ids"] == [
        [219, 254, 88, 1],
        [43, 98, 78, 1],
    ]
    assert tok(LOAD_TEXT, add_special_tokens=False)["input_ids"] == text
    # add_bos_token / add_eos_token in tokenizer_config.json are ignored (a tokenizer.json is there)
    cfg = _tiny_folder(tmp_path / "cfg", post=post, config={"add_bos_token": False, "add_eos_token": True})
    assert GlmTokenizer.from_pretrained(cfg)(LOAD_TEXT)["input_ids"] == [6, 7, *text]
    # special tokens over the config's: pad id 1, unk id 0 (an unknown token too); an extra one is added (id 256)
    plain = tmp_path / "plain"
    tok = GlmTokenizer.from_pretrained(plain, pad_token="<|endoftext|>", unk_token="<|pad|>")
    assert (tok.pad_token_id, tok.unk_token_id, tok.convert_tokens_to_ids("qqq")) == (1, 0, 0)
    tok = GlmTokenizer.from_pretrained(plain, extra_special_tokens=["<x>"])
    assert tok(LOAD_TEXT)["input_ids"] == [219, 254, 88, 104, 256, 109, 136, 104, 37, 98, 39] and len(tok) == 257
    assert tok.decode(tok(LOAD_TEXT + LOAD_PAIR)["input_ids"], skip_special_tokens=True) == "Hello  there <y>Bye "
    # split_special_tokens: <|user|> as text
    tok = GlmTokenizer.from_pretrained(plain, split_special_tokens=True)
    assert tok(LOAD_PAIR)["input_ids"] == [43, 98, 78, 104, 37, 101, 94, 92, 112, 101, 39]
    # the hub's arguments change nothing; a chat_template keyword wins over the folder's
    assert _load_record(GlmTokenizer.from_pretrained(plain, use_fast=False, trust_remote_code=True)) == _load_record(
        GlmTokenizer.from_pretrained(plain)
    )
    tok = GlmTokenizer.from_pretrained(plain, chat_template="hi {{ messages[0]['content'] }}")
    assert tok.apply_chat_template([{"role": "user", "content": "yo"}], tokenize=False) == "hi yo"
    # the setter, as transformers': the post-processor is rebuilt, and save_pretrained keeps it
    tok = GlmTokenizer.from_pretrained(plain)
    tok.add_eos_token = True
    assert tok(LOAD_TEXT)["input_ids"] == [*text, 1]
    tok.save_pretrained(tmp_path / "saved")
    assert GlmTokenizer.from_pretrained(tmp_path / "saved")(LOAD_TEXT)["input_ids"] == [*text, 1]
    with pytest.raises(TypeError, match="gguf_file"):
        GlmTokenizer.from_pretrained(plain, gguf_file="x.gguf")


@pytest.mark.reference
@pytest.mark.parametrize("post,kw", LOAD_CASES)
def test_from_pretrained_keywords_equal_transformers(tmp_path, post, kw):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder = _tiny_folder(tmp_path / "t", post=post)
    hf, ours = transformers.AutoTokenizer.from_pretrained(folder, **kw), GlmTokenizer.from_pretrained(folder, **kw)
    assert _load_record(ours) == _load_record(hf)
    ours.save_pretrained(tmp_path / "ours")
    assert _load_record(transformers.AutoTokenizer.from_pretrained(tmp_path / "ours")) == _load_record(hf)


# ---------------------------------------------------------------------- the call's other transformers options
CALL_TEXTS = ["Hello there <|user|> friend", "Hi"]
CALL_CASES = [  # (args, keywords) of the call
    ((CALL_TEXTS,), {"return_special_tokens_mask": True, "return_token_type_ids": True, "return_length": True}),
    ((CALL_TEXTS,), {"padding": True, "padding_side": "left", "return_special_tokens_mask": True}),
    ((CALL_TEXTS[0], "Yo"), {"return_token_type_ids": True, "return_special_tokens_mask": True, "verbose": False}),
    ((CALL_TEXTS,), {"return_overflowing_tokens": True, "truncation": True, "max_length": 4, "stride": 1}),
    ((CALL_TEXTS[0],), {"return_overflowing_tokens": True, "truncation": True, "max_length": 4, "stride": 1}),
    (
        (CALL_TEXTS,),
        {
            "return_overflowing_tokens": True,
            "truncation": True,
            "max_length": 4,
            "padding": True,
            "padding_side": "left",
        }
        | {"return_offsets_mapping": True, "return_length": True, "return_special_tokens_mask": True},
    ),
    (
        (CALL_TEXTS, ["Yo", "x"]),
        {"return_overflowing_tokens": True, "truncation": "only_first"} | {"max_length": 8, "stride": 1},
    ),
    ((CALL_TEXTS,), {"return_overflowing_tokens": True}),
    (
        ([["Hello", "there"], ["Hi", "friend", "!"]],),
        {"is_split_into_words": True, "return_offsets_mapping": True, "padding": True},
    ),
    ((["Hello", "there"], ["Hi", "friend", "!"]), {"is_split_into_words": True, "return_token_type_ids": True}),
]


def test_call_takes_transformers_other_options(tiny_dir):
    """transformers 5.23's call takes ``return_special_tokens_mask``, ``return_token_type_ids``,
    ``return_length``, ``return_overflowing_tokens`` with ``stride``, ``is_split_into_words`` and
    ``verbose``; ours raised TypeError ("unexpected keyword argument") on each. Measured with
    AutoTokenizer on the tiny tokenizer (the values below)."""
    tok = GlmTokenizer.from_pretrained(tiny_dir)
    a = [219, 254, 88, 109, 136, 104, 2, 118, 91, 82, 123, 77]  # "Hello there <|user|> friend"
    one = tok(CALL_TEXTS[0], return_length=True, return_special_tokens_mask=True, return_token_type_ids=True)
    assert one == {  # <|user|> in the text is no special token of the mask; length is a list for one text too
        "input_ids": a,
        "token_type_ids": [0] * 12,
        "attention_mask": [1] * 12,
        "special_tokens_mask": [0] * 12,
        "length": [12],
    }
    left = tok(CALL_TEXTS, padding=True, padding_side="left", return_special_tokens_mask=True, return_length=True)
    assert left["special_tokens_mask"][1] == [1] * 10 + [0, 0] and left["length"] == [12, 12]
    pair = tok("Hello there", "Hi", return_token_type_ids=True, return_special_tokens_mask=True, verbose=False)
    assert pair["input_ids"] == [219, 254, 88, 109, 136, 49, 82] and pair["token_type_ids"] == [0] * 5 + [1, 1]
    # overflowing rows, each one token (stride 1) over the one before; one text gives a batch
    over = tok(CALL_TEXTS, return_overflowing_tokens=True, truncation=True, max_length=4, stride=1)
    assert over["input_ids"] == [[219, 254, 88, 109], [109, 136, 104, 2], [2, 118, 91, 82], [82, 123, 77], [49, 82]]
    assert over["overflow_to_sample_mapping"] == [0, 0, 0, 0, 1]
    single = tok(CALL_TEXTS[0], return_overflowing_tokens=True, truncation=True, max_length=4, stride=1)
    assert single["input_ids"] == over["input_ids"][:4] and single["overflow_to_sample_mapping"] == [0] * 4
    padded = tok(
        CALL_TEXTS, return_overflowing_tokens=True, truncation=True, max_length=4, padding=True, padding_side="left"
    )
    assert padded["input_ids"] == [[219, 254, 88, 109], [136, 104, 2, 118], [91, 82, 123, 77], [0, 0, 49, 82]]
    arrays = tok(
        CALL_TEXTS,
        return_overflowing_tokens=True,
        truncation=True,
        max_length=4,
        padding=True,
        return_length=True,
        return_tensors="np",
    )
    assert {k: v.shape for k, v in arrays.items()} == {
        "input_ids": (4, 4),
        "attention_mask": (4, 4),
        "length": (4,),
        "overflow_to_sample_mapping": (4,),
    }
    # a stride as long as a row: transformers' tokenizers panics (pyo3 PanicException); ours says so
    with pytest.raises(ValueError, match="stride"):
        tok(CALL_TEXTS, return_overflowing_tokens=True, truncation=True, max_length=4, stride=4)
    # words: each tokenized alone ("there" without its space), offsets within each word
    words = tok(["Hello", "there"], is_split_into_words=True, return_offsets_mapping=True)
    assert words["input_ids"] == [219, 254, 88, 93, 107, 136]
    assert words["offset_mapping"] == [(0, 2), (2, 4), (4, 5), (0, 1), (1, 3), (3, 5)]
    assert tok([["Hello", "there"]], [["Hi"]], is_split_into_words=True)["input_ids"] == [
        [219, 254, 88, 93, 107, 136, 49, 82]
    ]


@pytest.mark.reference
@pytest.mark.parametrize("args,kw", CALL_CASES)
def test_call_other_options_equal_transformers(tiny_dir, args, kw):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf, ours = transformers.AutoTokenizer.from_pretrained(tiny_dir), GlmTokenizer.from_pretrained(tiny_dir)
    assert dict(ours(*args, **kw)) == dict(hf(*args, **kw))
    want = hf(*args, **kw, return_tensors="np") if kw.get("padding") else None
    if want is not None:
        got = ours(*args, **kw, return_tensors="np")
        assert sorted(got) == sorted(want)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


# ---------------------------------------------------------------------- transformers' other tokenizer methods
def _methods_folder(path):
    """The tiny tokenizer with a ``[gMASK] <sop> $A`` post-processor, ``<sop>`` as bos_token and ``<x>``
    as its one extra special token (id 256)."""
    return _tiny_folder(path, post="[gMASK] <sop> $A", config={"extra_special_tokens": ["<x>"], "bos_token": "<sop>"})


METHODS_TEXT = "Hello <|user|> <x>"


def _methods_record(tok, name_or_path):
    ids = tok(METHODS_TEXT)["input_ids"]
    return (
        ids,
        tok.tokenize(METHODS_TEXT),
        tok.tokenize("Hello", add_special_tokens=True),
        tok.tokenize("Hello", "Hi", add_special_tokens=True),
        tok.all_special_tokens,
        tok.all_special_ids,
        tok.special_tokens_map,
        tok.convert_ids_to_tokens(ids, skip_special_tokens=True),
        tok.convert_tokens_to_string(tok.convert_ids_to_tokens(ids)),
        (tok.num_special_tokens_to_add(), tok.num_special_tokens_to_add(pair=True)),
        tok.get_special_tokens_mask(ids, already_has_special_tokens=True),
        np.asarray(tok.encode("Hello", return_tensors="np")).tolist(),
        tok.encode(METHODS_TEXT, truncation=True, max_length=4),
        tok.encode("Hello", padding="max_length", max_length=8, padding_side="left"),
        {i: str(t) for i, t in tok.added_tokens_decoder.items()},
        tok.added_tokens_encoder,
        (list(tok.model_input_names), tok.is_fast, tok.pad_token_type_id, str(tok.name_or_path) == str(name_or_path)),
    )


def test_transformers_tokenizer_methods(tmp_path):
    """transformers 5.23's ``tokenize``, ``convert_tokens_to_string``, ``all_special_tokens`` / ``_ids``,
    ``special_tokens_map``, ``convert_ids_to_tokens(skip_special_tokens=True)``,
    ``num_special_tokens_to_add``, ``get_special_tokens_mask(already_has_special_tokens=True)`` (what
    DataCollatorForLanguageModeling calls), ``encode`` with the call's keywords (``return_tensors``,
    ``truncation``, ``max_length``, ``padding``), ``added_tokens_decoder`` / ``_encoder``,
    ``model_input_names``, ``is_fast``, ``pad_token_type_id``, ``name_or_path``: ours had none of them
    (AttributeError, or TypeError for the keywords). Measured with AutoTokenizer on ``_methods_folder``:
    the values below."""
    folder = _methods_folder(tmp_path / "t")
    got = _methods_record(GlmTokenizer.from_pretrained(folder), folder)
    added = {i: t for i, t in enumerate(TINY_SPECIAL_TOKENS)} | {256: "<x>"}
    assert got == (
        [6, 7, 219, 254, 88, 104, 2, 104, 256],
        ["He", "ll", "o", "\u2581", "<|user|>", "\u2581", "<x>"],
        ["[gMASK]", "<sop>", "He", "ll", "o"],
        ["He", "ll", "o", "H", "i"],  # the post-processor has no pair template
        ["<sop>", "<|endoftext|>", "<|unk|>", "<|pad|>", "<x>"],
        [7, 1, 8, 0, 256],
        {"bos_token": "<sop>", "eos_token": "<|endoftext|>", "unk_token": "<|unk|>", "pad_token": "<|pad|>"},
        ["[gMASK]", "He", "ll", "o", "\u2581", "<|user|>", "\u2581"],
        "[gMASK]<sop>Hello <|user|> <x>",
        (2, 0),
        [0, 1, 0, 0, 0, 0, 0, 0, 1],
        [[6, 7, 219, 254, 88]],
        [6, 7, 219, 254],
        [0, 0, 0, 6, 7, 219, 254, 88],
        added,
        {t: i for i, t in added.items()},
        (["input_ids", "attention_mask"], True, 0, True),
    )
    with pytest.raises(NotImplementedError):
        GlmTokenizer.from_pretrained(folder).get_special_tokens_mask([5, 6])


@pytest.mark.reference
def test_transformers_tokenizer_methods_equal_transformers(tmp_path):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for folder in (_methods_folder(tmp_path / "t"), _tiny_folder(tmp_path / "plain")):
        hf = transformers.AutoTokenizer.from_pretrained(folder)
        assert _methods_record(GlmTokenizer.from_pretrained(folder), folder) == _methods_record(hf, folder)


# ---------------------------------------------------------------------- setting the special tokens
SETTERS = [  # (attribute, value) set on the tiny tokenizer
    ("pad_token", "<|endoftext|>"),  # the fine-tuning scripts' tok.pad_token = tok.eos_token
    ("pad_token", "<q>"),  # outside the vocabulary: not added, its id is unk_token_id
    ("pad_token_id", 1),
    ("eos_token", "<|user|>"),
    ("eos_token_id", 2),
    ("bos_token", "<sop>"),
    ("extra_special_tokens", ["<|user|>", "<q>"]),
]


def _setter_record(tok):
    return (
        tok("Hello <q> <|user|>", padding="max_length", max_length=10)["input_ids"],
        (tok.pad_token, tok.pad_token_id, tok.eos_token, tok.eos_token_id, tok.bos_token, tok.bos_token_id),
        (tok.unk_token_id, len(tok), sorted(tok.all_special_tokens), tok.special_tokens_map),
        tok.extra_special_tokens,
    )


def test_special_tokens_are_set_as_transformers_sets_them(tiny_dir):
    """transformers 5.23 sets a named special token or its id as an attribute (``tok.pad_token =
    tok.eos_token``, in most fine-tuning scripts; ``tok.eos_token_id = 2``) and ``extra_special_tokens``;
    ``add_special_tokens(..., replace_extra_special_tokens=False)`` extends the extra ones. Ours raised
    AttributeError ("property 'pad_token' of 'GlmTokenizer' object has no setter") and TypeError.
    Measured with AutoTokenizer on the tiny tokenizer: the values below."""
    tok = GlmTokenizer.from_pretrained(tiny_dir)
    tok.pad_token = tok.eos_token
    assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", 1)
    assert tok("Hi", padding="max_length", max_length=4)["input_ids"] == [49, 82, 1, 1]
    assert tok.special_tokens_map == {
        "eos_token": "<|endoftext|>",
        "unk_token": "<|unk|>",
        "pad_token": "<|endoftext|>",
    }
    tok.pad_token = "<q>"  # not added: id 8, the unk token's, and 256 tokens still
    assert (tok.pad_token_id, len(tok), "<q>" in tok.all_special_tokens) == (8, 256, True)
    tok.eos_token_id = 2
    assert (tok.eos_token, tok.eos_token_id) == ("<|user|>", 2)
    tok.bos_token = "<sop>"
    assert (tok.bos_token, tok.bos_token_id) == ("<sop>", 7)
    with pytest.raises(ValueError, match="non-string"):
        tok.pad_token = 5
    tok = GlmTokenizer.from_pretrained(tiny_dir)
    assert tok.add_special_tokens({"extra_special_tokens": ["<q>"]}, replace_extra_special_tokens=False) == 1
    assert tok.extra_special_tokens == ["<|user|>", "<|system|>", "<|assistant|>", "<|observation|>", "[gMASK]"] + [
        "<sop>",
        "<q>",
    ]
    assert tok("a<q>b")["input_ids"] == [74, 256, 75] and tok.decode([74, 256, 75], skip_special_tokens=True) == "ab"


@pytest.mark.reference
@pytest.mark.parametrize("attr,value", SETTERS)
def test_special_tokens_set_equal_transformers(tiny_dir, attr, value):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf, ours = transformers.AutoTokenizer.from_pretrained(tiny_dir), GlmTokenizer.from_pretrained(tiny_dir)
    for t in (hf, ours):
        setattr(t, attr, value)
    assert _setter_record(ours) == _setter_record(hf)
    for t in (hf, ours):
        t.add_special_tokens({"extra_special_tokens": ["<w>"]}, replace_extra_special_tokens=False)
    assert _setter_record(ours) == _setter_record(hf)


PAD_ASKS = [  # padding asked for, each failing in transformers 5.23 without a pad token
    lambda t: t("Hello", padding=True),
    lambda t: t(["ab", "ab"], padding=True),  # rows of equal length: nothing to pad
    lambda t: t("Hello there friend", padding="max_length", max_length=2, truncation=True),
    lambda t: t.pad({"input_ids": [[1, 2], [3, 4]]}),
    lambda t: t.apply_chat_template([{"role": "user", "content": "x"}], padding=True),
]


def test_padding_without_a_pad_token_fails_whether_or_not_rows_need_it(tmp_path):
    """transformers 5.23 raises "Asking to pad but the tokenizer does not have a padding token" whenever
    padding is asked for without a pad token (measured with AutoTokenizer on the tiny tokenizer without its
    pad_token: each of PAD_ASKS). Ours padded only rows that needed it, so a batch of equal-length rows,
    one text or a row cut to max_length passed and a later batch failed: a training run failed at a
    batch that depended on the data. Unpadded calls work in both."""
    tok = GlmTokenizer.from_pretrained(_tiny_folder(tmp_path, drop=("pad_token",)))
    assert tok.pad_token is None
    for ask in PAD_ASKS:
        with pytest.raises(ValueError, match="pad token"):
            ask(tok)
    assert tok(["a", "bb c"])["input_ids"] == [[74], [75, 75, 150]]
    assert tok.pad({"input_ids": [[1, 2], [3]]}, padding=False)["input_ids"] == [[1, 2], [3]]


@pytest.mark.reference
def test_padding_without_a_pad_token_fails_as_in_transformers(tmp_path):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(_tiny_folder(tmp_path, drop=("pad_token",)))
    assert hf.pad_token is None
    for ask in PAD_ASKS:
        with pytest.raises(ValueError, match="pad"):
            ask(hf)


def test_decode_ignores_the_keywords_transformers_ignores(tiny_dir):
    """transformers 5.23's fast ``decode`` / ``batch_decode`` take and ignore other keywords
    (``spaces_between_special_tokens``, as vLLM-style and streamer code pass it; ``output_char_offsets``):
    measured with AutoTokenizer on the tiny tokenizer, [219, 254, 88, 104, 2, 118, 1, 0] decodes to
    "Hello <|user|> f<|endoftext|><|pad|>" with spaces_between_special_tokens=False, "Hello  f" with
    skip_special_tokens=True too. Ours raised TypeError."""
    tok = GlmTokenizer.from_pretrained(tiny_dir)
    ids = [219, 254, 88, 104, 2, 118, 1, 0]
    assert tok.decode(ids, spaces_between_special_tokens=False) == "Hello <|user|> f<|endoftext|><|pad|>"
    assert tok.batch_decode([ids], skip_special_tokens=True, spaces_between_special_tokens=True) == ["Hello  f"]
    assert tok.decode(ids, True, output_char_offsets=True) == "Hello  f"


def test_save_pretrained_takes_transformers_arguments(tiny_dir, tmp_path):
    """transformers 5.23's ``save_pretrained(folder, legacy_format=..., filename_prefix=...,
    save_format="hf")`` (measured with AutoTokenizer on the tiny tokenizer): legacy_format and
    save_format="hf" write the usual files, filename_prefix="x" names them x-tokenizer.json,
    x-tokenizer_config.json (and x-chat_template.jinja). Ours raised TypeError on each keyword."""
    tok = GlmTokenizer.from_pretrained(tiny_dir)
    tok.save_pretrained(tmp_path / "a", legacy_format=True, save_format="hf")
    assert GlmTokenizer.from_pretrained(tmp_path / "a")(TEXTS)["input_ids"] == tok(TEXTS)["input_ids"]
    written = tok.save_pretrained(tmp_path / "b", filename_prefix="x")
    assert sorted(Path(w).name for w in written) == ["x-tokenizer.json", "x-tokenizer_config.json"]
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["x-tokenizer.json", "x-tokenizer_config.json"]
    with pytest.raises(TokenizerError, match="push_to_hub"):
        tok.save_pretrained(tmp_path / "c", push_to_hub=True)
    with pytest.raises(ValueError, match="save_format"):
        tok.save_pretrained(tmp_path / "c", save_format="mistral")


def test_split_special_tokens_for_one_call_as_transformers(tiny_dir, tmp_path):
    """transformers 5.23's call takes ``split_special_tokens`` for that call (measured with AutoTokenizer
    on the tiny tokenizer: "a<|user|>" -> [74, 37, 101, 94, 92, 112, 101, 39] with it, [74, 2] without);
    ours raised TypeError. The next call uses the tokenizer's own setting again; loaded with
    ``split_special_tokens=True``, a call with False gives [74, 2] (measured too)."""
    tok = GlmTokenizer.from_pretrained(tiny_dir)
    assert tok("a<|user|>", split_special_tokens=True)["input_ids"] == [74, 37, 101, 94, 92, 112, 101, 39]
    assert tok("a<|user|>")["input_ids"] == [74, 2]
    assert tok.encode("a<|user|>", split_special_tokens=True) == [74, 37, 101, 94, 92, 112, 101, 39]
    split = GlmTokenizer.from_pretrained(tiny_dir, split_special_tokens=True)
    assert split("a<|user|>", split_special_tokens=False)["input_ids"] == [74, 2]
    assert split("a<|user|>")["input_ids"] == [74, 37, 101, 94, 92, 112, 101, 39]


def _hf_saved_named_templates(path, named):
    """The tiny tokenizer with ``named`` templates laid out as transformers 5.23's save_pretrained lays
    them out: "default" in chat_template.jinja, every other one in additional_chat_templates/NAME.jinja,
    none in tokenizer_config.json."""
    make_tiny_tokenizer().save_pretrained(path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "additional_chat_templates").mkdir()
    for t in named:
        where = "chat_template.jinja" if t["name"] == "default" else f"additional_chat_templates/{t['name']}.jinja"
        (path / where).write_text(t["template"])
    return path


def test_named_chat_templates_saved_by_transformers_are_read(tmp_path):
    """transformers 5.23's save_pretrained writes a tokenizer's named chat templates as
    chat_template.jinja + additional_chat_templates/NAME.jinja, and its from_pretrained reads them back:
    measured with AutoTokenizer, on "hi", the default / tools / chat_template="other" renderings are
    "Dhi", "T1", "O" (without a default: an error, "T1", "O"). Ours ignored the folder: "Dhi", "Dhi",
    "other" (the tool_use and other templates lost; without a default: errors and "other")."""
    chat, tools = [{"role": "user", "content": "hi"}], [{"type": "function", "function": {"name": "f"}}]
    for i, (named, want) in enumerate(((NAMED_TEMPLATES, "Dhi"), (NAMED_TEMPLATES[1:], None))):
        tok = GlmTokenizer.from_pretrained(_hf_saved_named_templates(tmp_path / str(i), named))
        if want is None:
            with pytest.raises(TokenizerError, match="none named 'default'"):
                tok.apply_chat_template(chat, tokenize=False)
        else:
            assert tok.apply_chat_template(chat, tokenize=False) == want
        assert tok.apply_chat_template(chat, tokenize=False, tools=tools) == "T1"
        assert tok.apply_chat_template(chat, tokenize=False, chat_template="other") == "O"
        # saved over that folder, the template files are rewritten with the templates in use
        tok.chat_templates["other"] = "O2"
        tok.save_pretrained(tmp_path / str(i))
        assert (tmp_path / str(i) / "additional_chat_templates" / "other.jinja").read_text() == "O2"
        back = GlmTokenizer.from_pretrained(tmp_path / str(i))
        assert back.apply_chat_template(chat, tokenize=False, chat_template="other") == "O2"


@pytest.mark.reference
def test_named_chat_templates_saved_by_transformers_equal_transformers(tmp_path):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    chat, tools = [{"role": "user", "content": "hi"}], [{"type": "function", "function": {"name": "f"}}]
    for i, named in enumerate((NAMED_TEMPLATES, NAMED_TEMPLATES[1:])):
        transformers.AutoTokenizer.from_pretrained(_named_templates_folder(tmp_path / f"n{i}", named)).save_pretrained(
            tmp_path / f"hf{i}"
        )
        assert (tmp_path / f"hf{i}" / "additional_chat_templates" / "tool_use.jinja").is_file()
        hf = transformers.AutoTokenizer.from_pretrained(tmp_path / f"hf{i}")
        ours = GlmTokenizer.from_pretrained(tmp_path / f"hf{i}")
        _assert_same_chat_text(hf, ours, chat, ({}, {"tools": tools}, {"chat_template": "other"}))


MODEL_SPECIFIC = {"extra_special_tokens": {"image_token": "<img>"}, "additional_special_tokens": ["<|user|>", "<new>"]}


def _model_specific_record(tok):
    return (
        len(tok),
        tok.all_special_tokens,
        tok.all_special_ids,
        tok("a<new>b<img>")["input_ids"],
        tok.decode(tok("a<new>b<img><|user|>")["input_ids"], skip_special_tokens=True),
        (tok.image_token, tok.image_token_id),
    )


def test_additional_special_tokens_beside_a_dict_of_model_specific_ones(tmp_path):
    """A config whose ``extra_special_tokens`` is a dict of model-specific tokens (GLM's own config has
    ``{}``) and whose ``additional_special_tokens`` lists the extra ones: transformers 5.23 takes the
    list as the extra special tokens and exposes the model-specific ones as attributes. Measured with
    AutoTokenizer on the tiny tokenizer with MODEL_SPECIFIC: 258 tokens (<img> 256, <new> 257 added),
    all_special_tokens [<|endoftext|>, <|unk|>, <|pad|>, <img>, <|user|>, <new>] ([1, 8, 0, 256, 2, 257]),
    "a<new>b<img>" -> [74, 257, 75, 256], skipping special tokens "ab", ``image_token`` "<img>" with id 256.
    Ours ignored the list beside a dict: <new> was not added (257 tokens, "a<new>b" split as text) and
    ``tok.image_token`` raised AttributeError."""
    tok = GlmTokenizer.from_pretrained(_tiny_folder(tmp_path, config=MODEL_SPECIFIC))
    assert _model_specific_record(tok) == (
        258,
        ["<|endoftext|>", "<|unk|>", "<|pad|>", "<img>", "<|user|>", "<new>"],
        [1, 8, 0, 256, 2, 257],
        [74, 257, 75, 256],
        "ab",
        ("<img>", 256),
    )
    with pytest.raises(AttributeError):
        tok.video_token  # noqa: B018


@pytest.mark.reference
def test_additional_special_tokens_beside_a_dict_equal_transformers(tmp_path):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for i, config in enumerate((MODEL_SPECIFIC, {"extra_special_tokens": {}}, {"extra_special_tokens": ["<y>"]})):
        folder = _tiny_folder(tmp_path / str(i), config=config)
        hf, ours = transformers.AutoTokenizer.from_pretrained(folder), GlmTokenizer.from_pretrained(folder)
        assert _methods_record(ours, folder) == _methods_record(hf, folder)
        if i == 0:
            assert _model_specific_record(ours) == _model_specific_record(hf)


NO_LIMIT_CALLS = [  # the call's keywords on a tokenizer without model_max_length, no max_length given
    {"truncation": True},
    {"truncation": True, "padding": True},
    {"padding": "max_length"},
    {"padding": "max_length", "truncation": True, "pad_to_multiple_of": 4},
    {"truncation": "only_first"},
    {"truncation": True, "return_overflowing_tokens": True, "stride": 1},
]


def test_truncation_and_max_length_padding_without_a_limit_as_transformers(tmp_path):
    """A tokenizer without model_max_length (tokenizer_config.json without it, or
    ``from_pretrained(..., model_max_length=None)``) and no max_length: transformers 5.23 neither
    truncates nor pads to a max_length (a warning only). Measured with AutoTokenizer on the tiny
    tokenizer, ["Hello there", "Hi"]: truncation=True -> [[219, 254, 88, 109, 136], [49, 82]];
    with padding=True -> [..., [49, 82, 0, 0, 0]]; padding="max_length" -> unpadded rows. Ours raised
    "truncation=True needs max_length" (the common ``tok(texts, truncation=True, padding=True)``), and
    ``model_max_length=None`` kept the file's 4096."""
    tok = GlmTokenizer.from_pretrained(_tiny_folder(tmp_path / "a", drop=("model_max_length",)))
    texts, rows = ["Hello there", "Hi"], [[219, 254, 88, 109, 136], [49, 82]]
    assert tok(texts, truncation=True)["input_ids"] == rows
    assert tok(texts, truncation=True, padding=True)["input_ids"] == [rows[0], [49, 82, 0, 0, 0]]
    assert tok(texts, padding="max_length")["input_ids"] == rows
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], truncation=True)["input_ids"] == [6, 7, 2, 9, 97]
    unlimited = GlmTokenizer.from_pretrained(_tiny_folder(tmp_path / "b"), model_max_length=None)
    assert unlimited.model_max_length == int(1e30)
    assert unlimited(texts, truncation=True)["input_ids"] == rows


@pytest.mark.reference
def test_no_limit_calls_equal_transformers(tmp_path):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder = _tiny_folder(tmp_path / "a", drop=("model_max_length",))
    hf, ours = transformers.AutoTokenizer.from_pretrained(folder), GlmTokenizer.from_pretrained(folder)
    for kw in NO_LIMIT_CALLS:
        assert dict(ours(["Hello there", "Hi"], **kw)) == dict(hf(["Hello there", "Hi"], **kw)), kw
    assert dict(ours.pad({"input_ids": [[1, 2, 3], [4]]}, padding="max_length")) == dict(
        hf.pad({"input_ids": [[1, 2, 3], [4]]}, padding="max_length")
    )
    for cls in (transformers.AutoTokenizer, GlmTokenizer):
        assert cls.from_pretrained(_tiny_folder(tmp_path / "b"), model_max_length=None).model_max_length == int(1e30)


def test_return_attention_mask_none_is_the_default_mask(tiny_dir):
    """transformers 5.23's ``return_attention_mask=None`` (its default, which wrappers pass on) returns
    the attention mask (measured with AutoTokenizer on the tiny tokenizer: ["Hello there", "Hi"],
    padding=True -> attention_mask [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]); ours left it out, so a padded
    batch reached ``generate`` without its mask."""
    tok = GlmTokenizer.from_pretrained(tiny_dir)
    enc = tok(["Hello there", "Hi"], padding=True, return_attention_mask=None)
    assert enc["attention_mask"] == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert "attention_mask" not in tok("Hi", return_attention_mask=False)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "x"}], tokenizer_kwargs={"return_attention_mask": None}, return_dict=True
    )
    assert chat["attention_mask"] == [1] * len(chat["input_ids"])


def test_from_pretrained_subfolder_as_transformers(tmp_path):
    """``AutoTokenizer.from_pretrained(folder, subfolder="tok")`` reads folder/tok (measured with
    transformers 5.23 on the tiny tokenizer: "Hello" -> [219, 254, 88])."""
    _tiny_folder(tmp_path / "tok")
    assert GlmTokenizer.from_pretrained(tmp_path, subfolder="tok")("Hello")["input_ids"] == [219, 254, 88]


# transformers 5.23, AutoTokenizer on the tiny folder (measured): the call's text_target cases
_TARGET_CASES = [
    (("Hello there",), {"text_target": "the answer is no"},
     {"input_ids": [219, 254, 88, 109, 136], "attention_mask": [1] * 5, "labels": [93, 107, 114, 92, 96, 112, 110, 186, 88]}),
    ((["Hello there", "Hi"],), {"text_target": ["the answer is no", "yes"], "padding": True},
     {"input_ids": [[219, 254, 88, 109, 136], [49, 82, 0, 0, 0]], "attention_mask": [[1] * 5, [1, 1, 0, 0, 0]],
      "labels": [[93, 107, 114, 92, 96, 112, 110, 186, 88], [98, 116] + [0] * 7]}),
    ((), {"text_target": "the answer is no"},
     {"input_ids": [93, 107, 114, 92, 96, 112, 110, 186, 88], "attention_mask": [1] * 9}),
    ((["Hello there friend", "Hi"],),
     {"text_target": ["the answer is no", "yes"], "max_length": 3, "truncation": True, "max_target_length": 2},
     {"input_ids": [[219, 254, 88], [49, 82]], "attention_mask": [[1, 1, 1], [1, 1]], "labels": [[93, 107], [98, 116]]}),
    (("Hello",), {"text_pair": "there", "text_target": "a", "text_pair_target": "b"},
     {"input_ids": [219, 254, 88, 93, 107, 136], "attention_mask": [1] * 6, "labels": [74, 75]}),
]  # fmt: skip


def test_text_target_as_transformers(tiny_dir):
    """transformers' ``tokenizer(text, text_target=...)``: the target encoded with the same options
    (``max_target_length`` for its length, padded with the pad id) as ``labels``; the target alone
    without ``text``; neither: transformers' ValueError. Measured (_TARGET_CASES). Before: TypeError."""
    tok = GlmTokenizer.from_pretrained(tiny_dir)
    for args, kw, want in _TARGET_CASES:
        assert dict(tok(*args, **kw)) == want, kw
    enc = tok(["Hello there", "Hi"], text_target=["the answer is no", "yes"], padding=True, return_tensors="np")
    assert enc["labels"].tolist() == _TARGET_CASES[1][2]["labels"]
    with pytest.raises(ValueError, match="You need to specify either `text` or `text_target`"):
        tok()


@pytest.mark.reference
def test_text_target_equals_transformers(tiny_dir):
    """The live twin: the same calls through transformers' AutoTokenizer on the same folder."""
    hf, tok = _hf_and_ours(tiny_dir)
    for args, kw, _ in _TARGET_CASES:
        assert dict(tok(*args, **kw)) == dict(hf(*args, **kw)), kw


# transformers 5.23, AutoTokenizer on the tiny folder: get_added_vocab(), the 9 special tokens by id
TINY_ADDED_VOCAB = {
    "<|pad|>": 0, "<|endoftext|>": 1, "<|user|>": 2, "<|system|>": 3, "<|assistant|>": 4,
    "<|observation|>": 5, "[gMASK]": 6, "<sop>": 7, "<|unk|>": 8,
}  # fmt: skip


def test_vocabulary_and_template_accessors_as_transformers(tiny_dir, tmp_path):
    """transformers 5.23 on the tiny folder: ``vocab`` (256 entries, == get_vocab()),
    ``get_added_vocab()`` (TINY_ADDED_VOCAB), ``max_len_single_sentence`` and
    ``max_len_sentences_pair`` 4096 (model_max_length 4096, no token added), ``backend_tokenizer`` a
    ``tokenizers.Tokenizer``, ``get_chat_template()`` the template (a name of the named ones or a text
    given: that one; tools: "tool_use"; none at all: ValueError), ``clean_up_tokenization("a . b , c
    ! d ? e n't f 'm g 's h 've i 're")`` -> "a. b, c! d? en't f'm g's h've i're". Each was an
    AttributeError here."""
    import tokenizers

    tok = GlmTokenizer.from_pretrained(tiny_dir)
    assert len(tok.vocab) == 256 and tok.vocab == tok.get_vocab()
    assert tok.get_added_vocab() == TINY_ADDED_VOCAB and list(tok.get_added_vocab()) == list(TINY_ADDED_VOCAB)
    assert tok.max_len_single_sentence == tok.max_len_sentences_pair == tok.model_max_length == 4096
    assert isinstance(tok.backend_tokenizer, tokenizers.Tokenizer) and tok.backend_tokenizer is tok.tokenizer
    assert tok.get_chat_template() == tok.chat_template and tok.get_chat_template("nope") == "nope"
    named = GlmTokenizer.from_pretrained(_named_templates_folder(tmp_path / "named", NAMED_TEMPLATES))
    assert named.get_chat_template() == NAMED_TEMPLATES[0]["template"]
    assert named.get_chat_template(tools=[{"x": 1}]) == named.get_chat_template("tool_use") == "T{{ tools | length }}"
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tok.get_chat_template()
    text = "a . b , c ! d ? e n't f 'm g 's h 've i 're"
    assert GlmTokenizer.clean_up_tokenization(text) == "a. b, c! d? en't f'm g's h've i're"
    tok.add_special_tokens({"additional_special_tokens": ["<extra>"]})  # an added token follows
    assert tok.get_added_vocab() == TINY_ADDED_VOCAB | {"<extra>": 256} and len(tok.vocab) == 257


@pytest.mark.reference
def test_vocabulary_and_template_accessors_equal_transformers(tiny_dir):
    """The live twin: each accessor above equal to AutoTokenizer's on the tiny folder, an added
    special token included."""
    hf, ours = _hf_and_ours(tiny_dir)
    for t in (hf, ours):
        t.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    assert ours.vocab == hf.vocab and ours.get_added_vocab() == hf.get_added_vocab()
    assert list(ours.get_added_vocab()) == list(hf.get_added_vocab())
    assert (ours.max_len_single_sentence, ours.max_len_sentences_pair) == (
        hf.max_len_single_sentence,
        hf.max_len_sentences_pair,
    )
    text = "Hello world! <extra> The sea is blue."
    assert ours.backend_tokenizer.encode(text).ids == hf.backend_tokenizer.encode(text).ids
    assert ours.backend_tokenizer.get_vocab() == hf.backend_tokenizer.get_vocab()
    for args in ((), ("nope",)):
        assert ours.get_chat_template(*args) == hf.get_chat_template(*args)
    text = "a . b , c ! d ? e n't f 'm g 's h 've i 're ' x"
    assert ours.clean_up_tokenization(text) == hf.clean_up_tokenization(text)


def test_chat_template_sees_plain_values_as_transformers_hands_them():
    """transformers 5.23 rebuilds what a chat template sees from JSON's types (measured with GLM-4.6's
    template): a numpy number in a tool call's arguments renders as the number (ours: TypeError 'int64
    is not JSON serializable' from tojson), a str enum role as its value ('<|user|>'; ours rendered
    '<|Role.USER|>'), an array in a content block as "<ndarray>"; documents that are not objects and
    tools that are not schemas are refused (ours rendered them as they were)."""
    import enum

    tok = make_tiny_tokenizer()

    class Role(str, enum.Enum):
        USER = "user"

    plain = tok.apply_chat_template(CHAT[:2], tokenize=False)
    rich = [{"role": "system", "content": CHAT[0]["content"]}, {"role": Role.USER, "content": CHAT[1]["content"]}]
    assert tok.apply_chat_template(rich, tokenize=False) == plain
    call = {"name": "f", "arguments": {"n": 3, "t": 1.5}}
    turn = [CHAT[1], {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}]
    numpy_call = {"name": "f", "arguments": {"n": np.int64(3), "t": np.float32(1.5)}}
    numpy_turn = [
        CHAT[1],
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": numpy_call}]},
    ]
    assert tok.apply_chat_template(numpy_turn, tokenize=False) == tok.apply_chat_template(turn, tokenize=False)
    blocks = [{"role": "user", "content": [{"type": "image", "image": np.zeros(3)}, {"type": "text", "text": "hi"}]}]
    placeholder = [
        {"role": "user", "content": [{"type": "image", "image": "<ndarray>"}, {"type": "text", "text": "hi"}]}
    ]
    assert tok.apply_chat_template(blocks, tokenize=False) == tok.apply_chat_template(placeholder, tokenize=False)
    with pytest.raises(TokenizerError, match="documents: expected a list of objects"):
        tok.apply_chat_template(CHAT[:2], documents=["not an object"], tokenize=False)
    with pytest.raises(TokenizerError, match="tools: each tool must be a JSON schema object"):
        tok.apply_chat_template(CHAT[:2], tools=["not a schema"], tokenize=False)


def test_a_batch_of_text_pairs_and_encode_of_a_batch_as_transformers():
    """transformers 5.23 (measured, tiny checkpoint): ``tok([("hello", "world"), ("a", "b c")])`` encodes
    each couple as a pair, and ``tok.encode(["hello", "world"])`` gives each text's ids; ours raised
    TypeError / the tokenizers library's 'TextInputSequence must be str'."""
    tok = make_tiny_tokenizer()
    couples = [("hello", "world"), ("a", "b c")]
    assert tok(couples)["input_ids"] == tok(["hello", "a"], ["world", "b c"])["input_ids"]
    assert tok.encode(["hello", "world"]) == [tok.encode("hello"), tok.encode("world")]


@pytest.mark.reference
def test_a_batch_of_text_pairs_and_encode_of_a_batch_equal_transformers(tiny_dir):
    hf, ours = _hf_and_ours(tiny_dir)
    couples = [("hello", "world"), ("a", "b c")]
    assert ours(couples)["input_ids"] == hf(couples)["input_ids"]
    assert ours.encode(["hello", "world"]) == hf.encode(["hello", "world"])


def test_generate_command_takes_a_file_asking_for_output_dicts_and_an_empty_system_turn(tiny_dir, tmp_path, capsys):
    """Measured before: a generation_config.json with ``return_dict_in_generate: true`` (a transformers key
    generate() takes) made ``glm52 generate --num-beams 2`` (and every launched run) end in an
    AttributeError traceback; ``--system ""`` dropped the empty system turn the template renders."""
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, folder)
    plain = ["generate", "--model", str(folder), "--prompt", "hello", "--max-new-tokens", "4", "--num-beams", "2"]
    assert main(plain) == 0
    want = capsys.readouterr().out
    (folder / "generation_config.json").write_text('{"return_dict_in_generate": true, "eos_token_id": [1, 2]}')
    assert main(plain) == 0
    assert capsys.readouterr().out == want
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    chat = ["generate", "--model", str(tiny_dir), "--prompt", "hi", "--chat", "--max-new-tokens", "6"]
    assert main([*chat, "--system", ""]) == 0
    printed = capsys.readouterr().out
    tok = GlmTokenizer.from_pretrained(tiny_dir)
    msgs = [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    model = GlmMoeDsaForCausalLM.from_pretrained(tiny_dir)
    out = model.generate(paddle.to_tensor([ids]), max_new_tokens=6, eos_token_id=[1, 2]).numpy()[0, len(ids) :]
    out = out[: np.argmax(np.isin(out, [1, 2])) + 1] if np.isin(out, [1, 2]).any() else out
    assert printed == tok.decode(out.tolist(), skip_special_tokens=True) + "\n"
