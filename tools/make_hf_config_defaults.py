#!/usr/bin/env python
"""Write tests/fixtures/hf_config_defaults.json: what transformers' ``GlmMoeDsaConfig`` holds when a
key is not given, measured with transformers itself (tests/test_config_defaults.py reads it; the test
needs no transformers).

* ``defaults``: ``GlmMoeDsaConfig().to_dict()``, less the generic ``PreTrainedConfig`` fields.
* ``dropped_from_official``: for every key of the official config.json (configs/glm52-744b-a40b),
  the value transformers holds for that key when the file is loaded with that key removed; keys
  transformers does not hold then are listed in ``not_held_when_dropped``.
* ``derived``: the indexer schedule transformers derives from ``index_topk_freq`` alone (no
  ``index_skip_topk_offset``, no list, no pattern), and ``n_routed_experts`` given as ``num_experts``.

Needs torch + transformers (``pip install -e .[reference]``). ``--check`` compares with the committed file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "hf_config_defaults.json"
OFFICIAL = ROOT / "configs" / "glm52-744b-a40b" / "config.json"
# PreTrainedConfig's own fields: not the model's settings
GENERIC = {
    "_name_or_path",
    "chunk_size_feed_forward",
    "id2label",
    "label2id",
    "is_encoder_decoder",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "problem_type",
    "transformers_version",
}
SCHEDULE = {"num_hidden_layers": 8, "index_topk_freq": 4}


def _plain(v):
    return json.loads(json.dumps(v))


def build() -> dict:
    import transformers
    from transformers import GlmMoeDsaConfig

    defaults = {k: v for k, v in GlmMoeDsaConfig().to_dict().items() if k not in GENERIC}
    official = json.loads(OFFICIAL.read_text())
    dropped, absent = {}, []
    for key in sorted(official):
        cfg = GlmMoeDsaConfig.from_dict({k: v for k, v in official.items() if k != key})
        if key in GENERIC or not hasattr(cfg, key):
            absent.append(key)
        else:
            dropped[key] = getattr(cfg, key)
    return _plain(
        {
            "about": "transformers' GlmMoeDsaConfig values for keys not given; written by tools/make_hf_config_defaults.py",
            "transformers": transformers.__version__,
            "official_config": str(OFFICIAL.relative_to(ROOT)),
            "defaults": dict(sorted(defaults.items())),
            "dropped_from_official": dropped,
            "not_held_when_dropped": absent,
            "derived": {
                "schedule_kwargs": SCHEDULE,
                "schedule_indexer_types": list(GlmMoeDsaConfig(**SCHEDULE).indexer_types),
                "num_experts_8_n_routed_experts": GlmMoeDsaConfig(num_experts=8).n_routed_experts,
            },
        }
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed file, write nothing")
    args = ap.parse_args()
    text = json.dumps(build(), indent=1, sort_keys=False) + "\n"
    if args.check:
        same = OUT.exists() and OUT.read_text() == text
        print("same" if same else f"differs: {OUT}")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
