"""The HF <-> Fleet key mapping as data (``aoa_mappings/glm_moe_dsa.json``), expanded per config
(docs/checkpoints.md, "The mapping rules"): placeholders are substituted here, as Paddle's own
``$EXPERT_ID`` expansion breaks the inverse direction. In every unit the ``hf`` side is the checkpoint
(or the official layout), so the loader and saver drive all unit sets (:func:`checkpoint_units`)
with the same two directions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._io import read_json
from .errors import CheckpointError
from .layout import EXPERT_LAYOUTS, LayerPlan, layer_plan, model_param_specs

__all__ = [
    "DIRECTIONS",
    "MappingUnit",
    "rules_path",
    "load_rules",
    "expand_units",
    "build_statements",
    "quiet_paddle_logs",
    "reading_a_share",
    "fleet_units",
    "checkpoint_units",
    "memo_units",
    "relayout_fused",
    "identity_units",
    "TP_FUSED_FFN",
    "invert_statements",
]

DIRECTIONS = ("hf_to_fleet", "fleet_to_hf")
RULES_FILE = "glm_moe_dsa.json"
_PLACEHOLDER = re.compile(r"\$(EXPERT_ID|LAYER_ID|LAYER|FLEET|HF)\b")
_MTP_TAG = "MTP wrapper prefix"
_EXPERT_LIST = re.compile(r"<([^<>]*#[^<>]*)>")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
# PaddleFleet fuses these with ``fused_ffn`` (a tensor-parallel file interleaves gate/up per shard);
# routed experts are concatenated on axis 1 instead (never interleaved).
TP_FUSED_FFN = re.compile(r"\.mlp\.(shared_experts\.)?up_gate_proj\.weight$")


def rules_path() -> str:
    """Where the mapping rules are: ``$GLM52_AOA_MAPPINGS``, the installed package data, or the repo."""
    env = os.environ.get("GLM52_AOA_MAPPINGS")
    if env:  # the user's rules or none: never the packaged ones in their place
        named = os.path.join(env, RULES_FILE) if os.path.isdir(env) else env
        if not os.path.isfile(named):
            raise FileNotFoundError(
                f"GLM52_AOA_MAPPINGS={env}: no mapping rules there (a {RULES_FILE} file, or a folder holding one)"
            )
        return named
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    candidates = [
        os.path.join(pkg, "_data", "aoa_mappings", RULES_FILE),
        os.path.join(os.path.dirname(pkg), "aoa_mappings", RULES_FILE),
    ]
    for c in candidates:
        if os.path.isfile(c):
            return c
    raise FileNotFoundError(f"AOA mapping rules {RULES_FILE} not found; looked in {candidates}")


def _split_side(side: str) -> list[str]:
    """Comma-separated items of one side of a statement (an expert list ``<...>`` is one item)."""
    return [t.strip() for t in side.split(",") if t.strip()]


def invert_statements(statements: Sequence[str]) -> list[str]:
    """The statements that undo `statements` (an AOA program in one direction), in order.

    ``A -> B`` gives ``B -> A``; ``A^T -> B`` gives ``B^T -> A``; a fusion
    ``A^T, C^T -> B, fused_ffn`` gives the split ``B -> A, C, fused_ffn`` followed by ``A^T -> A``
    and ``C^T -> C``; attributes (``axis=0``, ``fused_ffn``) stay with their statement. The rules
    file writes the forward direction only and the reverse is made here, so the two cannot drift.
    """
    out: list[str] = []
    for stmt in statements:
        if stmt.count("->") != 1:
            raise ValueError(f"AOA statement {stmt!r}: expected exactly one '->'")
        lhs, rhs = (p.strip() for p in stmt.split("->"))
        items = _split_side(rhs)
        dsts = [t for t in items if "=" not in t and t != "fused_ffn"]
        attrs = [t for t in items if t not in dsts]
        srcs = [(t[:-2], True) if t.endswith("^T") else (t, False) for t in _split_side(lhs)]
        if any(d.endswith("^T") for d in dsts) or not srcs or len(dsts) != 1:
            raise ValueError(f"AOA statement {stmt!r}: only 'sources -> one target[, attributes]' can be inverted")
        (dst,) = dsts
        if len(srcs) == 1:
            name, transposed = srcs[0]
            out.append(", ".join([f"{dst}^T -> {name}" if transposed else f"{dst} -> {name}", *attrs]))
            continue
        out.append(f"{dst} -> " + ", ".join([*(name for name, _ in srcs), *attrs]))
        out.extend(f"{name}^T -> {name}" for name, transposed in srcs if transposed)
    return out


def _with_inverse(entry: dict[str, Any], forward: str, reverse: str) -> None:
    """Fill entry[reverse] from entry[forward] unless the rules write it out."""
    if forward in entry and reverse not in entry:
        entry[reverse] = invert_statements(entry[forward])


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime: float) -> dict[str, Any]:
    rules = read_json(path, "the conversion rules")
    for u in rules.get("units", []):
        _with_inverse(u, "hf_to_fleet", "fleet_to_hf")
        if "paddlefleet" in u:
            _with_inverse(u["paddlefleet"], "hf_to_fleet", "fleet_to_hf")
        for field in ("name", "scope", "hf", "fleet", *DIRECTIONS):
            if field not in u:
                raise ValueError(f"{path}: unit {u.get('name', '?')!r} has no {field!r}")
        if u["scope"] not in ("global", "decoder", "expert", "mtp"):
            raise ValueError(f"{path}: unit {u['name']!r}: unknown scope {u['scope']!r}")
    for a in rules.get("fleet_adapters", []):
        _with_inverse(a, "model_to_fleet", "fleet_to_model")
        for field in ("name", "scope", "model", "fleet", "model_to_fleet"):
            if field not in a:
                raise ValueError(f"{path}: fleet adapter {a.get('name', '?')!r} has no {field!r}")
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
    # checkpoint keys stored as N equal column shards of a tensor-parallel run (per-shard
    # ``[gate_r | up_r]``): the engine is told the source has N pieces so ``fused_ffn`` undoes them
    source_splits: tuple[tuple[str, int], ...] = ()

    def sources(self, direction: str) -> tuple[str, ...]:
        return self.hf if direction == "hf_to_fleet" else self.fleet

    def targets(self, direction: str) -> tuple[str, ...]:
        return self.fleet if direction == "hf_to_fleet" else self.hf


def _is_identity(stmt: str) -> bool:
    parts = [p.strip() for p in stmt.split("->")]
    return len(parts) == 2 and "," not in stmt and "^T" not in stmt and parts[0] == parts[1]


def _subst(text: str, values: Mapping[str, str]) -> str:
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def _applies(unit: Mapping[str, Any], lp: LayerPlan | None, config: Any) -> bool:
    when = unit.get("when")
    if when in (None, "attention_bias"):
        return when is None or bool(config.attention_bias)
    if when not in ("indexer", "dense", "moe", "shared_experts"):
        raise ValueError(f"unit {unit['name']!r}: unknown condition {when!r}")
    assert lp is not None
    shared = lp.moe and int(config.n_shared_experts) > 0  # n_shared_experts 0: the model builds none
    return {"indexer": lp.indexer, "dense": not lp.moe, "moe": lp.moe, "shared_experts": shared}[when]


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
        layer=layer,
        **stmts,
    )


def _expand_lists(items: Iterable[str], n_experts: int, keys: bool) -> list[str]:
    """``<a.#.b>`` -> ``a.0.b, a.1.b, ...`` inside a statement; as a key-list item, one key each."""

    def each(m: re.Match) -> str:
        return ", ".join(m.group(1).replace("#", str(e)) for e in range(n_experts))

    out = [_EXPERT_LIST.sub(each, s) for s in items]
    return [k.strip() for s in out for k in s.split(",")] if keys else out


