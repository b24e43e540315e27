"""``glm52 train``: arguments, and the choice between running in this process (world 1) and
launching workers through Paddle's launcher (``register_train`` in cli.COMMANDS; ``python -m
paddleformers_glm.train`` runs :func:`main`).  Top level stays light (no paddle): the CLI imports
every subcommand module at start-up.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any, NoReturn

from .._io import WriteError, env_flags_error, is_int, short_name, write_record
from ..cpu_env import apply_mkl_default

if TYPE_CHECKING:
    from .settings import TrainConfig

__all__ = [
    "TRAIN_DEFAULTS",
    "add_indexer_arguments",
    "add_indexer_loss_arguments",
    "add_launch_arguments",
    "add_moe_aux_argument",
    "add_moe_bias_argument",
    "add_dtype_argument",
    "add_dump_argument",
    "add_expert_update_argument",
    "add_layout_arguments",
    "add_step_arguments",
    "add_train_arguments",
    "check_args",
    "check_checkpoint_files",
    "check_inputs_before_launch",
    "check_launch_numbers",
    "check_settings",
    "config_from_args",
    "launch_from_args",
    "main",
    "node_rank_of",
    "os_error_line",
    "register_train",
    "rendezvous_limit",
    "run_train",
    "start_notes",
    "train_line_error",
]

# defaults of the flags glm52 plan shares with the trainer but defaults otherwise (a smoke-run size)
TRAIN_DEFAULTS = {"seq_len": 64, "global_batch_size": 4, "dtype": "float32"}
EXPORT_DTYPES = ("trained", "auto", "float32", "bfloat16")  # --export-dtype (settings.SETTING_CHOICES, held equal)


def add_layout_arguments(g: Any, sharding_stages: Sequence[int] = (1, 2)) -> None:
    """The parallel-layout flags ``glm52 train`` and ``glm52 plan`` share (one layout type:
    ``parallel.topology.ParallelConfig``; the planner also knows sharding stage 3)."""
    g.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    g.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    g.add_argument("--dp", type=int, default=1, help="data parallel size (world = tp x pp x dp x sharding x cp)")
    g.add_argument(
        "--sharding",
        type=int,
        default=1,
        help="Fleet sharding degree: more data replicas, each holding 1/N of the optimizer state",
    )
    g.add_argument(
        "--sharding-stage",
        type=int,
        default=1,
        choices=list(sharding_stages),
        help="1: optimizer state sharded; 2: gradients too" + ("; 3: parameters too" if 3 in sharding_stages else ""),
    )
    g.add_argument("--cp", type=int, default=1, help="context parallel size: zigzag sequence slices (world = ... x cp)")
    g.add_argument("--ep", type=int, default=1, help="expert parallel size (ep x etp must divide tp x dp x cp)")
    g.add_argument("--etp", type=int, default=1, help="expert tensor parallel size")
    g.add_argument("--sp", action="store_true", help="sequence parallel (needs tp > 1)")
    g.add_argument("--pp-layout", help="e.g. 'E,t*4|t*4,m,L' or per-stage layer counts '3,5' (docs/parallel.md)")
    g.add_argument(
        "--vpp",
        type=int,
        default=1,
        help="virtual pipeline stages per rank (Fleet's interleaved schedule; --pp-layout then lists pp x vpp chunks)",
    )
    g.add_argument("--first-stage-layers", type=int, help="decoder layers on the first stage")
    g.add_argument("--last-stage-layers", type=int, help="decoder layers on the last stage")


def add_indexer_arguments(g: Any) -> None:
    """The indexer-training flags ``glm52 train`` and ``glm52 align`` share (train/indexer_stage.py)."""
    g.add_argument(
        "--indexer-stage",
        choices=["none", "warmup", "sparse"],
        help="how the DSA indexer trains (docs/indexer.md): warmup = dense attention, every parameter but the "
        "indexers frozen, the dense KL alone; sparse = top-k attention, the whole model, plus --indexer-loss-coeff x "
        "the KL over the selected keys; none = no indexer loss (default: sparse when the checkpoint's "
        "indexer_loss_coeff > 0)",
    )
    add_indexer_loss_arguments(g)


def add_indexer_loss_arguments(g: Any) -> None:
    """``--indexer-loss-coeff`` and ``--indexer-shared-supervision`` (of :func:`add_indexer_arguments`):
    ``glm52 plan`` takes them too, to refuse what the trainer refuses (``settings.check_run``)."""
    g.add_argument(
        "--indexer-loss-coeff",
        type=float,
        help="the sparse stage's KL weight (default: the checkpoint's indexer_loss_coeff)",
    )
    g.add_argument(
        "--indexer-shared-supervision",
        action="store_true",
        help="a full layer's indexer target also averages the attention of the shared layers reusing its top-k",
    )


def add_step_arguments(g: Any) -> None:
    """The batch, schedule and optimizer flags ``glm52 train`` and the torch reference run
    (parity/reference/train.py) share: one set of defaults for both."""
    g.add_argument("--steps", type=int, default=5)
    g.add_argument("--seq-len", type=int, default=TRAIN_DEFAULTS["seq_len"])
    g.add_argument("--global-batch-size", type=int, default=TRAIN_DEFAULTS["global_batch_size"])
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--min-lr", type=float, help="cosine floor (default lr / 10)")
    g.add_argument("--warmup-steps", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--clip-grad", type=float, default=1.0, help="max global grad norm (0: off)")
    g.add_argument("--seed", type=int, default=1234)
    add_moe_bias_argument(g)


def add_moe_bias_argument(g: Any) -> None:
    """``--moe-bias-update-rate`` (of :func:`add_step_arguments`; ``glm52 plan`` checks it as the trainer does)."""
    g.add_argument("--moe-bias-update-rate", type=float, default=0.0, help="expert-bias step R (0: frozen)")


def add_moe_aux_argument(g: Any) -> None:
    """``--moe-aux-loss-coeff`` of ``glm52 train`` (``glm52 plan`` checks it as the trainer does)."""
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="sequence-wise balance loss (0: off)")


def add_expert_update_argument(g: Any) -> None:
    """``--expert-update`` of ``glm52 train``, which ``glm52 align`` passes on."""
    g.add_argument(
        "--expert-update",
        default="fused",
        choices=["fused", "routed-only"],
        help="fused (default, the reference's semantics): every expert of an MoE layer that routed any token is "
        "stepped, idle ones with a zero gradient; routed-only: only experts that got tokens (docs/parity.md)",
    )


def add_dtype_argument(g: Any, how: str) -> None:
    """``--dtype`` of ``glm52 train`` and the torch reference run: one mixed-precision recipe, ``how``
    says how each runs it."""
    g.add_argument(
        "--dtype",
        default=TRAIN_DEFAULTS["dtype"],
        choices=["float32", "bfloat16"],
        help=f"bfloat16: bf16 weights and activations, fp32 master weights and gradient accumulation ({how})",
    )


def add_dump_argument(g: Any) -> None:
    """``--dump-step DIR K`` of ``glm52 train`` and the torch reference run (train/dump.py)."""
    g.add_argument(
        "--dump-step",
        nargs=2,
        action="append",
        default=[],
        metavar=("DIR", "K"),
        help="after update K write gradients (before clipping), AdamW moments and weights to DIR in HF names (repeatable)",
    )


def add_train_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = ap.add_argument_group("model")
    g.add_argument(
        "--model",
        required=True,
        help="checkpoint folder (GLM-5.2, HF layout), or 'toy' (a small stand-in model for smoke runs)",
    )
    g.add_argument("--model-config", help="JSON overrides for the toy model's config")
    g = ap.add_argument_group("parallel layout")
    add_layout_arguments(g)
    g.add_argument(
        "--schedule", default="1f1b", choices=["1f1b"], help="pipeline schedule (Fleet's 1F1B; --vpp interleaves it)"
    )
    g = ap.add_argument_group("training")
    add_step_arguments(g)
    add_moe_aux_argument(g)
    add_expert_update_argument(g)
    g.add_argument(
        "--skip-nonfinite-steps",
        type=int,
        default=0,
        help="skip up to N steps whose loss or grad norm is not finite (no update); the next one stops the run",
    )
    add_indexer_arguments(g)
    g.add_argument(
        "--recompute",
        default="none",
        choices=["none", "full", "core"],
        help="activation recompute (fleet.utils.recompute): full = each decoder layer, core = its attention core and indexer",
    )
    add_dtype_argument(g, "on a CPU build through ops/cpu_bf16")
    g.add_argument(
        "--data",
        help=".npy / .bin token stream, .npz samples, or .jsonl of input_ids, text or chat messages (default: synthetic)",
    )
    g.add_argument(
        "--tokenizer",
        help="folder with tokenizer.json for text/chat .jsonl (default: the --model folder); --export ships it",
    )
    g.add_argument(
        "--data-dtype", default="auto", help=".bin token dtype (auto: uint16 if the vocabulary fits, else uint32)"
    )
    g.add_argument(
        "--eval-data",
        help="held-out data (the --data formats): its first --eval-batches global batches, in file order, "
        "evaluated in evaluation mode without gradient; the loss per token in OUT/loss.json 'eval'",
    )
    g.add_argument(
        "--eval-every", type=int, default=0, help="evaluate after every K steps (0: after the last step only)"
    )
    g.add_argument("--eval-batches", type=int, default=1, help="global batches per evaluation (default: 1)")
    g.add_argument(
        "--eval-at-start",
        action="store_true",
        help="evaluate before the first step too (the loaded or resumed weights' held-out loss)",
    )
    g = ap.add_argument_group("output")
    g.add_argument("--out", required=True, help="output folder (loss.json, checkpoints/, export/, logs/)")
    g.add_argument("--export", action="store_true", help="write OUT/export/ in the model's release layout")
    g.add_argument(
        "--export-dtype",
        choices=EXPORT_DTYPES,
        default="trained",
        help="the export's dtype: the one the run trained in (--dtype; default, as save_pretrained writes a model), "
        "auto (the checkpoint's config.json dtype: the release's bf16), float32 or bfloat16",
    )
    g.add_argument("--save-every", type=int, default=0, help="checkpoint every K steps and after the last (0: never)")
    g.add_argument(
        "--save-total-limit",
        type=int,
        default=0,
        help="keep the newest N checkpoints/step_* folders, the one 'latest' names among them, deleting older "
        "ones after each save (0: keep all)",
    )
    g.add_argument("--resume", help="checkpoint folder (step_* or its root) to continue from")
    g.add_argument(
        "--resume-override",
        metavar="KEYS",
        help="comma-separated run settings a resume may change on purpose (lr, steps, seed, data ...; "
        "others are refused: docs/parallel.md, 'Checkpoints')",
    )
    g.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar nor checkpoint load/export progress (the bar is drawn on a terminal only)",
    )
    g.add_argument(
        "--verbose",
        action="store_true",
        help="relay Paddle's set-up logging (communication groups, the printed model, modified flags) to the "
        "console too; it is always in OUT/logs/workerlog.*",
    )
    add_dump_argument(g)
    g = ap.add_argument_group("launch")
    add_launch_arguments(g, "OUT/logs/node<R>/")
    g.add_argument("--fault", help=argparse.SUPPRESS)
    return ap


# --rendezvous-timeout's default: torchrun's rendezvous join timeout (its c10d rendezvous, 600 s); Paddle's
# launcher waits at --master without a limit
RENDEZVOUS_TIMEOUT_S = 600.0


def add_launch_arguments(g: Any, node_logs: str) -> None:
    """A launched job's flags (``glm52 train``, ``glm52 generate --tp``): the nodes, the launcher's own
    options and the three timeouts; ``node_logs`` says where a node of a multi-node job logs."""
    g.add_argument("--nnodes", type=int, default=1, help="nodes (multi-node: run the same command on each)")
    g.add_argument("--master", help="IP:PORT of the rendezvous, the same on every node (required with --nnodes > 1)")
    g.add_argument(
        "--node-rank",
        type=int,
        help=f"this node's rank, 0..nnodes-1 (required with --nnodes > 1; logs in {node_logs})",
    )
    g.add_argument("--launcher-args", default="", help="extra options for python -m paddle.distributed.launch")
    g.add_argument("--job-timeout", type=float, help="stop the whole job after this many seconds (default: none)")
    g.add_argument(
        "--rendezvous-timeout",
        type=float,
        help=f"with --nnodes > 1: stop the job when its nodes have not met at --master, or its ranks have not all "
        f"connected, within this many seconds (default: {RENDEZVOUS_TIMEOUT_S:g}, as torchrun's; 0: no limit)",
    )
    g.add_argument(
        "--comm-timeout",
        type=float,
        default=600.0,
        help="NCCL process-group timeout in seconds (PADDLE_PG_TIMEOUT; gloo's is fixed at 30 s)",
    )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    from .settings import TrainConfig

    for flag in ("--data", "--eval-data", "--resume", "--tokenizer"):  # an unset shell variable: not "no flag"
        if getattr(args, flag[2:].replace("-", "_"), None) == "":
            raise ValueError(f"{flag}: an empty path (leave {flag} out instead; an unset variable in the command?)")
    if getattr(args, "resume_override", None) and not args.resume:
        raise ValueError("--resume-override names what a --resume may change; this run has no --resume")
    if args.model == "toy":
        try:
            overrides = json.loads(args.model_config or "{}")
        except ValueError as e:  # the parser's words alone named no flag
            raise ValueError(f"--model-config is not JSON: {e}") from None
        model, model_args = "toy", {"config": overrides, "seed": args.seed}
    elif getattr(args, "model_config", None):
        raise ValueError("--model-config sets the toy model's config; a checkpoint's is its config.json")
    else:
        from ..cli._common import model_folder_error

        if bad := model_folder_error(args.model):
            raise FileNotFoundError(f"{bad} (or give 'toy' for a small stand-in model)")
        model, model_args = "glm", {"model_dir": os.path.abspath(args.model)}
        if args.tokenizer:  # the run's tokenizer: its export ships it
            model_args["tokenizer_dir"] = os.path.abspath(args.tokenizer)
    given = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}  # flags by name
    given.update(
        model=model,
        model_args=model_args,
        data=os.path.abspath(args.data) if args.data else None,
        eval_data=os.path.abspath(args.eval_data) if getattr(args, "eval_data", None) else None,
        out=os.path.abspath(args.out),
        resume=os.path.abspath(args.resume) if args.resume else None,
        resume_override=[k.strip() for k in (getattr(args, "resume_override", None) or "").split(",") if k.strip()],
        progress=not args.no_progress,
        dump_steps=dump_steps(args),
    )
    cfg = TrainConfig(**given)
    cfg.validate()
    return cfg


def tokens_file_name(path: str, prefix: str, seq_len: int) -> str:
    """The name of the ``.npz`` a text/chat jsonl at ``path`` is tokenized into: ``<prefix><stem>.seq<L>.npz``;
    a stem that would take the name past a file name's 255 bytes is cut and given a hash of the whole
    stem (``<prefix><cut stem>-<sha256 12>.seq<L>.npz``: the same name on every run of the same data)."""
    stem = os.path.splitext(os.path.basename(path))[0]
    tail = f".seq{seq_len}.npz"
    if len(os.fsencode(f"{prefix}{stem}{tail}")) <= 255:
        return f"{prefix}{stem}{tail}"
    digest = hashlib.sha256(os.fsencode(stem)).hexdigest()[:12]
    return f"{prefix}{short_name(stem, 200)}-{digest}{tail}"


def check_inputs_before_launch(cfg: TrainConfig, args: argparse.Namespace, vocab_size: int) -> None:
    """Everything the run reads from disk (``--data``: data.py's checks; ``--resume``: every file of
    the state, state_files.py), checked in this process before any worker starts, so a bad file is
    one named error instead of a worker dying at the step that first touches it.  A text/chat jsonl
    is tokenized here, once, into ``OUT/data/train-<name>.seq<L>.npz`` (``--eval-data``'s into
    ``OUT/data/eval-<name>.seq<L>.npz``: two prefixes, so that no pair of names can land on one file),
    which the workers then read (each node its own OUT; a resume compares the data's fingerprint, not
    its path).  ``--model toy`` refuses padded data (its attention and routing ignore attention_mask)."""
    from ..tokenizer import GlmTokenizer, TokenizerError
    from .data import TOY_PADDING, check_batch_samples, check_eval_samples, open_data, prepare_jsonl, text_jsonl_kind

    if cfg.model == "glm" and not cfg.resume:  # a resumed run reads no weight from --model
        check_checkpoint_files(cfg.model_args["model_dir"])
    named = [(f, p) for f, p in (("--data", cfg.data), ("--eval-data", cfg.eval_data)) if p not in (None, "synthetic")]
    if cfg.data_dtype != "auto" and not any(p.endswith(".bin") for _, p in named):
        given = "; ".join(f"{f} {p}" for f, p in named) or "--data synthetic"
        raise ValueError(
            f"--data-dtype {cfg.data_dtype} is the token width of a .bin file, and this run reads none ({given}): "
            ".npy and .npz record their dtype, a .jsonl holds numbers or text; leave --data-dtype out"
        )
    tok = None
    if args.tokenizer:  # read even when no text data needs it: the export ships it
        try:
            tok = GlmTokenizer.from_pretrained(args.tokenizer)
        except TokenizerError as e:
            raise ValueError(f"--tokenizer {args.tokenizer}: {e}") from e

    def tokenized(path: str, flag: str, prefix: str, min_samples: int) -> tuple[str, dict]:
        nonlocal tok
        tok_dir = cfg.model_args.get("model_dir")
        if tok is None and tok_dir is None:
            raise ValueError(f"{flag} {path}: text/chat records need a tokenizer: pass --tokenizer DIR")
        if tok is None:
            try:
                tok = GlmTokenizer.from_pretrained(tok_dir)
            except TokenizerError as e:
                raise ValueError(f"{flag} {path}: {e}") from e
        out = os.path.join(cfg.out, "data", tokens_file_name(path, prefix, cfg.seq_len))
        stop = _stop_token_ids(tok_dir, args.tokenizer)  # what generation stops on: a chat turn's end is trained
        try:
            info = prepare_jsonl(path, cfg.seq_len, vocab_size, tok, out, min_samples=min_samples, stop_ids=stop)
        except OSError as e:  # a full disk, a read-only OUT/data: said of the flag, naming the file written
            raise ValueError(f"{flag} {path}: {os_error_line(e)}") from e
        return out, info

    def toy_unpadded(source: Any, flag: str) -> None:
        i = source.first_padded() if cfg.model == "toy" else None
        if i is not None:
            raise ValueError(f"{flag} {source.describe}: sample {i} holds padding (attention_mask 0): {TOY_PADDING}")

    held_out = None
    if text_jsonl_kind(cfg.eval_data, "--eval-data"):
        cfg.eval_data, _ = tokenized(cfg.eval_data, "--eval-data", "eval-", cfg.eval_batches * cfg.global_batch_size)
    if cfg.eval_data is not None:
        held_out = open_data(
            cfg.eval_data, cfg.seq_len, vocab_size, cfg.seed, data_dtype=cfg.data_dtype, flag="--eval-data"
        )
        held_out.validate()
        check_eval_samples(held_out, cfg.eval_batches, cfg.global_batch_size)
        toy_unpadded(held_out, "--eval-data")
    if text_jsonl_kind(cfg.data, "--data"):
        # one global batch at least; a run longer than the data goes over it in epochs, as for the other sources
        out, info = tokenized(cfg.data, "--data", "train-", cfg.global_batch_size)
        epochs = cfg.steps / (info["samples"] // cfg.global_batch_size)  # an epoch: n // G batches (data.py)
        print(
            f"[glm52 train] data {cfg.data}: {info['records']} {info['kind']} records, {info['tokens']} tokens "
            f"-> {info['samples']} samples of {cfg.seq_len} ({out}); the run reads {epochs:.3g} epochs"
        )
        if info.get("cut"):  # what --seq-len leaves out of a conversation is not trained: said, not silent
            print(
                f"[glm52 train] data {cfg.data}: {info['cut']} of {info['records']} conversations are longer than "
                f"--seq-len {cfg.seq_len} and were cut to it (the longest has {info['longest']} tokens)"
            )
        cfg.data = out
    data = open_data(cfg.data, cfg.seq_len, vocab_size, cfg.seed, data_dtype=cfg.data_dtype)
    data.validate()
    if getattr(data, "cut", 0):  # token-id records longer than --seq-len: cut, as conversations are
        print(
            f"[glm52 train] data {cfg.data}: {data.cut} of {data.num_samples} records are longer than "
            f"--seq-len {cfg.seq_len} and were cut to it (the longest has {data.longest} tokens)"
        )
    check_batch_samples(data, cfg.global_batch_size)
    toy_unpadded(data, "--data")
    if cfg.resume:
        from .settings import check_resume_run, resolved_resume
        from .state_files import check_step_folder

        held = None if held_out is None else held_out.fingerprint()
        folder = resolved_resume(cfg)  # the step the workers load (run_config.json), not `latest` read again
        check_resume_run(cfg, folder, check_step_folder(folder), data.fingerprint(), eval_fingerprint=held)


def check_checkpoint_files(model_dir: str) -> None:
    """The checkpoint's files as the workers' load first checks them (every safetensors header, each
    file's size against its tensors' byte ranges, the index): headers and sizes only, no tensor read.
    A torn shard (a copy cut short) is a ``CheckpointError`` (a ValueError) naming the file, as
    ``glm52 generate`` refuses it, instead of a worker failing at the load."""
    from ..checkpoint.safetensors_io import Checkpoint

    with Checkpoint(model_dir, strict=False):  # strict=False: what the loader only warns about passes
        pass


def _stop_token_ids(*folders: str | None) -> list[int]:
    """The ids generation stops on for the checkpoint (``model_dir``: its generation_config.json
    ``eos_token_id``, else its config.json's, as ``glm52 generate`` reads them) and the tokenizer
    folder's generation_config.json: a chat record trains the one ending each assistant turn."""
    from ..configuration import GlmMoeDsaConfig
    from ..generation import GENERATION_CONFIG_FILE, GenerationConfig

    out: list[int] = []
    for i, folder in enumerate(folders):
        if folder is None or (i and not os.path.isfile(os.path.join(folder, GENERATION_CONFIG_FILE))):
            continue
        try:
            eos = GenerationConfig.from_pretrained(folder, GlmMoeDsaConfig.from_pretrained(folder) if i == 0 else None)
        except (OSError, ValueError) as e:
            raise ValueError(f"{folder}: the generation stop tokens: {e}") from e
        ids = [] if eos.eos_token_id is None else eos.eos_token_id
        ids = [ids] if is_int(ids) else ids
        if not isinstance(ids, list) or not all(is_int(x) for x in ids):
            raise ValueError(f"{folder}: eos_token_id must be an int or a list of ints, got {eos.eos_token_id!r}")
        out += [int(x) for x in ids if int(x) not in out]
    return out


def dump_steps(args: argparse.Namespace) -> list[tuple[str, int]]:
    out = []
    for d, k in getattr(args, "dump_step", None) or []:
        try:
            step = int(k)
        except ValueError:
            raise ValueError(f"--dump-step {d} {k}: K must be an integer step") from None
        if not 1 <= step <= args.steps:
            raise ValueError(f"--dump-step {d} {k}: K must be within 1..--steps ({args.steps})")
        if args.model == "toy":
            raise ValueError("--dump-step needs a checkpoint model (--model DIR): dumps use the checkpoint's names")
        from ..cli._common import output_folder_error

        if bad := output_folder_error(d, "--dump-step"):  # found at the dump, after the training, before
            raise ValueError(bad)
        for earlier, k_earlier in out:  # the later dump replaced the earlier one, which nothing recorded
            if os.path.realpath(earlier) == os.path.realpath(d):  # a link to the same folder too
                raise ValueError(
                    f"--dump-step {d} {k}: {d} already takes the dump of step {k_earlier}: give each step its folder"
                )
        out.append((os.path.abspath(d), step))
    return out


def check_dump_folders(args: argparse.Namespace) -> None:
    """Each ``--dump-step DIR K``'s DIR can be made and written into (a folder made here and removed
    again: what the command makes of DIR waits for step K), else a ValueError naming ``--dump-step``
    as given.  The dump is written after update K: a DIR found unwritable only then (a read-only
    place, a name over 255 bytes) cost the whole run up to K."""
    for d, _ in getattr(args, "dump_step", None) or []:
        path = os.path.abspath(d)
        try:
            made = make_folder(path)
        except OSError as e:
            raise ValueError(f"--dump-step {d}: cannot make the folder: {os_error_line(e)}") from e
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".glm52-dump-probe-", dir=path))
        except OSError as e:
            raise ValueError(f"--dump-step {d}: cannot write into the folder: {os_error_line(e)}") from e
        finally:
            remove_made(path, made)


