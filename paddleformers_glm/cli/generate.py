"""``glm52 generate``: stream text from a checkpoint folder with its tokenizer.

Every argument is checked before Paddle is imported or the model is read: values (ranges,
finiteness) and the length bound (prompt + new tokens against the checkpoint's
``max_position_embeddings``), each refusal one line and exit 2. Unset options take the
checkpoint's ``generation_config.json``, then transformers' defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from ._common import model_folder_error


def check_arguments(args: argparse.Namespace) -> str | None:
    """A one-line complaint about a value no run could use, or None."""
    if args.system is not None and not args.chat:  # the plain prompt has no turns: it was dropped unsaid
        return "--system needs --chat (the system message is a turn of the chat template)"
    for flag, texts in (("--prompt", [args.prompt]), ("--system", [args.system]), ("--stop", args.stop)):
        for text in texts:
            if bad := _undecoded(text):
                return f"{flag} {bad}"
    if args.pp > 1 and args.speculative:
        return "--speculative needs --pp 1 (the MTP layer drafts from the last stage's hidden states)"
    if args.tp == 1 and args.ep == 1 and args.pp == 1:  # nothing is launched: a launch flag would be dropped unsaid
        given = {
            "--log-dir": args.log_dir is not None,
            "--nnodes": args.nnodes != 1,
            "--master": args.master is not None,
            "--node-rank": args.node_rank is not None,
            "--launcher-args": bool(args.launcher_args),
            "--job-timeout": args.job_timeout is not None,
            "--rendezvous-timeout": args.rendezvous_timeout is not None,
        }
        for flag, used in given.items():
            if used:
                return (
                    f"{flag} needs --tp, --ep or --pp (it sets how the ranks are launched; one process runs without it)"
                )
    for flag, v, low, inclusive, high in (
        ("--max-new-tokens", args.max_new_tokens, 1, True, None),  # transformers refuses 0
        ("--max-length", args.max_length, 1, True, None),
        ("--top-k", args.top_k, 0, True, None),
        ("--temperature", args.temperature, 0.0, False, None),
        ("--top-p", args.top_p, 0.0, True, 1.0),  # transformers takes 0 (the most likely token only)
        ("--repetition-penalty", args.repetition_penalty, 0.0, False, None),
        ("--num-beams", args.num_beams, 1, True, None),
        ("--tp", args.tp, 1, True, None),
        ("--ep", args.ep, 1, True, None),
        ("--pp", args.pp, 1, True, None),
        ("--seed", args.seed, 0, True, None),  # numpy's generator takes no negative seed
    ):
        if v is None:
            continue
        if isinstance(v, float) and not math.isfinite(v):
            return f"{flag} must be a finite number, got {v}"
        bad = v < low if inclusive else v <= low
        if bad or (high is not None and v > high):
            rng = f"{'>=' if inclusive else '>'} {low}" + (f" and <= {high}" if high is not None else "")
            return f"{flag} must be {rng}, got {v}"
    return None


def _undecoded(text: str | None) -> str | None:
    """What is wrong with a command-line text holding bytes the locale's encoding could not decode, or
    None.  Python keeps such bytes as lone surrogates (U+DC80-U+DCFF), which the tokenizer refuses with
    a bare TypeError.  Refused rather than guessed: the same bytes are other characters in each legacy
    encoding (0xe9 is é in latin-1, щ in cp1251), so only the user knows what was meant."""
    if text is None:
        return None
    for i, ch in enumerate(text):
        if "\udc80" <= ch <= "\udcff":
            return (
                f"is not {sys.getfilesystemencoding()} text: byte 0x{ord(ch) - 0xDC00:02x} at character {i} "
                "(a shell or script writing another encoding): give the text in the locale's encoding"
            )
    return None


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from ..configuration import GlmMoeDsaConfig
    from ..generation import GenerationConfig, check_generation_length, resolve_settings
    from ..tokenizer import GlmTokenizer, TokenizerError

    def fail(msg: str) -> int:
        print(f"glm52 generate: error: {msg.removeprefix('generate: ')}", file=sys.stderr)
        return 2

    bad = check_arguments(args) or model_folder_error(args.model)
    if bad:
        return fail(bad)
    try:
        config = GlmMoeDsaConfig.from_pretrained(args.model)
        defaults = GenerationConfig.from_pretrained(args.model, config)
        tok = GlmTokenizer.from_pretrained(args.model)
        if args.chat:
            msgs = [{"role": "system", "content": args.system}] if args.system is not None else []
            msgs.append({"role": "user", "content": args.prompt})
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
        else:
            ids = tok.encode(args.prompt, add_special_tokens=False)
        if not ids:
            return fail("the prompt encodes to no tokens")
        if max(ids) >= config.vocab_size:
            return fail(f"token id {max(ids)} >= vocab_size {config.vocab_size} of {args.model}/config.json")
        # the generation options given on the command line (HF names); unset ones are left out
        names = (
            "max_new_tokens",
            "max_length",
            "do_sample",
            "temperature",
            "top_p",
            "top_k",
            "repetition_penalty",
            "num_beams",
        )
        given = {k: getattr(args, k) for k in names} | {"stop_strings": args.stop or None}
        opts = {k: v for k, v in given.items() if v is not None}
        limits = opts if "max_new_tokens" in opts or "max_length" in opts else vars(defaults)
        check_generation_length(config, len(ids), limits.get("max_new_tokens"), limits.get("max_length"))
        defaults.check_supported()
        eos = defaults.eos_token_id
        eos = list(eos) if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
        if tok.eos_token_id is not None and tok.eos_token_id not in eos:
            eos.append(tok.eos_token_id)
        # every option resolved here as generate resolves it (the call's over generation_config.json's),
        # so a combination no run can use (--num-beams 2 --speculative, or num_beams 2 in the file) is
        # one line before the model is read or any rank launched, not a traceback on every rank
        with warnings.catch_warnings():  # warned where generate resolves them, as before
            warnings.simplefilter("ignore")
            settings = resolve_settings(config, defaults, _call_options(opts, eos, args.speculative), len(ids))
        unused = [f"--{k.replace('_', '-')}" for k in ("temperature", "top_k", "top_p") if k in opts]
        if unused and not settings.do_sample:  # greedy printed the same text whatever they said (transformers warns)
            print(
                f"glm52 generate: note: {', '.join(unused)} only apply when sampling (--do-sample, or do_sample in "
                f"{args.model}/generation_config.json): greedy decoding ignores them",
                file=sys.stderr,
            )
        if args.speculative and not getattr(config, "num_mtp_layers", 0):
            raise ValueError("generate: use_mtp needs an MTP layer (num_nextn_predict_layers = 0)")
    except (TokenizerError, ValueError, OSError) as err:
        return fail(str(err))

    new: list[int] = []
    shown = 0  # characters of the new text printed so far

    def stream(step_tokens: np.ndarray | None) -> None:
        """Print what the text gained with this token (None: the end, print what is left). A
        byte-level tokenizer splits some characters over tokens: until the rest arrives the text
        ends in U+FFFD, held back (as transformers' TextStreamer holds back an unfinished word)."""
        nonlocal shown
        if step_tokens is not None:
            new.append(int(step_tokens[0]))
        text = tok.decode(new, skip_special_tokens=True)
        if step_tokens is not None and text.endswith("\ufffd"):
            return
        sys.stdout.write(text[shown:])
        sys.stdout.flush()
        shown = len(text)

    beams = (opts.get("num_beams") or getattr(defaults, "num_beams", None) or 1) > 1  # text known at its end
    if args.tp > 1 or args.ep > 1 or args.pp > 1:
        from ..train.stop_signals import listening

        with listening():  # undone after the job: a Python caller going on gets its signals as before
            ran = _run_launched(args, config, ids, opts, eos, beams, stream)
        if isinstance(ran, str):
            if new:  # the streamed text's line ends before the complaint's
                sys.stdout.write("\n")
            return fail(ran)
        if isinstance(ran, int):
            return ran
        chosen, stats = ran
    else:
        import paddle

        from ..generation import generate
        from ..modeling import GlmMoeDsaForCausalLM

        try:
            model = GlmMoeDsaForCausalLM.from_pretrained(args.model, dtype=args.dtype)
        except (ValueError, OSError) as err:  # a torn or missing shard (CheckpointError is a ValueError)
            return fail(str(err))
        stats = {}  # --speculative: the MTP drafter's counts
        if args.speculative:
            opts |= {"use_mtp": True, "stats": stats}
        try:
            out = generate(
                model,
                paddle.to_tensor([ids], dtype="int64"),
                generation_config=defaults,
                eos_token_id=eos,
                seed=args.seed,
                streamer=None if beams else stream,
                tokenizer=tok,
                return_dict_in_generate=False,  # the ids, whatever generation_config.json says
                **opts,
            )
        except ValueError as err:
            return fail(str(err))
        chosen = out.numpy()[0, len(ids) :].tolist() if beams else []  # else streamed already
    if beams:
        for t in chosen:
            stream(np.asarray([t]))
    stream(None)
    sys.stdout.write("\n")
    if stats:
        print(
            f"[speculative] drafted {stats['drafted']}, accepted {stats['accepted']} "
            f"(acceptance rate {stats['acceptance_rate']:.2f}), {stats['main_forwards']} main forwards",
            file=sys.stderr,
        )
    return 0


def _call_options(opts: dict, eos: list[int], speculative: bool) -> dict:
    """The options ``generate`` is called with (here and on each launched rank), as HF names them."""
    return opts | {"eos_token_id": eos, "return_dict_in_generate": False} | ({"use_mtp": True} if speculative else {})


def _run_launched(
    args: argparse.Namespace, config: Any, ids: list[int], opts: dict, eos: list[int], beams: bool, stream: Callable
) -> tuple[list[int], dict] | str | int:
    """``--tp`` / ``--ep`` / ``--pp``: the generation on launched ranks (generation/launched.py), the layout,
    the launch flags and the checkpoint's files checked first; this node's first rank's tokens
    streamed through ``stream`` as it appends them. -> (the new tokens, the drafter's counts), a
    complaint for one line and exit 2, or a failed job's exit status (its message printed)."""
    import shutil
    import tempfile

    from .._io import read_json, write_record
    from ..generation.launched import layout_of
    from ..parallel.topology import ParallelConfig, ParallelConfigError
    from ..train.command import check_checkpoint_files, check_launch_numbers, launch_from_args, node_rank_of
    from ..train.glm_adapter import check_glm_sizes, glm_parallel_sizes
    from ..train.launch import LaunchError
    from ..train.out_lock import OutInUse, OutUnusable, hold_out_folder

    world, dims = layout_of({"tp": args.tp, "ep": args.ep, "pp": args.pp})
    sizes = glm_parallel_sizes(config)
    try:
        pc = ParallelConfig.from_world(world, **dims)
        pc.validate(world, **sizes)
        check_glm_sizes(config, pc)
        check_launch_numbers(world, args.job_timeout, args.comm_timeout, args.nnodes)
        node_rank = node_rank_of(args)
        check_checkpoint_files(args.model)  # a torn shard: one line here, not a failed rank after the launch
    except (ParallelConfigError, ValueError, OSError) as err:
        return str(err)
    root = os.path.abspath(args.log_dir or tempfile.mkdtemp(prefix="glm52-generate-"))
    log_dir = root if node_rank is None else os.path.join(root, f"node{node_rank}")  # a shared --log-dir
    nproc = world // args.nnodes
    first = (node_rank or 0) * nproc  # this node's first global rank
    out = os.path.join(log_dir, "generate")
    held = contextlib.ExitStack()  # the folder, for the run: a second run there rewrote generate.json under it
    try:
        os.makedirs(out, exist_ok=True)
        held.enter_context(hold_out_folder(log_dir, lock=os.path.join(log_dir, "generate.lock"), refusal=_IN_USE))
        _clear_results(out)  # a reused --log-dir: no earlier run's tokens (and nothing else touched)
    except OutInUse as err:
        return str(err)
    except (OSError, OutUnusable) as err:
        held.close()
        reason = str(err) if isinstance(err, OutUnusable) else f"{err.strerror or err} ({err.filename or out})"
        return f"--log-dir {args.log_dir or root}: {reason}"
    with held:
        spec = {
            "tp": args.tp,
            "ep": args.ep,
            "pp": args.pp,
            "model": os.path.abspath(args.model),
            "dtype": args.dtype,
            "ids": ids,
        }
        spec |= {"opts": opts, "eos": eos, "seed": args.seed, "speculative": args.speculative, "beams": beams}
        spec |= {"sizes": sizes, "out": out}
        run_json = os.path.join(log_dir, "generate.json")
        write_record(run_json, spec)
        done = threading.Event()
        tokens = os.path.join(out, f"tokens.rank{first}")
        follow = threading.Thread(target=_follow, args=(tokens, done, stream), daemon=True)
        if not beams:
            follow.start()
        try:
            launch_from_args(["--generate", run_json], world, log_dir, args, node_rank)
        except LaunchError as err:
            print(
                f"\nglm52 generate: {err}\n(failure record: {os.path.join(log_dir, 'failure.json')})", file=sys.stderr
            )
            return err.returncode or 1
        finally:
            done.set()
            if follow.is_alive():
                follow.join()
        ranks = range(first, first + nproc)  # a node reads its own ranks' results (no shared folder is assumed)
        results = {r: read_json(os.path.join(out, f"result.rank{r}.json"), f"rank {r}'s result") for r in ranks}
        for r, res in results.items():
            if res["tokens"] != results[first]["tokens"]:  # a bug, never a user's error: named, not hidden
                return f"rank {r} chose {res['tokens']}, rank {first} {results[first]['tokens']} (the logs: {log_dir})"
        if not args.log_dir:
            shutil.rmtree(root, ignore_errors=True)
        return results[first]["tokens"], results[first]["stats"]


_IN_USE = "--log-dir {out} is in use by a running glm52 generate"
_RESULT_FILE = re.compile(r"(tokens\.rank\d+|result\.rank\d+\.json)")


def _clear_results(out: str) -> None:
    """Remove what an earlier launched generate left in ``out`` (its ranks' token streams and results),
    and nothing else: a --log-dir is the user's folder, and a ``generate/`` in it may be theirs too."""
    for name in os.listdir(out):
        path = os.path.join(out, name)
        if _RESULT_FILE.fullmatch(name) and (os.path.islink(path) or os.path.isfile(path)):
            os.remove(path)  # a link itself, never what it points to (a rank writes through the name)


def _follow(path: str, done: threading.Event, stream: Callable) -> None:
    """Hand each token id appended to ``path`` (one per line) to ``stream`` until ``done`` is set and
    the file is read to its end."""
    import numpy as np

    pos, pending = 0, ""
    while True:
        finished = done.is_set()  # before the read: what was written before it was set is read below
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                f.seek(pos)
                pending += f.read()
                pos = f.tell()
            *lines, pending = pending.split("\n")
            for line in lines:
                stream(np.asarray([int(line)]))
        if finished:
            return
        time.sleep(0.05)


def register_generate(sub: argparse._SubParsersAction) -> None:
    """Add ``generate`` to the glm52 CLI (see cli.COMMANDS)."""
    p = sub.add_parser(
        "generate",
        help="generate text from a checkpoint folder with its tokenizer (streamed)",
        description="Unset options take the checkpoint's generation_config.json, then transformers' defaults.",
    )
    p.add_argument("--model", required=True, help="checkpoint folder (config.json, safetensors, tokenizer.json)")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    p.add_argument("--system", help="with --chat: a system message before the prompt")
    p.add_argument("--max-new-tokens", type=int, help="new tokens at most (unset: the checkpoint's, else 20)")
    p.add_argument("--max-length", type=int, help="prompt + new tokens at most")
    p.add_argument(
        "--do-sample",
        action=argparse.BooleanOptionalAction,
        help="sample instead of greedy decoding (unset: the checkpoint's do_sample, else greedy)",
    )
    p.add_argument("--temperature", type=float, help="> 0 (unset: the checkpoint's, else 1.0)")
    p.add_argument("--top-p", type=float, help="in [0, 1] (unset: the checkpoint's, else 1.0)")
    p.add_argument("--top-k", type=int, help=">= 0, 0 = off (unset: the checkpoint's, else 50)")
    p.add_argument("--repetition-penalty", type=float, help="> 0, 1 = off")
    p.add_argument(
        "--num-beams",
        type=int,
        help="beam search over this many beams, printed at its end (unset: the checkpoint's, else 1)",
    )
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop a row at this text (repeatable)")
    p.add_argument("--seed", type=int, help="seed of the sampling draws")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks: launch this many processes, each reading and running its slices (sequence parallel off)",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks (a divisor or multiple of --tp; above it, ep / tp copies of the attention run the same prompt)",
    )
    p.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline stages: each launched rank reads and runs its stage's layers only, the stages in turn each step",
    )
    p.add_argument(
        "--log-dir",
        help="with --tp / --ep / --pp: the ranks' logs (unset: a temporary folder, removed after a clean run)",
    )
    from ..train.command import add_launch_arguments  # argparse only: no Paddle at the CLI's start

    add_launch_arguments(p.add_argument_group("launch (with --tp / --ep / --pp)"), "LOG_DIR/node<R>/")
    p.add_argument(
        "--speculative",
        action="store_true",
        help="draft with the MTP layer: the same text, fewer forwards where drafts are right (counts on stderr)",
    )
    p.set_defaults(func=run)
