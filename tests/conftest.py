import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OFFICIAL_CONFIG = ROOT / "configs" / "glm52-744b-a40b" / "config.json"
TINY_CONFIG = ROOT / "configs" / "glm52-tiny" / "config.json"
FIXTURES = ROOT / "tests" / "fixtures"

os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")

# Files whose tests share a package-scoped launch (conftest fixtures below), by the file that
# starts it.  Under pytest-xdist (scripts/test.sh: ``-n 3 --dist loadfile``) each file runs in one
# worker, so that its module fixtures are built once, and these files in the same worker, so that
# each shared launch still happens once.
SHARED_LAUNCH_FILES = {
    "test_parallel_fleet_gloo.py": "test_parallel_dist.py",  # tp2_script_results
    "test_train_reshard.py": "test_save_distributed.py",  # dist_save_and_flex_probe
}


def _file_group(path: str) -> str:
    name = path.split("::", 1)[0].replace("\\", "/").rsplit("/", 1)[-1]
    return SHARED_LAUNCH_FILES.get(name, name)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's ``--dist loadfile``, with the files of SHARED_LAUNCH_FILES as one."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # keep the collection order: heaviest files first (below)

    class LoadFileSharingLaunches(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _file_group(nodeid)

    return LoadFileSharingLaunches(config, log)


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    # the files with the most multi-process tests first, so that no long one starts last
    slow: dict[str, int] = {}
    for item in items:
        g = _file_group(item.nodeid)
        slow[g] = slow.get(g, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[_file_group(item.nodeid)])


@pytest.fixture(autouse=True)
def _cpu_fp32():
    """Every test runs on CPU in fp32 with a fixed seed; tests that need otherwise say so."""
    import paddle

    paddle.set_device("cpu")
    paddle.set_default_dtype("float32")
    paddle.seed(1234)
    yield
    paddle.set_default_dtype("float32")


@pytest.fixture(scope="package")  # tests/ is one package: one launch for both users
def dist_save_and_flex_probe(tmp_path_factory) -> dict:
    """One two-rank launch shared by three tests: ``from_pretrained`` + ``save_pretrained`` of the
    tiny checkpoint at TP2 x EP2 (``tests/_dist/check_save_dist.py``), then, in the same processes,
    the flex-checkpoint CPU probe (``tests/_dist/check_flex_cpu.py``) and ``generate`` on the split
    model (``tests/_dist/check_generate_dist.py``, into ``generate/``).  Each test asserts its part."""
    from paddleformers_glm.tiny import make_tiny_checkpoint
    from tests._dist.runner import launch_scripts

    d = tmp_path_factory.mktemp("dist_save")
    ckpt = pathlib.Path(make_tiny_checkpoint(d / "ckpt"))
    args = [str(ckpt), str(d / "save"), str(d / "r.json"), "2", "2", "1MB", str(d / "flex")]
    scripts = [("check_save_dist.py", args), ("check_generate_dist.py", [str(ckpt), str(d / "generate"), "2", "2"])]
    p = launch_scripts(2, scripts, d / "logs", timeout=300)
    logs = [(d / "logs" / f"workerlog.{r}") for r in range(2)]
    return {
        "proc": p,
        "dir": d,
        "ckpt": ckpt,
        "logs": "\n".join(f.read_text(errors="replace") for f in logs if f.is_file()),
    }


@pytest.fixture(scope="package")
def tp2_script_results(tmp_path_factory) -> dict:
    """One two-rank TP2 launch shared by two test files: ``tests/_dist/check_comm.py`` (our
    collectives, parallel layers, expert dispatch; test_parallel_dist.py), then in the same
    processes ``tests/_dist/check_fleet_layers.py`` (Fleet's stock TP/SP layers on gloo;
    test_parallel_fleet_gloo.py), then ``tests/_dist/check_nonfinite_ranks.py`` (non-finite values
    on one rank only; test_parallel_dist.py).  Each script writes its own JSON; each test reads its own."""
    from tests._dist.runner import launch_scripts, script_logs

    d = tmp_path_factory.mktemp("tp2_scripts")
    scripts = [("check_comm.py", [str(d / "comm.json")]), ("check_fleet_layers.py", [str(d / "fleet.json")])]
    scripts.append(("check_nonfinite_ranks.py", [str(d / "nonfinite.json")]))
    p = launch_scripts(2, scripts, d / "logs", timeout=300)
    return {"proc": p, "dir": d, "logs": script_logs(d / "logs", 2)}