def run_train(args: argparse.Namespace) -> int:
    """Run (world 1) or launch (world > 1) the training; returns the exit code.  A stop signal
    before the launch is one line too (exit 128 + signal)."""
    from .stop_signals import listening

    # before Paddle starts its threads (they inherit the blocked stop signals); undone on return, so
    # that a Python caller going on after the job (and every process it starts) gets them as before
    with listening() as listener:
        try:
            return _run_train(args)
        except KeyboardInterrupt as e:
            stop = listener.interrupted(e)
            print(f"glm52 train: stopped by {stop['text']} before the job started", file=sys.stderr)
            return 128 + int(signal.Signals[stop["signal"]])


def check_args(args: argparse.Namespace) -> tuple[TrainConfig, Any, int]:
    """The settings of a ``glm52 train`` command line and every refusal of them that reads no file but
    the model's config (``settings.check_run``, the launch numbers); returns (settings, adapter, world).
    ``glm52 plan`` refuses the same layouts through the same ``check_run`` (tests/test_plan_agrees.py)."""
    from .adapter import make_adapter
    from .settings import run_world

    cfg = config_from_args(args)
    world = run_world(cfg)
    if world == 1 and getattr(args, "launcher_args", ""):  # dropped without a word before
        raise ValueError(
            "--launcher-args needs a layout of more than one process (one process runs without Paddle's launcher)"
        )
    adapter = make_adapter(cfg.model, **cfg.model_args)
    check_settings(
        cfg, adapter, world, job_timeout=args.job_timeout, comm_timeout=args.comm_timeout, nnodes=args.nnodes
    )
    return cfg, adapter, world


