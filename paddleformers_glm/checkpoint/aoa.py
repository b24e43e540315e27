"""The HF <-> Fleet key mapping as data (``aoa_mappings/glm_moe_dsa.json``), expanded per config.

The rules are statements of Paddle's AOA language grouped into *units* (a set of tensors that map
onto each other: e.g. gate/up/down of one expert <-> up_gate/down). This module only substitutes
placeholders from the config's per-layer schedule (indexer only on "full" layers and the MTP layer,
dense vs MoE MLP, the MTP wrapper prefix, one unit per routed expert) and adds cast lines; Paddle's
``AOAEngine`` parses and runs the statements. Macros are expanded here rather than by the engine
because the engine's ``$EXPERT_ID`` expansion matches source keys only, which breaks the inverse
direction on intermediate tensors (probes/paddle-aoa/README.md).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import CheckpointError
from .layout import LayerPlan, layer_plan

__all__ = [
    "DIRECTIONS",
    "MappingUnit",
    "rules_path",
    "load_rules",
    "expand_units",
    "build_statements",
    "quiet_paddle_logs",
]

DIRECTIONS = ("hf_to_fleet", "fleet_to_hf")
RULES_FILE = "glm_moe_dsa.json"
_PLACEHOLDER = re.compile(r"\$(EXPERT_ID|LAYER_ID|LAYER|FLEET|HF)\b")
_MTP_TAG = "MTP wrapper prefix"


def rules_path() -> str:
    """Where the mapping rules are: ``$GLM52_AOA_MAPPINGS``, the installed package data, or the repo."""
    env = os.environ.get("GLM52_AOA_MAPPINGS")
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    candidates = [
        *([os.path.join(env, RULES_FILE) if os.path.isdir(env) else env] if env else []),
        os.path.join(pkg, "_data", "aoa_mappings", RULES_FILE),
        os.path.join(os.path.dirname(pkg), "aoa_mappings", RULES_FILE),
    ]
    for c in candidates:
        if os.path.isfile(c):
            return c
    raise FileNotFoundError(f"AOA mapping rules {RULES_FILE} not found; looked in {candidates}")


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime: float) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        rules = json.load(f)
    for u in rules.get("units", []):
        for field in ("name", "scope", "hf", "fleet", *DIRECTIONS):
            if field not in u:
                raise ValueError(f"{path}: unit {u.get('name', '?')!r} has no {field!r}")
        if u["scope"] not in ("global", "decoder", "expert", "mtp"):
            raise ValueError(f"{path}: unit {u['name']!r}: unknown scope {u['scope']!r}")
    return rules


def load_rules(path: str | None = None) -> dict[str, Any]:
    """The parsed rules file (cached by path and mtime)."""
    path = path or rules_path()
    return _load(path, os.path.getmtime(path))


@dataclass(frozen=True)
class MappingUnit:
    """Tensors that map onto each other, with the statements for each direction."""

    name: str
    tags: tuple[str, ...]
    hf: tuple[str, ...]
    fleet: tuple[str, ...]
    hf_to_fleet: tuple[str, ...]
    fleet_to_hf: tuple[str, ...]
    layer: int | None = None

    def sources(self, direction: str) -> tuple[str, ...]:
        return self.hf if direction == "hf_to_fleet" else self.fleet

    def targets(self, direction: str) -> tuple[str, ...]:
        return self.fleet if direction == "hf_to_fleet" else self.hf

    def statements(self, direction: str) -> tuple[str, ...]:
        return getattr(self, direction)

    @property
    def renames(self) -> bool:
        """True when some tensor is stored differently on the two sides (not a pure identity)."""
        return self.hf != self.fleet or any(self.hf_to_fleet) or any(self.fleet_to_hf)


def _is_identity(stmt: str) -> bool:
    parts = [p.strip() for p in stmt.split("->")]
    return len(parts) == 2 and "," not in stmt and "^T" not in stmt and parts[0] == parts[1]


def _subst(text: str, values: Mapping[str, str]) -> str:
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def _applies(unit: Mapping[str, Any], lp: LayerPlan | None, config: Any) -> bool:
    when = unit.get("when")
    if when is None:
        return True
    if when == "attention_bias":
        return bool(config.attention_bias)
    assert lp is not None
    if when == "indexer":
        return lp.indexer
    if when == "dense":
        return not lp.moe
    if when == "moe":
        return lp.moe
    raise ValueError(f"unit {unit['name']!r}: unknown condition {when!r}")


def _make(
    unit: Mapping[str, Any], values: Mapping[str, str], extra_tags: Sequence[str], layer: int | None
) -> MappingUnit:
    def sub(items: Iterable[str]) -> tuple[str, ...]:
        return tuple(_subst(s, values) for s in items)

    stmts = {d: tuple(s for s in sub(unit[d]) if not _is_identity(s)) for d in DIRECTIONS}
    name = _subst(unit["name"], values)
    if layer is not None:
        name = f"{name}@{layer}" + (f".e{values['EXPERT_ID']}" if values.get("EXPERT_ID") else "")
    return MappingUnit(
        name=name,
        tags=tuple(dict.fromkeys([*unit.get("tags", []), *extra_tags])),
        hf=sub(unit["hf"]),
        fleet=sub(unit["fleet"]),
        hf_to_fleet=stmts["hf_to_fleet"],
        fleet_to_hf=stmts["fleet_to_hf"],
        layer=layer,
    )


def expand_units(config: Any, rules: Mapping[str, Any] | None = None) -> list[MappingUnit]:
    """All mapping units of a model: global ones, then per layer (decoder, experts, MTP wrapper)."""
    rules = rules or load_rules()
    units: list[MappingUnit] = []
    raw = rules["units"]
    for u in raw:
        if u["scope"] == "global" and _applies(u, None, config):
            units.append(_make(u, {}, (), None))
    E = int(config.n_routed_experts)
    for lp in layer_plan(config):
        values = {
            "HF": lp.hf_prefix,
            "FLEET": lp.fleet_prefix,
            "LAYER": lp.hf_prefix,
            "LAYER_ID": str(lp.index),
            "EXPERT_ID": "",
        }
        extra = (_MTP_TAG,) if lp.mtp else ()
        for u in raw:
            if u["scope"] == "decoder" and _applies(u, lp, config):
                units.append(_make(u, values, extra, lp.index))
            elif u["scope"] == "expert" and _applies(u, lp, config):
                for e in range(E):
                    units.append(_make(u, {**values, "EXPERT_ID": str(e)}, extra, lp.index))
            elif u["scope"] == "mtp" and lp.mtp:
                units.append(_make(u, values, (), lp.index))
    return units


def build_statements(
    units: Sequence[MappingUnit],
    direction: str,
    src_dtypes: Mapping[str, str],
    dst_dtypes: Mapping[str, str],
    rules: Mapping[str, Any] | None = None,
) -> list[str]:
    """The AOA program for ``units`` in ``direction``, with casts where source and target dtypes differ.

    A cast goes after the unit's statements on each target whose dtype differs from its sources'
    (``src_dtype``/``dst_dtype`` form, so the program also runs under ``aoa_config_reverse``). When
    a unit's sources disagree on dtype (e.g. gate in bf16, up in fp32 — a fused concat needs one
    dtype), each source is cast to the unit's single target dtype first.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; expected one of {DIRECTIONS}")
    rules = rules or load_rules()
    cast = rules["cast"]
    out: list[str] = []

    def cast_line(key: str, a: str, b: str) -> str:
        return cast.replace("$KEY", key).replace("$SRC_DTYPE", a).replace("$DST_DTYPE", b)

    for u in units:
        srcs, tgts = u.sources(direction), u.targets(direction)
        s_types = {k: src_dtypes[k] for k in srcs}
        t_types = {k: dst_dtypes[k] for k in tgts}
        if len(set(s_types.values())) <= 1:
            out.extend(u.statements(direction))
            s = next(iter(s_types.values()), None)
            out.extend(cast_line(k, s, t) for k, t in t_types.items() if s is not None and t != s)
        elif len(set(t_types.values())) == 1:
            t = next(iter(t_types.values()))
            out.extend(cast_line(k, s, t) for k, s in s_types.items() if s != t)
            out.extend(u.statements(direction))
        else:
            raise CheckpointError(
                f"mapping unit {u.name} mixes source dtypes and target dtypes; cannot cast consistently",
                key=srcs[0],
                expected="one source dtype or one target dtype",
                actual={"sources": s_types, "targets": t_types},
            )
    return out


def quiet_paddle_logs() -> None:
    """Paddle's checkpoint code logs one INFO line per call; keep user output readable."""
    for name in ("paddle.distributed.flex_checkpoint", "paddle.distributed.fleet.utils.log_util", "root"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        from paddle.distributed.fleet.utils.log_util import logger as fleet_logger

        fleet_logger.setLevel(logging.WARNING)
    except Exception:  # pragma: no cover - logging only
        pass