def _adapters(config: Any, expert_layout: str, rules: Mapping[str, Any]) -> list[MappingUnit]:
    """The model <-> PaddleFleet adapters, expanded: ``hf`` = PaddleFleet keys, ``fleet`` = model keys."""
    E = int(config.n_routed_experts)
    raw = [
        {
            **{k: a[k] for k in ("name", "scope", "tags", "when") if k in a},
            "hf": _expand_lists(a["fleet"], E, True),
            "fleet": _expand_lists(a["model"], E, True),
            "hf_to_fleet": _expand_lists(a["fleet_to_model"], E, False),
            "fleet_to_hf": _expand_lists(a["model_to_fleet"], E, False),
        }
        for a in rules.get("fleet_adapters", [])
        if a.get("expert_layout", expert_layout) == expert_layout
    ]
    return _expand_units(config, raw)


def identity_units(keys: Iterable[str]) -> list[MappingUnit]:
    """One unit per tensor with no statements: a checkpoint already in the model's spelling."""
    return [
        MappingUnit(k, (), (k,), (k,), (), (), int(m[1]) if (m := _LAYER_RE.match(k)) else None) for k in sorted(keys)
    ]


def fleet_units(config: Any, expert_layout: str = "per-expert", fused_shards: int = 1) -> list[MappingUnit]:
    """PaddleFleet-layout checkpoint (``hf`` side) <-> the Paddle model's ``state_dict()`` (``fleet`` side).

    Every model tensor not touched by an adapter maps by name. ``fused_shards`` > 1: the file was
    written by a tensor-parallel run whose ``fused_ffn`` weights (dense and shared-expert
    ``up_gate_proj``) hold ``[gate_0 | up_0 | gate_1 | up_1 | ...]``; the same macro un-interleaves them.
    """
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"unknown expert layout {expert_layout!r}; expected one of {EXPERT_LAYOUTS}")
    units = _adapters(config, expert_layout, load_rules())
    covered = {k for u in units for k in u.fleet}
    for u in identity_units(k for k in model_param_specs(config) if k not in covered):
        k = u.fleet[0]
        if fused_shards > 1 and TP_FUSED_FFN.search(k) and ".experts." not in k:
            stmt = (f"{k} -> {k}, fused_ffn, axis=1",)
            u = dataclasses.replace(u, hf_to_fleet=stmt, fleet_to_hf=stmt, source_splits=((k, fused_shards),))
        units.append(u)
    return sorted(units, key=lambda u: -1 if u.layer is None else u.layer)