class _ArgumentRefused(Exception):
    """argparse's refusal of a train line, raised instead of printed (:func:`train_line_error`)."""


class _RefusingParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _ArgumentRefused(message)


def train_line_error(argv: Sequence[str]) -> str | None:
    """What ``glm52 train`` refuses in the command line ``argv`` (its arguments after ``train``) before
    it launches, needing no file but the model's config, in the words it prints after ``glm52 train:
    error:`` (one line), or None: its argument parsing, then :func:`check_args` (the settings, the
    layout against the model, the launch numbers) and :func:`node_rank_of` (a multi-node line's
    ``--master`` and node rank). ``--out`` may be left out: no check reads it.
    ``glm52 align`` and ``glm52 demo`` check the lines they hand to glm52 train with it."""
    argv = list(argv)
    if not any(a == "--out" or a.startswith("--out=") for a in argv):
        argv += ["--out", "unused"]  # required by the parser; only the launch makes (and checks) it
    parser = add_train_arguments(_RefusingParser(prog="glm52 train", add_help=False))
    try:
        args = parser.parse_args(argv)
        check_args(args)
        node_rank_of(args)  # a multi-node line's rendezvous, as glm52 train checks it next
    except _ArgumentRefused as e:
        return str(e)
    except (ValueError, FileNotFoundError, KeyError) as e:  # what _run_train prints (a ParallelConfigError too)
        return str(e)
    return None


