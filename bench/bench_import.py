"""Start-up and shut-down cost of a process, ours against plain ``import paddle``.

Every process of a distributed job (the ``glm52 train`` command, Paddle's launcher, each worker)
and every multi-process test pays its imports, and, on a normal exit, the interpreter's teardown
of what it imported.  Each case runs in a fresh interpreter, ``--repeats`` times; the table gives
the median CPU time (user + sys) and wall time of the import, the ratio to ``import paddle``, and
the teardown (from the last statement to the process's end) of a normal exit and of
``os._exit`` (what our entry points do: paddleformers_glm/_exit.py).

    python bench/bench_import.py [--repeats 5] [--json OUT.json]

CPU time is the measure on a shared machine; wall time is only meaningful on an idle one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    "python (nothing)": "pass",
    "import paddle": "import paddle",
    "paddleformers_glm (config only)": "import paddleformers_glm",
    "glm52 CLI (parser)": "from paddleformers_glm.cli import build_parser; build_parser()",
    # what the glm52 train command itself does before it starts the launcher (toy, TP2 x PP2)
    "glm52 train's pre-launch check": (
        "import argparse, tempfile; from paddleformers_glm.train.command import add_train_arguments, check_args; "
        "check_args(add_train_arguments(argparse.ArgumentParser()).parse_args("
        "['--model', 'toy', '--tp', '2', '--pp', '2', '--out', tempfile.gettempdir()]))"
    ),
    "model (GlmMoeDsaForCausalLM)": "from paddleformers_glm.modeling import GlmMoeDsaForCausalLM",
    "training worker (train.loop)": "from paddleformers_glm.train.loop import TrainConfig, run_training",
    "Paddle's launcher (launch.main)": "import paddle.distributed.launch.main",
}

# the child measures its own import, then reports and leaves as told (normal exit or os._exit)
_CHILD = """
import os, sys, time, json, resource
t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
exec(compile(sys.argv[1], "<case>", "exec"))
r1 = resource.getrusage(resource.RUSAGE_SELF)
wall = time.perf_counter() - t0
cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
print(json.dumps({"wall": wall, "cpu": cpu, "end": time.time()}), flush=True)
if sys.argv[2] == "os_exit":
    os._exit(0)
"""


def run_case(code: str, exit_kind: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("GLOG_minloglevel", "2")
    p = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _CHILD, code, exit_kind],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    done = time.time()
    rec = json.loads(p.stdout.strip().splitlines()[-1])
    rec["teardown"] = done - rec.pop("end")
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the medians to this file")
    ns = ap.parse_args()
    rows = {}
    for name, code in CASES.items():
        normal = [run_case(code, "normal") for _ in range(ns.repeats)]
        fast = [run_case(code, "os_exit") for _ in range(ns.repeats)]
        rows[name] = {
            "cpu_s": statistics.median(r["cpu"] for r in normal + fast),
            "wall_s": statistics.median(r["wall"] for r in normal + fast),
            "teardown_s": statistics.median(r["teardown"] for r in normal),
            "teardown_os_exit_s": statistics.median(r["teardown"] for r in fast),
        }
    base = rows["import paddle"]["cpu_s"]
    print(f"{'case':<36} {'import cpu s':>12} {'vs paddle':>9} {'wall s':>8} {'exit s':>8} {'os._exit s':>10}")
    for name, r in rows.items():
        print(
            f"{name:<36} {r['cpu_s']:>12.3f} {r['cpu_s'] / base:>9.2f} {r['wall_s']:>8.3f} "
            f"{r['teardown_s']:>8.3f} {r['teardown_os_exit_s']:>10.3f}"
        )
    print(f"(median of {ns.repeats}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