def relayout_fused(units: Sequence[MappingUnit], keys: set[str]) -> list[MappingUnit]:
    """Units whose model-side fused weights in ``keys`` come out per rank as ``[gate_r | up_r]``: a
    checkpoint storing ``[gate | up]`` globally gives a rank a plain column slice unless ``fused_ffn``
    re-lays it for the ranks in ``shard_info`` (docs/checkpoints.md, "Partial loads")."""
    out = []
    for u in units:
        mine = [k for k in u.fleet if k in keys]
        if not mine:
            out.append(u)
        elif len(u.fleet) == 1 and (not u.hf_to_fleet or u.source_splits):  # maps by name: the only statement
            out.append(dataclasses.replace(u, hf_to_fleet=(f"{mine[0]} -> {mine[0]}, fused_ffn, axis=1",)))
        else:  # the program makes k: make it under a temporary name, then re-lay that into k
            stmts = list(u.hf_to_fleet)
            for k in mine:
                token = re.compile(rf"(?<![\w.]){re.escape(k)}(?![\w.])")
                stmts = [token.sub(f"{k}.whole", x) for x in stmts]
                stmts.append(f"{k}.whole -> {k}, fused_ffn, axis=1")
            out.append(dataclasses.replace(u, hf_to_fleet=tuple(stmts)))
    return out