def check_settings(
    cfg: TrainConfig,
    adapter: Any,
    world: int,
    job_timeout: float | None = None,
    comm_timeout: float | None = 600.0,
    nnodes: int = 1,
) -> tuple[Any, list[Any]]:
    """Every refusal of a run's settings that needs no file but the model's config: ``settings.check_run``
    (the settings, the layout against the model, the batch, the pipeline split, the indexer training)
    and the launch numbers (``--job-timeout``, ``--comm-timeout``, ``--nnodes``).  ``glm52 train``
    (:func:`check_args`) and ``glm52 plan`` (``plan.check_layout``) both call it, so they refuse the
    same lines with the same words.  Returns the layout and the pipeline chunks."""
    from .settings import check_run

    pc, chunks = check_run(cfg, adapter, world)
    check_launch_numbers(world, job_timeout, comm_timeout, nnodes)
    return pc, chunks


def check_launch_numbers(world: int, job_timeout: float | None, comm_timeout: float | None, nnodes: int) -> None:
    """``--job-timeout``, ``--comm-timeout`` and ``--nnodes`` against the job's ``world`` size."""
    from ..parallel.topology import ParallelConfigError

    for flag, v in (("--job-timeout", job_timeout), ("--comm-timeout", comm_timeout)):
        if v is not None and not (math.isfinite(v) and v > 0):  # --job-timeout None: no limit
            raise ValueError(f"{flag} must be a finite number of seconds > 0, got {v}")
    if comm_timeout is not None and comm_timeout < 0.001:  # PADDLE_PG_TIMEOUT: whole ms
        raise ValueError(f"--comm-timeout must be at least 0.001 s (whole milliseconds), got {comm_timeout}")
    if nnodes < 1:
        raise ValueError(f"--nnodes must be at least 1, got {nnodes}")
    if world % nnodes:
        raise ParallelConfigError(f"world size {world} is not divisible by --nnodes {nnodes}")


