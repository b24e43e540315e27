"""``glm52 generate``: stream text from a checkpoint folder with its tokenizer (greedy, sampled or
speculative with the MTP layer), thin over ``generation.generate`` / ``generate_speculative``."""

from __future__ import annotations

import argparse

import numpy as np


def register_generate(sub: argparse._SubParsersAction) -> None:
    """Add ``generate`` to the glm52 CLI (see cli.COMMANDS)."""
    p = sub.add_parser("generate", help="generate text from a checkpoint folder with its tokenizer (streamed)")
    p.add_argument("--model", required=True, help="checkpoint folder (config.json, safetensors, tokenizer.json)")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    p.add_argument("--system", default=None, help="with --chat: a system message before the prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--speculative", action="store_true", help="greedy, drafting with the MTP layer (acceptance rate on stderr)"
    )

    def run(args: argparse.Namespace) -> int:
        import sys

        import paddle

        from ..generation import eos_ids, generate, generate_speculative
        from ..modeling.model import GlmMoeDsaForCausalLM
        from ..tokenizer import GlmTokenizer, TokenizerError

        try:
            tok = GlmTokenizer.from_pretrained(args.model)
            if args.chat:
                msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
                    {"role": "user", "content": args.prompt}
                ]
                ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
            else:
                ids = tok.encode(args.prompt)
        except TokenizerError as err:
            print(f"glm52 generate: {err}", file=sys.stderr)
            return 2
        if not ids:
            print("glm52 generate: the prompt encodes to no tokens", file=sys.stderr)
            return 2
        model = GlmMoeDsaForCausalLM.from_pretrained(args.model, dtype=args.dtype)
        if max(ids) >= model.config.vocab_size:
            print(f"glm52 generate: token id {max(ids)} >= vocab_size {model.config.vocab_size}", file=sys.stderr)
            return 2
        eos = eos_ids(None, model.config)
        if tok.eos_token_id is not None and tok.eos_token_id not in eos:
            eos.append(tok.eos_token_id)
        new: list[int] = []
        shown = ""

        def stream(step_tokens: np.ndarray) -> None:
            nonlocal shown
            new.append(int(step_tokens[0]))
            text = tok.decode(new, skip_special_tokens=True)
            if text.startswith(shown):  # print what this token added (a character may span tokens)
                sys.stdout.write(text[len(shown) :])
                sys.stdout.flush()
                shown = text

        if args.speculative:
            if args.do_sample:
                print("glm52 generate: --speculative decodes greedily; drop --do-sample", file=sys.stderr)
                return 2
            out, stats = generate_speculative(
                model, paddle.to_tensor([ids], dtype="int64"), args.max_new_tokens, eos_token_id=eos
            )
            for t in out.numpy()[0, len(ids) :]:
                stream(np.asarray([t]))
            sys.stdout.write("\n")
            print(
                f"[speculative] drafted {stats['drafted']}, accepted {stats['accepted']} "
                f"(acceptance rate {stats['acceptance_rate']:.2f}), {stats['main_forwards']} main forwards",
                file=sys.stderr,
            )
            return 0
        generate(
            model,
            paddle.to_tensor([ids], dtype="int64"),
            max_new_tokens=args.max_new_tokens,
            do_sample=args.do_sample,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            eos_token_id=eos,
            seed=args.seed,
            streamer=stream,
        )
        sys.stdout.write("\n")
        return 0

    p.set_defaults(func=run)
