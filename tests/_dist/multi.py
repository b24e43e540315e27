"""Run several tests/_dist scripts one after another in the same launched processes, so one
launch (process start, Paddle import, process-group setup) serves several tests.

usage (under Paddle's launcher): multi.py SPEC_JSON, SPEC = [[script, [args...]], ...]

Each script runs as ``__main__`` with its own ``sys.argv``; scripts that set up the same
topology share it (``init_topology`` returns the current one for the same layout).  Each prints
``MULTI_DONE <script> <rank>`` when it finished; the first script that raises ends the process
with its traceback and ``MULTI_FAILED <script> <rank>`` (the scripts after it would otherwise
wait on collectives the failed rank never joins).  The process leaves through ``os._exit``
(see paddleformers_glm/_exit.py): nothing is left to tear down.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
from pathlib import Path

from paddleformers_glm._exit import exit_code, exit_now

HERE = Path(__file__).resolve().parent


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    rank = os.environ.get("PADDLE_TRAINER_ID", "0")
    for script, args in spec:
        path = str(HERE / script)
        sys.argv = [path, *args]
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:  # a script's own sys.exit: 0 is success
            if exit_code(e) != 0:
                print(f"MULTI_FAILED {script} {rank} (exit {exit_code(e)})", flush=True)
                exit_now(exit_code(e))
        except BaseException:  # noqa: BLE001 - reported, then this rank ends
            traceback.print_exc()
            print(f"MULTI_FAILED {script} {rank}", flush=True)
            exit_now(1)
        print(f"MULTI_DONE {script} {rank}", flush=True)
    exit_now(0)


if __name__ == "__main__":
    main()