_UNITS_MEMO: dict[tuple[int, str, str, int], tuple[Any, tuple[MappingUnit, ...]]] | None = None


@contextlib.contextmanager
def memo_units() -> Iterator[None]:
    """Within: :func:`checkpoint_units` builds each list once per config object and arguments (the
    config must not change meanwhile): ``convert``'s per-layer loads share one (4.5 s for the 744B
    config)."""
    global _UNITS_MEMO
    prev, _UNITS_MEMO = _UNITS_MEMO, {}
    try:
        yield
    finally:
        _UNITS_MEMO = prev


def checkpoint_units(
    config: Any, layout: str, expert_layout: str = "per-expert", fused_shards: int = 1
) -> list[MappingUnit]:
    """Units from a checkpoint in ``layout`` (``hf`` side) to the model's ``state_dict()`` (``fleet`` side)."""
    memo, key = _UNITS_MEMO, (id(config), layout, expert_layout, fused_shards)
    if memo is not None and key in memo:
        return list(memo[key][1])
    units = _checkpoint_units(config, layout, expert_layout, fused_shards)
    if memo is not None:
        memo[key] = (config, tuple(units))  # the config is kept: its id stays its own
    return units


def _checkpoint_units(config: Any, layout: str, expert_layout: str, fused_shards: int) -> list[MappingUnit]:
    if layout == "hf":
        return expand_units(config)
    if layout == "fleet":
        return fleet_units(config, expert_layout, fused_shards)
    if layout == "fleet-legacy":
        return identity_units(model_param_specs(config))
    raise ValueError(f"unknown checkpoint layout {layout!r}; expected 'hf', 'fleet' or 'fleet-legacy'")


def expand_units(config: Any, *, layout: str = "model", expert_layout: str = "per-expert") -> list[MappingUnit]:
    """All mapping units of a model: global ones, then per layer (decoder, experts, MTP wrapper).

    ``layout="model"``: official HF <-> the Paddle model's ``state_dict()``. ``layout="fleet"``:
    official HF <-> PaddleFleet's checkpoint layout in ``expert_layout`` (a grouped or stacked
    layout merges a layer's routed-expert units with the adapter that groups them, the per-expert
    tensors being intermediates of one program).
    """
    if layout not in ("model", "fleet"):
        raise ValueError(f"unknown target layout {layout!r}; expected 'model' or 'fleet'")
    rules = load_rules()
    # a unit as written for the PaddleFleet layout: its ``paddlefleet`` override merged in
    raw = [{**u, **u["paddlefleet"]} if layout == "fleet" and "paddlefleet" in u else u for u in rules["units"]]
    units = _expand_units(config, raw)
    if layout == "model" or expert_layout == "per-expert":
        return units
    adapters = {a.layer: a for a in _adapters(config, expert_layout, rules) if a.layer is not None and len(a.fleet) > 1}
    # a layer's routed-expert units, merged, go where its first one is; every other unit stays alone
    groups: dict[Any, list[MappingUnit]] = {}
    for u in units:
        a = adapters.get(u.layer)
        groups.setdefault(("layer", u.layer) if a and set(u.fleet) <= set(a.fleet) else id(u), []).append(u)

    def merge(layer: int, group: list[MappingUnit]) -> MappingUnit:
        a = adapters[layer]
        return MappingUnit(
            name=a.name,
            tags=tuple(dict.fromkeys([t for g in group for t in g.tags] + list(a.tags))),
            hf=tuple(k for g in group for k in g.hf),
            fleet=a.hf,
            hf_to_fleet=tuple(s for g in group for s in g.hf_to_fleet) + a.fleet_to_hf,
            fleet_to_hf=a.hf_to_fleet + tuple(s for g in group for s in g.fleet_to_hf),
            layer=layer,
        )

    return [merge(k[1], g) if isinstance(k, tuple) else g[0] for k, g in groups.items()]


