"""The embedded default: a tiny GLM-5.2 checkpoint in the official HF layout, made deterministically.

`configs/glm52-tiny/config.json` has the official structure (8 layers with shared indexer layers,
dense first layers, grouped MoE, one MTP layer); weights are drawn from a seeded numpy generator
(N(0, initializer_range), norms 1, biases 0 -- HF's init) so every machine makes the same bytes,
and written like the official release: bf16, two shards, `model.safetensors.index.json`.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from .configuration import GlmMoeDsaConfig

_CANDIDATES = [
    Path(__file__).resolve().parent / "_data" / "configs" / "glm52-tiny" / "config.json",  # installed wheel
    Path(__file__).resolve().parents[1] / "configs" / "glm52-tiny" / "config.json",  # source tree / editable install
]
TINY_CONFIG = next((p for p in _CANDIDATES if p.is_file()), _CANDIDATES[-1])


def tiny_config(**overrides) -> GlmMoeDsaConfig:
    if not TINY_CONFIG.is_file():
        raise FileNotFoundError(f"tiny config not found at {TINY_CONFIG} (install the project with `pip install -e .`)")
    return GlmMoeDsaConfig.from_pretrained(TINY_CONFIG, **overrides)


def init_state(config: GlmMoeDsaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Fleet-named fp32 arrays with HF's init, from a seeded numpy generator (platform independent)."""
    from .checkpoint import fleet_param_specs

    rng = np.random.default_rng(seed)
    std = float(config.initializer_range)
    out = {}
    for name, (shape, _kind) in fleet_param_specs(config).items():
        if len(shape) == 2:
            out[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        else:
            fill = 0.0 if name.endswith(("k_norm.bias", "e_score_correction_bias")) else 1.0  # else norm weights
            out[name] = np.full(shape, fill, np.float32)
    return out


def make_tiny_checkpoint(
    out_dir: str | os.PathLike, seed: int = 0, max_shard_size: str = "1MB", indexer_loss_coeff: float = 0.0
) -> str:
    """Write the tiny official-layout checkpoint to `out_dir` (atomic), with its tokenizer
    (tokenizer.json, tokenizer_config.json incl. the chat template), and return its path.
    `indexer_loss_coeff` > 0 goes into config.json: training then adds the indexer KL loss."""
    import paddle

    from .checkpoint import save_pretrained_state

    if indexer_loss_coeff < 0:
        raise ValueError(f"indexer_loss_coeff must be >= 0, got {indexer_loss_coeff}")
    config = tiny_config(indexer_loss_coeff=indexer_loss_coeff) if indexer_loss_coeff else tiny_config()
    state = {k: paddle.to_tensor(v) for k, v in init_state(config, seed).items()}
    # the tokenizer travels in the checkpoint's temporary folder (carried as a model save carries its
    # source's): one publish puts weights and tokenizer in place, so no kill or failure leaves the new
    # weights beside an old tokenizer, or none
    with tempfile.TemporaryDirectory(prefix="glm52-tiny-tokenizer-") as tokenizer_dir:
        make_tiny_tokenizer(config.vocab_size).save_pretrained(tokenizer_dir)
        save_pretrained_state(
            state, config, out_dir, layout="hf", max_shard_size=max_shard_size, carry_from=tokenizer_dir
        )
    return os.fspath(out_dir)


# The tiny tokenizer's training text: a few paragraphs of plain English and chat phrases, so that
# the 256-entry vocabulary holds common words and the chat template's pieces. Any printable ASCII
# text encodes (the alphabet is all of it); other characters become <|unk|>.
TINY_CORPUS = """\
Hello! How are you today? I am fine, thank you. What can I do for you?
The quick brown fox jumps over the lazy dog. A model reads text as tokens and writes text back.
You are a helpful assistant. Answer the question in one short sentence.
What is the capital of France? The capital of France is Paris.
What is two plus two? Two plus two is four. Three and five make eight.
Please write a short poem about the sea. The sea is blue and deep, the waves are slow and wide.
The weather is nice this morning, and the sun is warm on the water.
GLM is a language model. It has layers of attention and experts, and it learns from data.
Training makes the loss go down; the model then generates the next token, one after another.
This is a test. This is only a test. Thank you for reading this text.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ( ) [ ] { } " ' - _ / + = * & % $ # @.
"""
TINY_SPECIAL_TOKENS = [
    "<|pad|>",  # 0 = pad_token_id of the tiny config
    "<|endoftext|>",  # 1 and 2 = its eos_token_id, as GLM stops on <|endoftext|> and <|user|>
    "<|user|>",
    "<|system|>",
    "<|assistant|>",
    "<|observation|>",
    "[gMASK]",
    "<sop>",
    "<|unk|>",
]
# GLM-style turns; an assistant turn ends with <|endoftext|> so training teaches the model to stop.
TINY_CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for m in messages %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}{% if m['role'] == 'assistant' %}<|endoftext|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def make_tiny_tokenizer(vocab_size: int | None = None):
    """A byte-pair-encoding tokenizer with `vocab_size` entries (default the tiny config's), trained
    with the `tokenizers` library on TINY_CORPUS: the same merges on every machine."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from .tokenizer import GlmTokenizer

    vocab_size = int(vocab_size or tiny_config().vocab_size)
    tok = Tokenizer(models.BPE(unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tok.decoder = decoders.Metaspace(prepend_scheme="never")
    alphabet = sorted(set(string.printable) - set("\t\r\x0b\x0c ")) + ["\u2581"]  # \u2581 stands for a space
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=TINY_SPECIAL_TOKENS,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(TINY_CORPUS.splitlines(), trainer)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(tiny_config().max_position_embeddings),
        "eos_token": "<|endoftext|>",
        "pad_token": "<|pad|>",
        "unk_token": "<|unk|>",
        "additional_special_tokens": TINY_SPECIAL_TOKENS[2:8],
        "clean_up_tokenization_spaces": False,
    }
    return GlmTokenizer(tok, config, TINY_CHAT_TEMPLATE)


def register_make_tiny(sub) -> None:
    p = sub.add_parser("make-tiny", help="write the tiny official-layout GLM-5.2 checkpoint (the embedded default)")
    p.add_argument("out", help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-size", default="1MB", help="shard size limit (default 1MB: two shards)")
    p.add_argument(
        "--indexer-loss-coeff",
        type=float,
        default=0.0,
        help="indexer_loss_coeff in config.json (> 0: training adds the DSA indexer KL loss)",
    )

    def run(args) -> int:
        from .cli._common import output_folder_error

        if bad := output_folder_error(args.out, "OUT"):
            print(f"make-tiny: {bad}", file=sys.stderr)
            return 2
        coeff = args.indexer_loss_coeff
        if args.seed < 0 or not (math.isfinite(coeff) and coeff >= 0):  # numpy's and the config's words name neither
            flag, want, got = ("--seed", "an integer >= 0", args.seed)
            if args.seed >= 0:
                flag, want, got = ("--indexer-loss-coeff", "a finite number >= 0", coeff)
            print(f"make-tiny: {flag} must be {want}, got {got}", file=sys.stderr)
            return 2
        try:
            path = make_tiny_checkpoint(
                args.out, seed=args.seed, max_shard_size=args.max_shard_size, indexer_loss_coeff=args.indexer_loss_coeff
            )
        except ValueError as e:  # a bad --max-shard-size: one line
            print(f"make-tiny: {e}", file=sys.stderr)
            return 2
        except OSError as e:  # a full disk: one line naming OUT and the file (write / fsync errors name none)
            where = f" ({e.filename})" if e.filename else ""
            print(f"make-tiny: cannot write {args.out}: {e.strerror or e}{where}", file=sys.stderr)
            return 2
        print(f"tiny GLM-5.2 checkpoint (official HF layout) written to {path}: {', '.join(sorted(os.listdir(path)))}")
        return 0

    p.set_defaults(func=run)
