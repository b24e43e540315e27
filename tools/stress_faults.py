"""Run each fault test of the trainer many times beside a CPU hog and count the diagnoses.

Not part of the suite (each run launches a two-rank job, 15-50 s).  Every run of a fault must
give the same culprit and cause in ``OUT/logs/failure.json`` and leave no process of the job;
the counts are printed per fault and, with ``--json``, written as a record.

    python tools/stress_faults.py --runs 20 --faults kill,stop,hang,timeout --hog 2

Faults (``--tp 2``, rank 1, toy model):

* ``raise``   a Python exception at step 2               -> rank 1, cause "error"
* ``kill``    SIGKILL of itself at step 2                 -> rank 1, cause "died"
* ``stop``    SIGSTOP of itself at step 2 (gloo timeout)  -> rank 1, cause "stopped"
* ``hang``    sleeps at step 2 (gloo timeout on rank 0)   -> rank 1, cause "hung"
* ``sigint`` / ``sigterm``: the signal to the launcher once rank 1 began step 2 -> no rank,
  cause "signal" (the ranks' view of the teardown that follows is not a death)
* ``timeout`` sleeps at step 1, ``--job-timeout 45``      -> rank 1, cause "hung", whichever
  ends the job: the job timeout, or gloo's 30 s timeout counted from rank 0's first collective
  (a job timeout that fires before rank 0 has begun step 1 finds nobody behind: on a loaded
  2-core machine start-up alone reached 30 s)
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paddleformers_glm._io import write_json_atomic  # noqa: E402
from paddleformers_glm.train.launch import job_processes  # noqa: E402

FAULTS = {
    "raise": (["--fault", "rank=1,step=2,kind=raise"], (1, "error")),
    "kill": (["--fault", "rank=1,step=2,kind=kill"], (1, "died")),
    "stop": (["--fault", "rank=1,step=2,kind=stop"], (1, "stopped")),
    "hang": (["--fault", "rank=1,step=2,kind=hang"], (1, "hung")),
    "timeout": (["--fault", "rank=1,step=1,kind=hang", "--job-timeout", "45"], (1, "hung")),
    "sigint": (["--steps", "10000"], (None, "signal")),
    "sigterm": (["--steps", "10000"], (None, "signal")),
}
SIGNALS = {"sigint": signal.SIGINT, "sigterm": signal.SIGTERM}
COMMON = ["--model", "toy", "--tp", "2", "--steps", "4", "--seq-len", "16", "--global-batch-size", "4", "--no-progress"]


def _hog() -> None:
    while True:
        pass


def run_once(fault: str, out: Path, timeout_s: float) -> dict:
    """One launch of ``fault``; its failure record's culprit and cause, and the job's leftovers."""
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "paddleformers_glm.train", *COMMON, "--out", str(out), *FAULTS[fault][0]]
    if fault in SIGNALS:
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        beat = out / "logs" / "status" / "rank1.beat"
        while p.poll() is None and time.monotonic() - t0 < timeout_s:
            try:
                if int(json.loads(beat.read_text()).get("step") or 0) >= 2:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        p.send_signal(SIGNALS[fault])
        _, stderr = p.communicate(timeout=timeout_s)
        p = subprocess.CompletedProcess(cmd, p.returncode, "", stderr)
    else:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    secs = time.monotonic() - t0
    try:
        rec = json.loads((out / "logs" / "failure.json").read_text())
    except (OSError, ValueError):
        rec = {"rank": None, "cause": "no failure.json"}
    try:
        job = json.loads((out / "logs" / "job.json").read_text())["job_id"]
        left = job_processes(job)
    except (OSError, ValueError, KeyError):
        left = []
    return {"rc": p.returncode, "rank": rec.get("rank"), "cause": rec.get("cause"), "seconds": secs, "left": left,
            "message": str(rec.get("message", p.stderr[-300:])).splitlines()[0][:200]}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--faults", default="kill,stop,hang,timeout")
    ap.add_argument("--hog", type=int, default=1, help="busy-looping processes beside the runs (0: none)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds one run may take")
    ap.add_argument("--json", default=None, help="write the counts and every run here")
    ap.add_argument("--keep", default=None, help="keep each run's output under this folder")
    args = ap.parse_args()
    faults = [f for f in args.faults.split(",") if f]
    for f in faults:
        if f not in FAULTS:
            ap.error(f"unknown fault {f!r}; known: {', '.join(FAULTS)}")
    hogs = [multiprocessing.Process(target=_hog, daemon=True) for _ in range(args.hog)]
    for h in hogs:
        h.start()
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="glm52_stress_"))
    results: dict[str, list[dict]] = {}
    try:
        for f in faults:
            want = FAULTS[f][1]
            for i in range(args.runs):
                r = run_once(f, base / f"{f}_{i:02d}", args.timeout)
                r["ok"] = (r["rank"], r["cause"]) == want and r["rc"] != 0 and not r["left"]
                results.setdefault(f, []).append(r)
                print(f"{f} {i + 1}/{args.runs}: rank {r['rank']} {r['cause']} rc {r['rc']} {r['seconds']:.0f}s "
                      f"{'ok' if r['ok'] else 'WRONG: ' + r['message']}", flush=True)  # fmt: skip
    finally:
        for h in hogs:
            h.terminate()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    summary = {}
    print("\nfault    expected            same/total  diagnoses")
    for f, rs in results.items():
        counts = collections.Counter(f"rank {r['rank']} {r['cause']}" for r in rs)
        ok = sum(r["ok"] for r in rs)
        want = FAULTS[f][1]
        summary[f] = {"expected": f"rank {want[0]} {want[1]}", "ok": ok, "runs": len(rs), "diagnoses": dict(counts)}
        print(f"{f:8} rank {want[0]} {want[1]:13} {ok:>3}/{len(rs):<3}      {dict(counts)}")
    if args.json:
        write_json_atomic(args.json, {"hog": args.hog, "summary": summary, "runs": results}, indent=1, sort_keys=False)
    return 0 if all(s["ok"] == s["runs"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
