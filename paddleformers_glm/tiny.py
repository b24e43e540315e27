"""The embedded default: a tiny GLM-5.2 checkpoint in the official HF layout, made deterministically.

`configs/glm52-tiny/config.json` has the official structure (8 layers with shared indexer layers,
dense first layers, grouped MoE, one MTP layer); weights are drawn from a seeded numpy generator
(N(0, initializer_range), norms 1, biases 0 -- HF's init) so every machine makes the same bytes,
and written like the official release: bf16, two shards, `model.safetensors.index.json`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .configuration import GlmMoeDsaConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
_CANDIDATES = [
    Path(__file__).resolve().parent / "_data" / "configs" / "glm52-tiny" / "config.json",  # installed wheel
    REPO_ROOT / "configs" / "glm52-tiny" / "config.json",  # source tree / editable install
]
TINY_CONFIG = next((p for p in _CANDIDATES if p.is_file()), _CANDIDATES[-1])


def tiny_config(**overrides) -> GlmMoeDsaConfig:
    if not TINY_CONFIG.is_file():
        raise FileNotFoundError(f"tiny config not found at {TINY_CONFIG} (install the project with `pip install -e .`)")
    return GlmMoeDsaConfig.from_pretrained(TINY_CONFIG, **overrides)


def init_state(config: GlmMoeDsaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Fleet-named fp32 arrays with HF's init, from a seeded numpy generator (platform independent)."""
    from .checkpoint import fleet_param_specs

    rng = np.random.default_rng(seed)
    std = float(config.initializer_range)
    out = {}
    for name, (shape, _kind) in fleet_param_specs(config).items():
        if len(shape) == 2:
            arr = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        elif name.endswith(("k_norm.bias", "e_score_correction_bias")):
            arr = np.zeros(shape, dtype=np.float32)
        else:  # RMSNorm / LayerNorm weights
            arr = np.ones(shape, dtype=np.float32)
        out[name] = arr
    return out


def make_tiny_checkpoint(out_dir: str | os.PathLike, seed: int = 0, max_shard_size: str = "1MB") -> str:
    """Write the tiny official-layout checkpoint to `out_dir` (atomic) and return its path."""
    import paddle

    from .checkpoint import save_pretrained_state

    config = tiny_config()
    state = {k: paddle.to_tensor(v) for k, v in init_state(config, seed).items()}
    save_pretrained_state(state, config, out_dir, layout="hf", max_shard_size=max_shard_size)
    return os.fspath(out_dir)


def register_make_tiny(sub) -> None:
    p = sub.add_parser("make-tiny", help="write the tiny official-layout GLM-5.2 checkpoint (the embedded default)")
    p.add_argument("out", help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-size", default="1MB", help="shard size limit (default 1MB: two shards)")

    def run(args) -> int:
        path = make_tiny_checkpoint(args.out, seed=args.seed, max_shard_size=args.max_shard_size)
        files = sorted(os.listdir(path))
        print(f"tiny GLM-5.2 checkpoint (official HF layout) written to {path}: {', '.join(files)}")
        return 0

    p.set_defaults(func=run)
