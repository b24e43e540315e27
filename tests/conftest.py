import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OFFICIAL_CONFIG = ROOT / "configs" / "glm52-744b-a40b" / "config.json"
TINY_CONFIG = ROOT / "configs" / "glm52-tiny" / "config.json"
FIXTURES = ROOT / "tests" / "fixtures"

os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "5")


@pytest.fixture(autouse=True)
def _cpu_fp32():
    """Every test runs on CPU in fp32 with a fixed seed; tests that need otherwise say so."""
    import paddle

    paddle.set_device("cpu")
    paddle.set_default_dtype("float32")
    paddle.seed(1234)
    yield
    paddle.set_default_dtype("float32")
