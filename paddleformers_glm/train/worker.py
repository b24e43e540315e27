"""Entry point of one launched training process: ``worker.py --config RUN.json``.

Records its own outcome for the launcher (launch.py): ``rank<N>.pid`` at start (so the launcher can
tell a frozen rank from a busy one), then ``rank<N>.ok`` or ``rank<N>.error.json`` with the
exception and traceback, then leaves with ``os._exit`` so no gloo/NCCL destructor can
hang the process after a peer died.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

from paddleformers_glm._io import atomic_write_text


def _status(rank: int, suffix: str, payload: dict | None = None) -> None:
    d = os.environ.get("GLM52_STATUS_DIR")
    if not d:
        return
    atomic_write_text(os.path.join(d, f"rank{rank}.{suffix}"), "" if payload is None else json.dumps(payload))


def _shorten(text: str, head: int = 300, tail: int = 500) -> str:
    """Head and tail of a long message: the head names the failing op, the tail the last frames."""
    if len(text) <= head + tail + 5:
        return text
    return f"{text[:head]} ... {text[-tail:]}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="glm52 training worker (started by the launcher)")
    ap.add_argument("--config", required=True, help="TrainConfig as JSON")
    args = ap.parse_args(argv)
    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0") or 0)
    _status(rank, "pid", {"rank": rank, "pid": os.getpid()})  # lets the launcher see a frozen rank
    try:
        from paddleformers_glm.train.loop import TrainConfig, run_training

        with open(args.config, encoding="utf-8") as f:
            cfg = TrainConfig.from_dict(json.load(f))
        run_training(cfg)
    except BaseException as e:  # noqa: BLE001 - every failure must be reported, then the process ends
        from paddleformers_glm.train.launch import is_comm_error

        tb = traceback.format_exc()
        msg = str(e).strip().splitlines()
        text = _shorten(" | ".join(ln.strip() for ln in msg if ln.strip()))
        _status(
            rank,
            "error.json",
            {
                "rank": rank,
                "time": time.time(),
                "type": type(e).__name__,
                "message": text,
                # classified on the whole text: gloo puts its TIMEOUT words at the start of a long message
                "comm": is_comm_error(f"{type(e).__name__} {e} {tb}"),
                "traceback_tail": "\n".join(tb.strip().splitlines()[-8:]),
            },
        )
        sys.stderr.write(tb)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)
    _status(rank, "ok")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
