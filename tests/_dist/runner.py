"""Start multi-process jobs from tests with a hard timeout, and read their results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
    e["OMP_NUM_THREADS"] = "1"
    e.setdefault("MKL_DEBUG_CPU_TYPE", "5")
    e["GLOG_minloglevel"] = "2"
    return e


def launch_script(
    script: str, nproc: int, args: list[str], log_dir: Path, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``python -m paddle.distributed.launch`` a script from tests/_dist (killed after ``timeout`` s)."""
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc), "--log_dir", str(log_dir)]
    cmd += [str(ROOT / "tests" / "_dist" / script), *args]
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)


def run_train_cli(args: list[str], timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    """``python -m paddleformers_glm.train ARGS``; returns the process and its wall time.  The
    timeout only catches a hung job: generous, as a shared machine can be slow."""
    t = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "paddleformers_glm.train", "--no-progress", *args],
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return p, time.monotonic() - t


def losses(out: Path) -> dict:
    with open(out / "loss.json", encoding="utf-8") as f:
        return json.load(f)


def worker_logs(out: Path) -> str:
    logs = sorted((out / "logs").glob("workerlog.*")) if (out / "logs").is_dir() else []
    return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:] for p in logs)
