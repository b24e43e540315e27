"""argparse wiring of ``glm52 convert`` (registered by ``paddleformers_glm.cli``)."""

from __future__ import annotations

import argparse
import sys


def register_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a checkpoint between the official HF and the Paddle/Fleet layout, or to/from block FP8",
        description="Load SRC through the AOA mapping (strict) and write OUT in --to layout, atomically.",
    )
    p.add_argument("src", help="source checkpoint folder (config.json beside the weights)")
    p.add_argument("out", help="output folder")
    p.add_argument("--to", choices=("hf", "fleet"), default="fleet", help="layout to write (default: fleet)")
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32", "float16"),
        help="dtype of the written weights (default: config dtype)",
    )
    p.add_argument(
        "--expert-layout",
        choices=("per-expert", "grouped", "stacked"),
        default="per-expert",
        help="routed experts in a --to fleet file: per expert, PaddleFleet's grouped_gemm_experts.weight1/2, "
        "or its stacked experts.up_gate_proj/down_proj (default: per-expert)",
    )
    p.add_argument(
        "--quantization",
        choices=("fp8", "none"),
        default="none",
        help="fp8: write the official block-FP8 format (official layout); none: unquantized (default)",
    )
    p.add_argument("--max-shard-size", default="5GB", help="shard size limit, e.g. 5GB, 500MiB (default: 5GB)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=_run_convert)


def _run_convert(args: argparse.Namespace) -> int:
    from .. import progress
    from .convert import convert_checkpoint

    progress.set_quiet(True if args.quiet else None)

    try:
        rep = convert_checkpoint(
            args.src,
            args.out,
            layout=args.to,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            expert_layout=args.expert_layout,
            quantization=args.quantization,
        )
    except ValueError as e:  # CheckpointError included
        print(f"convert: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a filesystem error (full disk, permissions): one line naming the path
        if e.errno is None:  # raised with a message of its own (no config.json in SRC): it names the path
            print(f"convert: {e}", file=sys.stderr)
            return 2
        target = e.filename if e.filename and ".tmp-" not in str(e.filename) else args.out  # not the temp folder
        print(f"convert: filesystem error on {target}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"convert: wrote {rep.tensors} tensors ({rep.total_size} bytes) in {len(rep.files)} files to {rep.out_dir}")
    return 0
