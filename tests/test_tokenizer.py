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
    assert tok.apply_chat_template(CHAT[:2], add_generation_prompt=True) == tok.encode(text)


def test_assistant_mask_covers_exactly_the_assistant_turns():
    tok = make_tiny_tokenizer()
    ids, mask = tok.encode_chat_for_training(CHAT)
    assert len(ids) == len(mask)
    assert ids == tok.apply_chat_template(CHAT)
    # the masked tokens, read back: each assistant answer and the <|endoftext|> that closes its turn
    pieces, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            pieces.append(tok.decode(cur))
            cur = []
    if cur:
        pieces.append(tok.decode(cur))
    assert pieces == ["The capital of France is Paris.<|endoftext|>", "Four.<|endoftext|>"]
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
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    out = model.generate(paddle.to_tensor([ids]), max_new_tokens=6, eos_token_id=[1, 2]).numpy()[0, len(ids) :]
    out = out[: np.argmax(np.isin(out, [1, 2])) + 1] if np.isin(out, [1, 2]).any() else out
    assert printed == tok.decode(out.tolist(), skip_special_tokens=True) + "\n"


def test_generate_command_without_tokenizer_fails_cleanly(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err


def test_generate_command_speculative_prints_the_same_text(tiny_dir, capsys):
    args = ["generate", "--model", tiny_dir, "--prompt", "Hello there", "--max-new-tokens", "5"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--speculative"]) == 0
    cap = capsys.readouterr()
    assert cap.out == plain
    assert "acceptance rate" in cap.err
