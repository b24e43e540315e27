"""paddleformers_glm: GLM-5.2 (`glm_moe_dsa`) for PaddlePaddle.

Paddle itself is an extra: clusters install `paddlepaddle-gpu` themselves and must not be pulled
onto the CPU wheel; `pip install -e .[cpu]` gives the CPU build used by tests and CI.
"""

import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithData(build_py):
    """Ship the repo-level data the library reads at run time (AOA rules, model configs) inside the
    package, so a non-editable install finds them under paddleformers_glm/_data/."""

    def run(self):
        super().run()
        for folder in ("aoa_mappings", "configs"):
            src = os.path.join(HERE, folder)
            dst = os.path.join(self.build_lib, "paddleformers_glm", "_data", folder)
            if os.path.isdir(src):
                shutil.rmtree(dst, ignore_errors=True)
                shutil.copytree(src, dst)


setup(
    name="paddleformers_glm",
    version="0.1.0",
    description="GLM-5.2 (glm_moe_dsa) for PaddlePaddle: model, AOA checkpoints, Fleet training, parity checkers",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["paddleformers_glm", "paddleformers_glm.*"]),
    include_package_data=True,
    package_data={"paddleformers_glm": ["_data/**/*", "ops/*.cc"]},
    cmdclass={"build_py": BuildPyWithData},
    install_requires=["numpy>=1.24", "safetensors>=0.4.3", "tqdm>=4.60", "tokenizers>=0.19", "jinja2>=3.1"],
    extras_require={
        "cpu": ["paddlepaddle==3.3.1"],
        "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "ruff>=0.6"],
        # accelerate: transformers' tensor parallel plan (tp_plan="auto") needs it (bench_generate --tp)
        "reference": ["torch==2.13.0", "transformers==5.23.0", "accelerate==1.16.0"],
        "plot": ["matplotlib>=3.7"],
        # PaddleFormers' Auto classes and Trainer (integrations/paddleformers.py). Its own pins
        # clash: fast-dataindex wants numpy<=1.26.4 while the newest pyarrow needs NumPy 2;
        # pyarrow<21 keeps one consistent set (NumPy 1.26). Install it in its own virtualenv:
        # it also brings transformers 5.3, not the `reference` extra's 5.23.
        "paddleformers": ["paddleformers==1.2.0", "pyarrow<21"],
    },
    entry_points={"console_scripts": ["glm52=paddleformers_glm.cli:main"]},
)
