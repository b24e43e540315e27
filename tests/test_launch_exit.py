"""How processes end: our entry points leave through ``os._exit`` with their status and flushed
output, and Paddle's launcher run through ``paddleformers_glm.train.lifeline`` (as the trainer runs
it) passes on the exit status Paddle's controller gives."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests._dist.runner import env


def test_exit_now_flushes_output_and_keeps_the_status():
    code = "import sys; from paddleformers_glm._exit import exit_now; print('out', end=''); "
    code += "sys.stderr.write('err'); exit_now(3)"
    p = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout, p.stderr) == (3, "out", "err")


def test_cli_module_exit_status_and_usage_errors():
    p = subprocess.run(
        [sys.executable, "-m", "paddleformers_glm.train", "--out", "x"],  # --model missing: argparse's 2
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "--model" in p.stderr, (p.returncode, p.stderr[-500:])


_WORKERS = """
import os, sys, time
status, pid_file = int(sys.argv[1]), sys.argv[2]
if os.environ["PADDLE_TRAINER_ID"] == "0":
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(pid_file + ".tmp", pid_file)
    sys.exit(0)

def exited(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True

t = time.monotonic()
while not (os.path.exists(pid_file) and exited(int(open(pid_file).read()))) and time.monotonic() - t < 60:
    time.sleep(0.01)
sys.exit(status)
"""


@pytest.mark.slow
@pytest.mark.parametrize("status", [0, 3])
def test_launcher_passes_on_paddles_exit_status(tmp_path, status):
    """Two workers that import nothing; rank 1 exits with ``status``: the launcher's status is
    Paddle's controller's (its ``sys.exit``), now given through ``os._exit``.  Rank 1 leaves once
    rank 0 has: the controller, polling each second, SIGTERMs a rank still running when it sees
    another fail and then passes on the lowest rank's non-zero status (measured: rank 0 delayed
    2.5 s -> 241, its -15, not 3), so a rank 0 slow to start on a loaded machine failed the test."""
    from paddleformers_glm.train.launch import launcher_command

    script = tmp_path / "w.py"
    script.write_text(_WORKERS)
    cmd = launcher_command(2, str(tmp_path / "logs"), [str(script), str(status), str(tmp_path / "rank0.pid")])
    p = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == status, (p.returncode, p.stderr[-2000:])  # as python -m paddle.distributed.launch
    assert sorted(f.name for f in (tmp_path / "logs").glob("workerlog.*")) == ["workerlog.0", "workerlog.1"]
    if status:
        assert f"Exit code {status}" in p.stdout + p.stderr, p.stderr[-2000:]  # the controller's own report
