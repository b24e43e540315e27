"""The checkpoint tokenizer: loading, the tiny BPE tokenizer, the chat template and its assistant mask,
and `glm52 generate`."""

import json
from pathlib import Path

import numpy as np
import paddle
import pytest

from paddleformers_glm.cli import main
from paddleformers_glm.tiny import TINY_CHAT_TEMPLATE, make_tiny_checkpoint, make_tiny_tokenizer, tiny_config
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


def test_generate_command_speculative_takes_the_checkpoint_lengths_and_refuses_what_it_cannot_honour(
    tiny_dir, tmp_path, capsys
):
    """--speculative generates as many tokens as the plain command (generation_config.json's
    max_new_tokens: before, the default 20 instead of the file's 3), and refuses the options its
    greedy drafting does not apply instead of dropping them (before: --repetition-penalty and --stop
    were ignored, rc 0)."""
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3}))
    args = ["generate", "--model", str(folder), "--prompt", "Hello there"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--speculative"]) == 0
    assert capsys.readouterr().out == plain
    for extra, name in ((["--repetition-penalty", "3.0"], "repetition"), (["--stop", "z"], "stop")):
        assert main([*args, "--speculative", *extra]) == 2
        err = capsys.readouterr().err
        assert name in err and len(err.strip().splitlines()) == 1, err


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
GEN_CASES = [
    (GEN_TEMPLATE, GEN_CHAT, ["Four.", "Hello! How are you today?"]),
    (
        GEN_STRADDLE,
        [{"role": "user", "content": "The capital of France?"}, {"role": "assistant", "content": "s."}],
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


@pytest.mark.parametrize("template,chat,answers", GEN_CASES)
def test_generation_blocks_are_the_assistant_mask(template, chat, answers):
    """A template with `{% generation %}` blocks renders (it used to be a syntax error: "unknown tag
    'generation'") and its training mask is HF's assistant_masks: measured with transformers 5.23,
    the runs below (no <|endoftext|> where the template leaves it outside the block; the token "is"
    that straddles a block's start is marked)."""
    tok = make_tiny_tokenizer()
    tok.chat_template = template
    ids, mask = tok.encode_chat_for_training(chat)
    assert ids == tok.apply_chat_template(chat, return_dict=False)
    assert _runs(tok, ids, mask) == answers


@pytest.mark.reference
@pytest.mark.parametrize("template,chat,answers", GEN_CASES)
def test_generation_mask_equals_hf_assistant_masks(tiny_dir, template, chat, answers):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(tiny_dir)
    hf.chat_template = template
    want = hf.apply_chat_template(chat, return_dict=True, return_assistant_tokens_mask=True)
    tok = GlmTokenizer.from_pretrained(tiny_dir)
    tok.chat_template = template
    ids, mask = tok.encode_chat_for_training(chat)
    assert ids == want["input_ids"] and [int(m) for m in mask] == want["assistant_masks"]


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