def _run_train(args: argparse.Namespace) -> int:
    apply_mkl_default()  # before Paddle (and its MKL) loads; AMD only
    from ..cli._common import output_folder_error

    try:  # reject a layout that cannot work before any process starts
        cfg, adapter, world = check_args(args)
        if bad := output_folder_error(args.out, "--out"):  # before anything (a jsonl's tokens) is written there
            raise ValueError(bad)
        check_dump_folders(args)
        node_rank = node_rank_of(args)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"glm52 train: error: {e}", file=sys.stderr)
        return 2
    from .out_lock import OutInUse, OutUnusable, hold_out_folder

    try:
        made = make_folder(cfg.out)
    except OSError as e:  # a read-only place, a name over 255 bytes, no permission
        print(f"glm52 train: error: --out {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    try:  # held before the inputs are checked: a text --data is tokenized into OUT/data
        with hold_out_folder(cfg.out, node_rank):
            try:
                check_inputs_before_launch(cfg, args, adapter.vocab_size)
            except (ValueError, FileNotFoundError, KeyError) as e:
                refusal = e
            except OSError as e:  # a full disk while a text --data is tokenized into OUT/data: one line
                refusal = os_error_line(e)
            else:
                return _run_held(cfg, adapter, args, world, node_rank)
    except OutInUse as e:  # raised before anything of the running job is touched
        print(f"glm52 train: error: {e}", file=sys.stderr)
        return 2
    except OutUnusable as e:
        refusal = f"--out {args.out}: {e}"
    print(f"glm52 train: error: {refusal}", file=sys.stderr)
    remove_made(cfg.out, made)  # the folders this command made go with its refused input
    return 2


def make_folder(path: str) -> str | None:
    """Make the folder ``path`` (absolute) and its missing parents; returns the topmost folder made
    (None: ``path`` was there). When one cannot be made, the folders made are removed
    (:func:`remove_made`) and the OSError raised."""
    made, probe = None, path
    while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
        made, probe = probe, os.path.dirname(probe)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        remove_made(path, made)
        raise
    return made


def remove_made(path: str, made: str | None) -> None:
    """Remove the folder ``path`` this command made, then its parents up to ``made`` (the topmost it
    made) while they are empty: a parent may hold another run's output by now."""
    if made is None:
        return
    shutil.rmtree(path, ignore_errors=True)
    folder = os.path.dirname(path)
    while len(folder) >= len(made) and folder.startswith(made):
        try:
            os.rmdir(folder)
        except OSError:  # not empty (another run's), or gone
            return
        folder = os.path.dirname(folder)


def os_error_line(e: OSError) -> str:
    """An OSError in one line naming its file and the OS's words (``_io.WriteError`` names what was
    written too); ``str(e)`` of an error from ``write`` or ``fsync`` names no file."""
    if isinstance(e, WriteError) or not e.filename:
        return str(e)
    return f"{e.filename}: {e.strerror or e}"


def write_failure_detail(e: BaseException) -> tuple[str, dict[str, Any]]:
    """(the message, failure.json's detail) of a run stopped by ``e``: a failed write (``_io.WriteError``)
    is said without its type, naming the file, what was written (a resume state, the export) and the
    errno. Any other error: ``Type: message`` and no detail."""
    if not isinstance(e, WriteError):
        return f"{type(e).__name__}: {e}", {}
    return str(e), e.record


def node_rank_of(args: argparse.Namespace) -> int | None:
    """This node's rank in a multi-node run (None with ``--nnodes 1``), from ``--node-rank`` or the
    launcher's own ``--rank`` in ``--launcher-args``; a multi-node run without it or without a
    master is refused before the launch.  Without ``--master`` every node started its own
    rendezvous and waited for the others forever; without a node rank Paddle's launcher numbered
    the nodes in the order they reached the master, so a node could not tell its own ranks (a
    finished job was reported as failed: the completion records of the ranks it assumed were
    written on another node).  With ``--nnodes 1`` a node rank other than 0 or a master is refused
    too: such a node ran the whole job alone and exited 0 while the node 0 it was meant to join
    waited for it.  ``--rendezvous-timeout`` is checked here too (:func:`rendezvous_limit`)."""
    if args.nnodes < 1:
        raise ValueError(f"--nnodes must be at least 1, got {args.nnodes}")
    rendezvous_limit(args)
    passed = argparse.ArgumentParser(add_help=False)
    passed.add_argument("--rank", type=int)
    passed.add_argument("--master")
    given, _ = passed.parse_known_args(shlex.split(args.launcher_args))
    node_rank = args.node_rank if args.node_rank is not None else given.rank
    n = args.nnodes
    if n == 1:
        if node_rank is not None and node_rank != 0:
            raise ValueError(
                f"--node-rank must be within 0..0 for --nnodes 1, got {node_rank} (a node of a multi-node job "
                "needs --nnodes N, the same on every node; with --nnodes 1 it runs the whole job alone)"
            )
        if args.master or given.master:
            raise ValueError(
                f"--master {args.master or given.master} needs --nnodes N > 1, the same on every node (with "
                "--nnodes 1 this node runs the whole job alone and no node joins it at the master)"
            )
        return None
    if not (args.master or given.master):
        raise ValueError(
            f"--nnodes {n} needs --master IP:PORT, the same on every node (without it each node starts its own "
            "rendezvous and waits for the others forever)"
        )
    if node_rank is None:
        raise ValueError(f"--nnodes {n} needs --node-rank R (0..{n - 1}), a different one on every node")
    if not 0 <= node_rank < n:
        raise ValueError(f"--node-rank must be within 0..{n - 1} for --nnodes {n}, got {node_rank}")
    return node_rank


def rendezvous_limit(args: argparse.Namespace) -> float | None:
    """The seconds a multi-node job may take for its nodes to meet at the master and for its ranks to
    connect at the job's default group (``--rendezvous-timeout``; unset: :data:`RENDEZVOUS_TIMEOUT_S`),
    None for no limit (0) or a one-node job.  A value that is not a finite number >= 0, or one given
    to a one-node job (it has no rendezvous: it would be dropped without a word), is a ValueError."""
    v = getattr(args, "rendezvous_timeout", None)
    if v is not None and not (math.isfinite(v) and v >= 0):
        raise ValueError(f"--rendezvous-timeout must be a finite number of seconds >= 0 (0: no limit), got {v}")
    if args.nnodes <= 1:
        if v is not None:
            raise ValueError(
                f"--rendezvous-timeout {v:g} needs --nnodes N > 1 (it bounds the wait of a job's nodes for each "
                "other; a one-node job starts its ranks together)"
            )
        return None
    v = RENDEZVOUS_TIMEOUT_S if v is None else v
    return v or None


def launch_from_args(
    worker_args: list[str],
    world: int,
    log_dir: str,
    args: argparse.Namespace,
    node_rank: int | None,
    quiet: bool = True,
) -> None:
    """``train/worker.py worker_args`` on this node's share of the job's ``world`` ranks, launched as
    the flags of :func:`add_launch_arguments` in ``args`` say (``node_rank``: :func:`node_rank_of`):
    Paddle's launcher given ``--launcher-args`` and, in a multi-node job, the node count, the
    rendezvous and this node's rank; the job timeout; the rendezvous limit (:func:`rendezvous_limit`);
    the NCCL process-group timeout. Raises
    ``launch.LaunchError`` as :func:`launch.launch_workers` does (``glm52 train`` and ``glm52
    generate --tp``)."""
    from .launch import launch_workers

    options = shlex.split(args.launcher_args)
    if args.nnodes > 1:
        options = ["--nnodes", str(args.nnodes), *options]
        if args.master:
            options += ["--master", args.master]
        options += ["--rank", str(node_rank)]
    nproc = world // args.nnodes
    launch_workers(
        worker_args,
        nproc,
        log_dir,
        launcher_args=options,
        node_rank_offset=(node_rank or 0) * nproc,
        world_size=world,
        timeout_s=args.job_timeout,
        rendezvous_timeout_s=rendezvous_limit(args),
        quiet_launcher=quiet,
        extra_env={"PADDLE_PG_TIMEOUT": str(int(args.comm_timeout * 1000))},
    )


def _run_held(cfg: TrainConfig, adapter: object, args: argparse.Namespace, world: int, node_rank: int | None) -> int:
    """The run, with ``cfg.out`` held by this command (out_lock.py).  A node of a multi-node run
    keeps its launch logs in ``OUT/logs/node<R>/``: Paddle's launcher names the worker logs by
    local rank (``workerlog.0`` on every node), and job.json, status/ and failure.json are the
    node's own; in one shared ``--out`` (a cluster filesystem) the nodes' files were one set,
    each node appending to the others' worker logs and deleting their status records."""
    from .launch import LaunchError

    log_dir = os.path.join(cfg.out, "logs") if node_rank is None else os.path.join(cfg.out, "logs", f"node{node_rank}")
    from .state_files import StepFolderRemoved, sweep_stale_saves

    try:
        notes = start_notes(cfg, adapter, log_dir)
    except StepFolderRemoved as e:  # the resumed step, checked a moment ago, pruned by the run saving there
        print(f"glm52 train: error: {e}", file=sys.stderr)
        return 2
    for line in notes:
        print(line, flush=True)
    if world == 1 and args.nnodes == 1:
        return _run_in_process(cfg, adapter, args.job_timeout)
    # a node's own settings (in a shared --out one run_config.json was every node's: last writer wins)
    run_json = os.path.join(cfg.out if node_rank is None else log_dir, "run_config.json")
    os.makedirs(log_dir, exist_ok=True)
    write_record(run_json, cfg.__dict__)
    try:
        launch_from_args(["--config", run_json], world, log_dir, args, node_rank, quiet=not args.verbose)
    except LaunchError as e:
        if node_rank is None:  # every process of the job has ended (launch.stop_job) and the --out lock is
            # held: what a save cut short left (a stopped worker ends by os._exit, before its save's own
            # clean-up) goes now, not at the next save into this OUT. A node of several may share --out
            # with nodes still saving: it leaves it to that next save
            sweep_stale_saves(os.path.join(cfg.out, "checkpoints"), -1)
        record = os.path.join(log_dir, "failure.json")
        sep = "; every process of the job ended " if e.cause == "signal" else "\n"  # a user's stop: one line
        print(f"glm52 train: {e}{sep}(failure record: {record})", file=sys.stderr)
        return e.returncode or 1
    return 0


def start_notes(cfg: TrainConfig, adapter: Any, log_dir: str) -> list[str]:
    """What a run into ``cfg.out`` (held: out_lock.py) does and says before it starts, one line each:
    an earlier run's failure record ``log_dir/failure.json`` is moved to ``failure.prev.json``
    (replacing an older one), so that failure.json is only ever this run's; an ``OUT/export`` this run
    does not replace (no ``--export``) is an earlier run's, and so are saves in ``OUT/checkpoints``
    this run does not continue; the step folder a ``--resume`` of a checkpoint root (or an output
    folder) resumes, as its ``latest`` named it when the run started; a warm-up that does not end
    before the last step (``settings.warmup_warning``)."""
    from .launch import set_aside_failure_record
    from .settings import lr_schedule_start, warmup_warning

    notes = []
    record = os.path.join(log_dir, "failure.json")
    try:
        moved = set_aside_failure_record(log_dir)
    except OSError as e:
        notes.append(
            f"[glm52 train] warning: {record}, an earlier run's failure record, could not be moved aside "
            f"({os_error_line(e)}); it is not this run's"
        )
    else:
        if moved is not None:
            notes.append(f"[glm52 train] {record} (an earlier run's failure record) moved to {moved}")
    export = os.path.join(cfg.out, "export")
    if not cfg.export and os.path.lexists(export):
        notes.append(
            f"[glm52 train] warning: {export} is an earlier run's export, not replaced by this run (no --export): "
            "it does not hold this run's weights"
        )
    from .settings import resolved_resume
    from .state_files import read_meta, saved_steps

    meta = resumed = None
    if cfg.resume:
        resumed = resolved_resume(cfg)
        meta = read_meta(resumed)
        if os.path.realpath(resumed) != os.path.realpath(cfg.resume):  # a root: which of its saves is said
            notes.append(f"[glm52 train] --resume {cfg.resume}: resuming {resumed} (step {meta['step']})")
    ckpt = os.path.join(cfg.out, "checkpoints")
    with contextlib.suppress(OSError):  # no checkpoints folder: nothing to say
        # the saves of an earlier run this one does not continue: all of them, or after the step it resumes
        # from when it resumes one of them (those the same trajectory would save again are left alone)
        own = resumed is not None and os.path.realpath(os.path.dirname(resumed)) == os.path.realpath(ckpt)
        after = int(meta["step"]) if own else -1
        steps = [n for n in saved_steps(ckpt) if n > after]
        if steps:
            listed = ", ".join(map(str, steps)) if len(steps) <= 6 else f"{steps[0]} .. {steps[-1]}"
            fate = []
            if cfg.save_every:
                fate.append("a save of this run replaces the one of its step, the others stay")
            if cfg.save_total_limit:
                fate.append(f"--save-total-limit {cfg.save_total_limit} counts them among the newest")
            notes.append(
                f"[glm52 train] warning: {ckpt} holds {len(steps)} save(s) of an earlier run (at steps {listed}) "
                "that this run does not continue" + (f": {'; '.join(fate)}" if fate else "")
            )
    stage = (adapter.indexer_info() or {}).get("stage")
    first = int(meta["step"]) if meta is not None else 0
    if (line := warmup_warning(cfg, lr_schedule_start(meta, stage), first)) is not None:
        notes.append(line)
    return notes


# what a launcher tells each process it starts (its rank and the job's size): in a run nothing launched,
# a value left in the environment would make Paddle (and the run) take part in a job that is not there
_LAUNCHER_ENV = ("PADDLE_TRAINERS_NUM", "PADDLE_TRAINER_ID", "PADDLE_TRAINER_ENDPOINTS", "PADDLE_CURRENT_ENDPOINT")


class _Stopped(BaseException):
    """A stop signal or the job timeout, raised in the main thread of an in-process run."""

    def __init__(self, stopped_by: dict) -> None:
        super().__init__(stopped_by["text"])
        self.stopped_by = stopped_by


def _stop_diagnosis(stopped_by: dict) -> tuple[Any, int]:
    """A stopped one-process run's diagnosis and exit code: 124 for the job timeout, else 128 + the signal."""
    from .job_status import Diagnosis

    if stopped_by["kind"] == "timeout":
        return Diagnosis(None, stopped_by["text"], "timeout"), 124
    rc = 128 + int(signal.Signals[stopped_by["signal"]])
    return Diagnosis(None, f"stopped by {stopped_by['text']}", stopped_by["kind"]), rc


def _run_in_process(cfg: TrainConfig, adapter: object, job_timeout: float | None) -> int:
    """World 1: train in this process; a stop signal, the job timeout or a non-finite step ends it
    with one line and ``OUT/logs/failure.json``, as a launched job would."""
    from .job_status import Diagnosis
    from .launch import LaunchError, write_failure_record
    from .loop import run_training
    from .nonfinite import NonFiniteStep
    from .stop_signals import listen

    fired: list[dict] = []  # the timeout, kept: raised inside a Paddle op it comes back as another error

    def timeout(_num: int, _frame: object) -> None:
        fired.append({"kind": "timeout", "text": f"job exceeded --job-timeout {job_timeout:g} s; stopped"})
        raise _Stopped(fired[0])

    listener = listen()
    # a job starts unsignalled: a stop an earlier in-process job of this process recorded (its
    # listener still running, as after a launch) is not this job's, nor is its launcher's polling
    listener.caught, listener.polled = None, False
    old = signal.signal(signal.SIGALRM, timeout) if job_timeout else None
    if job_timeout:
        signal.setitimer(signal.ITIMER_REAL, job_timeout)
    t0 = time.monotonic()
    stale: dict[str, str] = {}
    try:
        # a launcher's variables left in the environment are not this run's, which this command did not
        # launch: the trainer and Paddle (its world size, cached for the process) would read them
        stale = {k: os.environ.pop(k) for k in _LAUNCHER_ENV if k in os.environ}
        if stale.get("PADDLE_TRAINERS_NUM", "1").strip() not in ("", "1"):
            print(f"[glm52] PADDLE_TRAINERS_NUM={stale['PADDLE_TRAINERS_NUM']} in the environment ignored: this "
                  "run was not launched, it is one process")  # fmt: skip
        run_training(cfg, adapter)
        return 0
    except (_Stopped, KeyboardInterrupt) as e:
        stopped_by = e.stopped_by if isinstance(e, _Stopped) else listener.interrupted(e)
        diag, rc = _stop_diagnosis(stopped_by)
    except NonFiniteStep as e:
        diag, stopped_by, rc = Diagnosis(e.record["rank"], str(e), "nonfinite", e.record), None, 1
    except Exception as e:  # noqa: BLE001 - one line and a non-zero exit
        # a stop signal or the timeout raised inside a Paddle op (a PyLayer's backward) arrives wrapped
        stopped_by = fired[0] if fired else listener.caught
        if stopped_by is None:
            message, detail = write_failure_detail(e)
            diag, rc = Diagnosis(0, message, "error", detail), 1
        else:
            diag, rc = _stop_diagnosis(stopped_by)
    finally:
        os.environ.update(stale)  # the caller's environment as it was
        if job_timeout:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    err = LaunchError(diag.rank, diag.message, rc, diag.cause)
    path = write_failure_record(
        os.path.join(cfg.out, "logs"), err, stopped_by=stopped_by, seconds=time.monotonic() - t0, diagnosis=diag
    )
    print(
        f"glm52 train: {'error: ' if diag.cause == 'error' else ''}{diag.message} (failure record: {path})",
        file=sys.stderr,
    )
    return rc


def register_train(sub: argparse._SubParsersAction) -> None:
    """Add ``train`` to the glm52 CLI (see cli.COMMANDS)."""
    p = sub.add_parser("train", help="train with TP/PP/EP/ETP/SP/DP on gloo (CPU) or NCCL (GPU); writes OUT/loss.json")
    add_train_arguments(p)
    p.set_defaults(func=run_train)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="glm52 train", description="Train with TP/PP/EP/ETP/SP/DP on gloo (CPU) or NCCL (GPU)"
    )
    args = add_train_arguments(ap).parse_args(argv)
    if bad := env_flags_error():  # as glm52's own main: a typo in an on/off variable, before the work
        print(f"glm52 train: error: {bad}", file=sys.stderr)
        return 2
    return run_train(args)
