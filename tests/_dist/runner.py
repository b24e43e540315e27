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
    """The environment of a launched test: this checkout first on the path, one thread a process,
    and ``PORT_RANGE`` below the kernel's ephemeral range, as the trainer's launches get it
    (``train.launch.worker_env``): Paddle's default range overlaps the ports every outgoing
    connection takes, and a launch whose probed port was taken before rank 0 bound it aborted in
    ``TCPStore`` (measured: 2 of 8 launches beside 400 new connections a second, 0 of 8 with it)."""
    from paddleformers_glm.train.launch import listen_port_range

    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
    e["OMP_NUM_THREADS"] = "1"
    e.setdefault("MKL_DEBUG_CPU_TYPE", "5")
    e["GLOG_minloglevel"] = "2"
    ports = listen_port_range()
    if ports:
        e.setdefault("PORT_RANGE", ports)
    return e


def launch_scripts(
    nproc: int, scripts: list[tuple[str, list[str]]], log_dir: Path, timeout: float = 120
) -> subprocess.CompletedProcess:
    """One launch of Paddle's launcher (as the trainer starts it: ``train.launch.launcher_command``, through lifeline.py)
    that runs the tests/_dist ``scripts`` [(script, args)] one after another in the same ``nproc``
    processes (tests/_dist/multi.py); killed after ``timeout`` s."""
    from paddleformers_glm.train.launch import launcher_command

    log_dir = Path(log_dir)
    spec = log_dir.parent / f"{log_dir.name}.scripts.json"
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps([[s, list(a)] for s, a in scripts]), encoding="utf-8")
    cmd = launcher_command(nproc, str(log_dir), [str(ROOT / "tests" / "_dist" / "multi.py"), str(spec)])
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)


def launch_script(
    script: str, nproc: int, args: list[str], log_dir: Path, timeout: float = 300
) -> subprocess.CompletedProcess:
    """One tests/_dist script on ``nproc`` launched processes (see :func:`launch_scripts`)."""
    return launch_scripts(nproc, [(script, args)], log_dir, timeout)


def script_logs(log_dir: Path, nproc: int, tail: int = 3000) -> str:
    """The last ``tail`` characters of each rank's log of a launch."""
    logs = [Path(log_dir) / f"workerlog.{r}" for r in range(nproc)]
    return "\n".join(f"--- {f.name}\n" + f.read_text(errors="replace")[-tail:] for f in logs if f.is_file())


def script_result(launch: dict, name: str) -> dict:
    """The JSON one script of a shared launch (a conftest fixture: ``proc``, ``dir``, ``logs``)
    wrote, or a test failure showing the launch's output."""
    import pytest

    f = Path(launch["dir"]) / name
    p = launch["proc"]
    if p.returncode != 0 or not f.is_file():
        pytest.fail(f"the launch writing {name} failed (rc {p.returncode}):\n{p.stdout[-2000:]}\n{launch['logs']}")
    return json.loads(f.read_text())


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


def error_lines(stderr: str) -> list[str]:
    """stderr without Paddle's own import-time warning (no ccache: a message line and its
    ``warnings.warn(...)`` source line), which is not the CLI's output."""
    out, after_warning = [], False
    for ln in stderr.strip().splitlines():
        if "No ccache found" in ln or (after_warning and ln.strip().startswith("warnings.warn(")):
            after_warning = "No ccache found" in ln
            continue
        after_warning = False
        out.append(ln)
    return out


def losses(out: Path) -> dict:
    with open(out / "loss.json", encoding="utf-8") as f:
        return json.load(f)


def worker_logs(out: Path) -> str:
    logs = sorted((out / "logs").glob("workerlog.*")) if (out / "logs").is_dir() else []
    return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:] for p in logs)