def _expand_units(config: Any, raw: Sequence[Mapping[str, Any]]) -> list[MappingUnit]:
    """The units written in ``raw``: global ones, then per layer (decoder, experts, MTP wrapper)."""
    units = [_make(u, {}, (), None) for u in raw if u["scope"] == "global" and _applies(u, None, config)]
    E = int(config.n_routed_experts)
    for lp in layer_plan(config):
        # the placeholders of a layer's statements (``EXPERT_ID`` filled per expert)
        values = dict(HF=lp.hf_prefix, FLEET=lp.fleet_prefix, LAYER=lp.hf_prefix, LAYER_ID=str(lp.index), EXPERT_ID="")
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
    units: Sequence[MappingUnit], direction: str, src_dtypes: Mapping[str, str], dst_dtypes: Mapping[str, str]
) -> list[str]:
    """The AOA program for ``units`` in ``direction``, with casts where source and target dtypes differ.

    A cast goes after the unit's statements on each target whose dtype differs from its sources'
    (``src_dtype``/``dst_dtype`` form, so the program also runs under ``aoa_config_reverse``). When
    a unit's sources disagree on dtype (e.g. gate in bf16, up in fp32 — a fused concat needs one
    dtype), each source is cast to the unit's single target dtype first.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; expected one of {DIRECTIONS}")
    cast = load_rules()["cast"]
    out: list[str] = []

    def cast_line(key: str, a: str, b: str) -> str:
        return cast.replace("$KEY", key).replace("$SRC_DTYPE", a).replace("$DST_DTYPE", b)

    for u in units:
        srcs, tgts = u.sources(direction), u.targets(direction)
        s_types = {k: src_dtypes[k] for k in srcs}
        t_types = {k: dst_dtypes[k] for k in tgts}
        if len(set(s_types.values())) <= 1:
            out.extend(getattr(u, direction))
            s = next(iter(s_types.values()), None)
            out.extend(cast_line(k, s, t) for k, t in t_types.items() if s is not None and t != s)
        elif len(set(t_types.values())) == 1:
            t = next(iter(t_types.values()))
            out.extend(cast_line(k, s, t) for k, s in s_types.items() if s != t)
            out.extend(getattr(u, direction))
        else:
            raise CheckpointError(
                f"mapping unit {u.name} mixes source dtypes and target dtypes; cannot cast consistently",
                key=srcs[0],
                expected="one source dtype or one target dtype",
                actual={"sources": s_types, "targets": t_types},
            )
    return out


def quiet_paddle_logs() -> None:
    """Paddle's checkpoint code logs one INFO line per call on its own loggers: those are raised to
    WARNING to keep user output readable. The root logger is the caller's and is not touched (where
    the caller configured none, ``import paddle`` itself sets it to INFO with a stderr handler)."""
    with contextlib.suppress(Exception):  # its import sets its logger to INFO: import it first
        import paddle.distributed.fleet.utils.log_util  # noqa: F401
    for name in ("paddle.distributed.flex_checkpoint", "paddle.distributed.fleet.utils.log_util"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _not_unexpected_keys(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Unexpected keys:")


@contextlib.contextmanager
def reading_a_share() -> Iterator[None]:
    """While a rank reads its share of a checkpoint (a resume into another layout: the other
    ranks' experts, slices and moments are in the files, not in its state), Paddle's
    ``load_state_dict`` warns "Unexpected keys: {...}" listing every one of them (23 KB, 312 keys for
    one EP rank of the tiny model), which reads like an error; that warning is dropped for the call.
    Its "Missing keys" warning stays (the caller's own checks name what a state lacks)."""
    quiet_paddle_logs()
    log = logging.getLogger("paddle.distributed.fleet.utils.log_util")
    log.addFilter(_not_unexpected_keys)
    try:
        yield
    finally:
        log.removeFilter(_not_unexpected_keys)
