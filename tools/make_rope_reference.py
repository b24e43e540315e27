#!/usr/bin/env python
"""HF's rope inverse frequencies: tests/fixtures/rope/hf_inv_freq.json.

transformers' `GlmMoeDsaRotaryEmbedding.inv_freq` (its `attention_scaling` too) for the official
config (configs/glm52-744b-a40b: theta 8e6, qk_rope_head_dim 64), the tiny config
(configs/glm52-tiny: dim 16) and the tiny config with the yarn rope of the `tiny_pattern_yarn`
reference case. Each float32 is stored as the JSON number of its exact value. tests/test_numerics_pins.py
holds `rope_inv_freq` to these bitwise, without torch.

    python tools/make_rope_reference.py            # rewrite the fixture
    python tools/make_rope_reference.py --check    # compare with the committed file, exit 1 if it differs
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "rope" / "hf_inv_freq.json"
# the yarn rope of the tiny_pattern_yarn fixture (made by tools/make_reference.py)
YARN = json.loads((ROOT / "tests" / "fixtures" / "tiny_pattern_yarn" / "checkpoint" / "config.json").read_text())[
    "rope_parameters"
]


def cases() -> dict[str, dict]:
    """name -> the config.json dict HF builds its rotary embedding from."""
    official = json.loads((ROOT / "configs" / "glm52-744b-a40b" / "config.json").read_text())
    tiny = json.loads((ROOT / "configs" / "glm52-tiny" / "config.json").read_text())
    return {"official": official, "tiny": tiny, "tiny_yarn": {**tiny, "rope_parameters": dict(YARN)}}


def build() -> dict:
    import torch
    import transformers
    from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaRotaryEmbedding

    out = {}
    for name, cfg in cases().items():
        conf = GlmMoeDsaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "quantization_config")})
        rope = GlmMoeDsaRotaryEmbedding(conf)
        inv = rope.inv_freq.to(torch.float32).numpy()
        out[name] = {
            "rope_parameters": conf.rope_parameters,
            "qk_rope_head_dim": conf.qk_rope_head_dim,
            "inv_freq": [float(v) for v in inv],
            "attention_scaling": float(rope.attention_scaling),
        }
    return {"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__, "cases": out}


def main(argv: list[str] | None = None) -> int:
    from make_nonfinite_reference import write_or_check  # tools/ is the script's own folder

    text = json.dumps(build(), indent=1, sort_keys=True, allow_nan=False) + "\n"
    return write_or_check(OUT, text, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