def assert_indexer_matches(ref: dict, got: dict, what) -> None:
    """Two runs of the tiny checkpoint (full layers 0, 1, 2, 6) in the same indexer stage: the
    indexer's KL loss (the objective's term) and, per step and full layer, its KL and top-k recall
    (loss.json's ``indexer`` block) agree.  The tiny checkpoint's KLs are 1e-4 to 4e-4 (sums of
    terms that cancel): 1e-7 absolute is 3e-4 of them, and a wrong scaling (by a micro-batch, rank
    or layer count) is off by a factor of 2 or more; recalls are shares of attention mass in [0, 1]."""
    a, b = ref["indexer"], got["indexer"]
    steps = len(ref["losses"])
    assert a["layers"] == b["layers"] == [0, 1, 2, 6] and b["steps"] == list(range(1, steps + 1)), (what, b)
    assert b["stage"] == a["stage"] and b["loss_weight"] == a["loss_weight"], what
    diff = max(abs(x - y) for x, y in zip(ref["indexer_losses"], got["indexer_losses"]))
    assert len(got["indexer_losses"]) == steps and min(got["indexer_losses"]) > 0 and diff <= 1e-7, (what, diff)
    kl = max(abs(x - y) for ra, rb in zip(a["kl"], b["kl"]) for x, y in zip(ra, rb))
    recall = max(abs(x - y) for ra, rb in zip(a["recall"], b["recall"]) for x, y in zip(ra, rb))
    assert len(b["kl"]) == len(b["recall"]) == steps and all(len(r) == 4 for r in b["kl"] + b["recall"]), what
    assert kl <= 1e-7 and recall <= 1e-6, (what, kl, recall)
    assert 0.1 < min(min(r) for r in b["recall"]) and max(max(r) for r in b["recall"]) < 0.99  # the top-k drops keys


def assert_clipped_by_true_norm(dump: Path, gnorm: float, clip: float) -> None:
    """``dump``: a ``--dump-step DIR 1`` folder.  AdamW's first moment after update 1 is (1 - beta1)
    x the clipped gradient: the clip that ran must have scaled the dumped (pre-clip, synced)
    gradients by clip / (norm + 1e-6), norm their true global norm, as torch's clip_grad_norm_ and
    the reference trainer do (parity/reference/train.py).  Adam normalises a gradient's scale, so a
    wrong clip factor barely moves the losses: only the moments show it.  (Fleet's
    HybridParallelClipGrad summed the tensor-parallel slices' squares over its check group, which
    spans the cp ranks: --tp 2 --cp 2 clipped by 3.551 for a true norm 2.702, factor 0.1408 for
    0.1851.)  ``gnorm``: the run's reported step-1 grad norm, which must equal the dump's."""
    import math

    import numpy as np
    from safetensors.numpy import load_file

    g = load_file(str(dump / "grads" / "model.safetensors"))
    m = load_file(str(dump / "exp_avg" / "model.safetensors"))
    norm = math.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in g.values()))
    assert math.isclose(norm, gnorm, rel_tol=1e-5) and norm > clip, (norm, gnorm)  # the clip bites
    want = clip / (norm + 1e-6)
    got = sum(float((m[k].astype(np.float64) * g[k]).sum()) for k in g) / (0.1 * norm * norm)
    assert math.isclose(got, want, rel_tol=1e-5), f"clip factor {got:.6f} (a norm of {clip / got:.4f}), want {want:.6f}"
    for k in g:
        np.testing.assert_allclose(m[k], 0.1 * want * g[k], rtol=1e-4, atol=1e-9, err_msg=k)


def run_nodes(
    command: list[str], nnodes: int = 2, timeout: float = 300, per_node: list[list[str]] | None = None
) -> list[tuple[int, str, str]]:
    """``command`` as ``nnodes`` simulated nodes on this machine, each with ``--nnodes N --master
    127.0.0.1:PORT --node-rank R`` added (one free port, one rendezvous) and node R's own flags
    ``per_node[R]`` after them (a later ``--nnodes`` there wins); -> (status, stdout, stderr) per
    node. Every node is killed on the way out, whatever happened."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = [*command, "--nnodes", str(nnodes), "--master", f"127.0.0.1:{port}"]
    nodes = [
        subprocess.Popen(
            [*base, *(per_node[r] if per_node else []), "--node-rank", str(r)],
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(nnodes)
    ]
    try:
        got = [p.communicate(timeout=timeout) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(nodes, got)]
