"""Pipeline parallelism: the stage layout language, the stage contract, and the single-stage engine.

The engine for ``--pp`` > 1 is Fleet's (:mod:`~paddleformers_glm.parallel.fleet_pipeline`); this
module holds what both use: stage specs, ``--pp-layout`` parsing (syntax: docs/parallel.md
section 3), the top-k carry check, a stage's output and the loss ledger.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from .topology import ParallelConfigError

if TYPE_CHECKING:  # Paddle is imported where the engine runs: the layout checks here run without it
    import paddle
    import paddle.nn as nn

__all__ = [
    "Batch",
    "Carry",
    "LossLedger",
    "LossTerm",
    "SingleStageEngine",
    "StageOutput",
    "StageSpec",
    "layout_string",
    "parse_pp_layout",
    "rank_spec",
    "run_stages",
    "split_stages",
    "validate_shared_layer_starts",
]


@dataclass(frozen=True)
class StageSpec:
    """What one pipeline stage builds. ``layers`` are global decoder-layer indices (contiguous)."""

    stage: int
    num_stages: int
    layers: tuple[int, ...]
    has_embedding: bool
    has_head: bool
    has_mtp: bool = False

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @classmethod
    def whole(cls, num_layers: int, has_mtp: bool = False) -> StageSpec:
        """The single stage of a pp=1 model."""
        return cls(0, 1, tuple(range(num_layers)), True, True, has_mtp)


class LossTerm(NamedTuple):
    """A last-stage loss term: the *sum* of per-token losses and how many tokens it covers."""

    sum: paddle.Tensor
    count: Any


_TOKEN = re.compile(r"\s*([EtmL])(?:\*(\d+))?")


def _parse_units(stage_text: str, stage: int, num_layers: int) -> list[str]:
    """A stage's units, repeats written out; a repeat beyond what any stage holds (the model's
    ``num_layers`` decoder layers) is refused before it is: ``t*99999999999`` ran out of memory."""
    units: list[str] = []
    pos, text = 0, stage_text.replace(",", " ").rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise ParallelConfigError(
                f"--pp-layout: stage {stage}: cannot parse {text[pos:].lstrip()!r} (units are E, t, m, L, optionally *N)"
            )
        n = int(m.group(2) or 1)
        if n > max(num_layers, 1):
            raise ParallelConfigError(
                f"--pp-layout: stage {stage}: {m.group(1)}*{n} is more units than a stage can hold (the model has "
                f"{num_layers} decoder layers (t); E, m and L are placed once)"
            )
        units += [m.group(1)] * n
        pos = m.end()
    return units


def parse_pp_layout(layout: str | Sequence[int], num_layers: int, pp: int, has_mtp: bool = False) -> list[StageSpec]:
    """Stage specs from a ``--pp-layout`` string or a list of per-stage layer counts."""
    if not isinstance(layout, str) or re.fullmatch(r"[\d\s,]+", layout):
        counts = [int(c) for c in (layout.replace(",", " ").split() if isinstance(layout, str) else layout)]
        if len(counts) != pp:
            raise ParallelConfigError(f"--pp-layout: {len(counts)} stage sizes {counts} for pp {pp}")
        if sum(counts) != num_layers or min(counts) < 0:
            raise ParallelConfigError(
                f"--pp-layout: stage sizes {counts} sum to {sum(counts)}, the model has {num_layers} layers"
            )
        return _specs_from_counts(counts, has_mtp)
    stages = [_parse_units(s, i, num_layers) for i, s in enumerate(layout.split("|"))]
    if len(stages) != pp:
        raise ParallelConfigError(f"--pp-layout {layout!r} has {len(stages)} stages, pp is {pp}")
    specs, next_layer = [], 0
    for i, units in enumerate(stages):
        if not units:
            raise ParallelConfigError(f"--pp-layout {layout!r}: stage {i} is empty")
        n_t = units.count("t")
        if units != [u for u in "EtmL" if u in units for _ in range(n_t if u == "t" else 1)]:
            raise ParallelConfigError(
                f"--pp-layout {layout!r}: stage {i} units {''.join(units)} must be ordered E, t..., m, L (each once)"
            )
        if "E" in units and i != 0:
            raise ParallelConfigError(f"--pp-layout {layout!r}: E (embedding) must be on stage 0, found on stage {i}")
        if ("L" in units or "m" in units) and i != pp - 1:
            raise ParallelConfigError(f"--pp-layout {layout!r}: m and L must be on the last stage, found on stage {i}")
        specs.append(
            StageSpec(i, pp, tuple(range(next_layer, next_layer + n_t)), "E" in units, "L" in units, "m" in units)
        )
        next_layer += n_t
    if not specs[0].has_embedding:
        raise ParallelConfigError(f"--pp-layout {layout!r}: stage 0 must start with E (the embedding)")
    if not specs[-1].has_head:
        raise ParallelConfigError(f"--pp-layout {layout!r}: the last stage must end with L (norm + head + loss)")
    if next_layer != num_layers:
        raise ParallelConfigError(
            f"--pp-layout {layout!r} places {next_layer} decoder layers (t), the model has {num_layers}"
        )
    if has_mtp != specs[-1].has_mtp:
        want = "must contain m before L" if has_mtp else "has m but the model has no MTP layer"
        raise ParallelConfigError(f"--pp-layout {layout!r}: the last stage {want}")
    return specs


def _specs_from_counts(counts: list[int], has_mtp: bool, unit: str = "pipeline stage") -> list[StageSpec]:
    pp, specs, start = len(counts), [], 0
    for i, c in enumerate(counts):
        if c == 0 and 0 < i < pp - 1:
            raise ParallelConfigError(f"{unit} {i} of {counts} would hold nothing")
        specs.append(StageSpec(i, pp, tuple(range(start, start + c)), i == 0, i == pp - 1, has_mtp and i == pp - 1))
        start += c
    return specs


def run_stages(run: Any, num_layers: int, chunks: int, has_mtp: bool) -> list[StageSpec]:
    """:func:`split_stages` by a run's ``pp_layout``, ``first_stage_layers`` and ``last_stage_layers``
    (the trainer's ``TrainConfig``, the planner's ``Layout``); with its ``vpp`` > 1 the ``chunks``
    are virtual pipeline chunks, and its refusals name them so."""
    return split_stages(
        num_layers,
        chunks,
        first_stage_layers=run.first_stage_layers,
        last_stage_layers=run.last_stage_layers,
        layout=run.pp_layout,
        has_mtp=has_mtp,
        unit="virtual pipeline chunk" if getattr(run, "vpp", 1) > 1 else "pipeline stage",
    )


def split_stages(
    num_layers: int,
    pp: int,
    *,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    layout: str | Sequence[int] | None = None,
    has_mtp: bool = False,
    unit: str = "pipeline stage",
) -> list[StageSpec]:
    """Stage specs for ``pp`` stages: an explicit ``layout``, fixed end sizes, or an even split.

    An uneven remainder goes to the middle stages first (the ends also hold embedding / head).
    ``unit``: what a refusal calls a stage (``run_stages``: a virtual pipeline chunk under --vpp).
    """
    if pp < 1:
        raise ParallelConfigError(f"pp must be >= 1, got {pp}")
    if layout is not None:
        if first_stage_layers is not None or last_stage_layers is not None:
            raise ParallelConfigError("give either --pp-layout or first/last stage sizes, not both")
        return parse_pp_layout(layout, num_layers, pp, has_mtp)
    if pp == 1:
        if first_stage_layers not in (None, num_layers) or last_stage_layers not in (None, num_layers):
            raise ParallelConfigError(f"pp 1: first/last stage sizes must equal num_layers {num_layers}")
        return [StageSpec.whole(num_layers, has_mtp)]
    counts = [first_stage_layers] + [None] * (pp - 2) + [last_stage_layers]
    fixed = sum(c for c in counts if c is not None)
    free = [i for i, c in enumerate(counts) if c is None]
    rest = num_layers - fixed
    if rest < 0 or any(c is not None and c < 0 for c in counts):
        raise ParallelConfigError(
            f"first/last stage sizes {first_stage_layers}/{last_stage_layers} exceed num_layers {num_layers}"
        )
    if free:
        base, extra = divmod(rest, len(free))
        if extra and (first_stage_layers is not None or last_stage_layers is not None):
            raise ParallelConfigError(
                f"{rest} remaining layers do not split evenly over the {len(free)} {unit}s without a fixed size; "
                f"try --last-stage-layers "
                f"{last_stage_layers + extra if last_stage_layers is not None else extra + base}"
            )
        plus_one = sorted(free, key=lambda i: (i in (0, pp - 1), i == pp - 1, i))[:extra]  # middle stages first
        for i in free:
            counts[i] = base + (i in plus_one)
    elif rest != 0:
        raise ParallelConfigError(f"stage sizes {counts} sum to {fixed}, the model has {num_layers} layers")
    return _specs_from_counts([int(c) for c in counts], has_mtp, unit)  # type: ignore[arg-type]


def layout_string(specs: Sequence[StageSpec]) -> str:
    """The ``--pp-layout`` string that reproduces ``specs``."""
    out = []
    for s in specs:
        n = len(s.layers)
        units = (["E"] if s.has_embedding else []) + (["t" if n == 1 else f"t*{n}"] if n else [])
        units += (["m"] if s.has_mtp else []) + (["L"] if s.has_head else [])
        out.append(",".join(units))
    return "|".join(out)


def rank_spec(chunks: Sequence[StageSpec], pp: int, stage: int) -> StageSpec:
    """The stage module of pipeline rank ``stage``: the union of its chunks (layers in order); chunk
    ``c`` runs on rank ``c % pp`` (Fleet's interleave)."""
    mine = chunks[stage::pp]
    parts = (any(getattr(c, f) for c in mine) for f in ("has_embedding", "has_head", "has_mtp"))
    return StageSpec(stage, pp, tuple(i for c in mine for i in c.layers), *parts)


def validate_shared_layer_starts(
    specs: Sequence[StageSpec],
    layer_kinds: Sequence[str],
    carry_topk: bool = True,
    *,
    mtp_reuses_topk: bool = False,
    unit: str = "stage",
) -> None:
    """Reject a split that parts a layer reusing a top-k from the full layer that made it, when
    top-k is *not* carried (``carry_topk`` False: shared-layer supervision, the Megatron/slime rule):
    a stage that begins on a "shared" indexer layer, and with ``mtp_reuses_topk`` (the MTP block
    reuses the main model's last top-k: ``index_share_for_mtp_iteration``) a stage with the MTP
    block that does not hold the last full layer.

    With ``carry_topk`` (our engine's default) every split works and this only checks the kinds.
    Otherwise the message names the nearest layout that keeps every such layer with its full layer.
    ``unit``: what the message calls a stage (a virtual pipeline chunk under --vpp).
    """
    for s in specs:
        for i in s.layers:
            if layer_kinds[i] not in ("full", "shared"):
                raise ParallelConfigError(f"layer {i}: indexer kind must be 'full' or 'shared', got {layer_kinds[i]!r}")
    if carry_topk:
        return
    full = [i for i, k in enumerate(layer_kinds) if k == "full"]
    bad = [s for s in specs if s.layers and layer_kinds[s.layers[0]] == "shared"]
    if bad:
        raise ParallelConfigError(
            f"{unit} {bad[0].stage} starts on shared layer {bad[0].layers[0]} (it reuses the top-k of an earlier full "
            f"layer) and top-k carrying is off{_topk_group_hint(specs, layer_kinds, mtp_reuses_topk, unit)}"
        )
    mtp = next((s for s in specs if s.has_mtp), None)
    if mtp_reuses_topk and mtp is not None and full and full[-1] not in mtp.layers:
        last = full[-1]
        home = next((s.stage for s in specs if last in s.layers), None)
        raise ParallelConfigError(
            f"the MTP block is on {unit} {mtp.stage} but reuses the top-k of full layer {last} "
            f"(index_share_for_mtp_iteration), which is on {unit} {home}, and top-k carrying is off"
            f"{_topk_group_hint(specs, layer_kinds, mtp_reuses_topk, unit)}"
        )


def _topk_group_hint(specs: Sequence[StageSpec], layer_kinds: Sequence[str], mtp_reuses_topk: bool, unit: str) -> str:
    """ "; a layout whose ...: 'c0,c1,...'": the split nearest ``specs`` (as --pp-layout sizes) whose
    stages all start on a full layer and, with ``mtp_reuses_topk``, whose MTP stage holds the last
    full layer; each stage start moves to the nearest full layer (on past the one before it), then
    earlier ones back as far as needed to keep every middle stage non-empty (the first and the last
    may hold no decoder layer: the embedding alone, the head and MTP block alone).  "" when there is
    none."""
    n, L = len(specs), len(layer_kinds)
    full = [i for i, k in enumerate(layer_kinds) if k == "full"]
    if not full or full[0] != 0:
        return ""
    starts, pos = [], 0
    for s in specs:
        starts.append(pos)
        pos += len(s.layers)
    starts = [
        x if not specs[i].layers or layer_kinds[x] == "full" else min(full, key=lambda f: (abs(f - x), f))
        for i, x in enumerate(starts)
    ]
    starts[0] = 0
    for i in range(2, n):  # a start moved onto (or before) the one before it: on to the next full layer
        if starts[i] <= starts[i - 1] and specs[i].layers:
            starts[i] = next((f for f in full if f > starts[i - 1]), L)
    if mtp_reuses_topk and specs[-1].has_mtp:
        starts[-1] = min(starts[-1], full[-1])
    for i in range(n - 1, 0, -1):
        end = starts[i + 1] if i + 1 < n else L
        may_be_empty = i == n - 1 and not (mtp_reuses_topk and specs[-1].has_mtp)
        if starts[i] > end or (starts[i] == end and not may_be_empty):
            below = [f for f in full if f < end or (may_be_empty and f == end)]
            if not below:
                return ""
            starts[i] = below[-1]
    counts = [b - a for a, b in zip(starts, [*starts[1:], L])]
    if any(c < 0 for c in counts) or any(c == 0 for c in counts[1:-1]):
        return ""
    what = f"start on full layers{f' (layer {full[-1]} with the MTP block)' if mtp_reuses_topk else ''}"
    return f"; a layout whose {unit}s {what}: --pp-layout {','.join(str(c) for c in counts)!r}"


# ------------------------------------------------------------------------------ engine
Carry = tuple["paddle.Tensor", ...]  # what a stage hands the next one (hidden states, top-k)
Batch = Mapping[str, "paddle.Tensor"]  # a micro-batch's tensors by name


@dataclass
class StageOutput:
    """What a stage's forward returns.

    carry:  tensors for the next stage (None on the last stage). Float tensors with
            ``stop_gradient=False`` get their gradient sent back; others (int64 top-k) travel forward only.
    losses: {name: LossTerm(sum, count)} produced on this stage: the LM / MTP losses on the last
            stage, auxiliary losses (indexer KL, MoE balance) on any stage.
    """

    carry: Carry | None = None
    losses: dict[str, LossTerm] | None = None


def checked_output(out: Any, last: bool, stage: int) -> StageOutput:
    if not isinstance(out, StageOutput):
        raise TypeError(f"stage {stage} forward returned {type(out).__name__}; expected StageOutput")
    if last and not out.losses:
        raise TypeError(f"the last pipeline stage ({stage}) returned no losses")
    if not last and out.carry is None:
        raise TypeError(f"pipeline stage {stage} is not the last but returned no carry for the next stage")
    return out


class LossLedger:
    """The step's loss scales and, per term, the float64 total of the sums and the token count.

    ``objective(losses)`` turns one micro-batch's terms into the scalar that is backpropagated:
    ``sum(scales[name] * sum)`` (each scale is the term's weight over its *global* normaliser),
    recording each term's sum and count for the trainer's loss report.

    Sums and counts stay where the model computed them (int64 counts on the device, a Python int
    where the term gives one) until :meth:`totals`: on a GPU every read of a device value is a
    stream synchronisation, and one per term per micro-batch, before the backward is even queued,
    would stall each micro-batch on its own forward. :meth:`totals` reads them all in one copy.
    """

    def __init__(self) -> None:
        self.batch_keys: list[str] = []
        self.reset({})

    def reset(self, scales: dict[str, float]) -> None:
        self.scales, self.sums, self.counts = dict(scales), {}, {}

    def objective(self, losses: dict[str, LossTerm], where: str) -> paddle.Tensor | None:
        import paddle

        objective = None
        for name, term in losses.items():
            if name not in self.scales:
                raise KeyError(f"{where} returned loss term {name!r}; the trainer knows {sorted(self.scales)}")
            s = term.sum.astype("float32")
            contrib = s * self.scales[name]
            objective = contrib if objective is None else objective + contrib
            s64 = s.detach().astype("float64")
            self.sums[name] = self.sums[name] + s64 if name in self.sums else s64
            c = term.count
            c = c.astype("int64").reshape([]) if isinstance(c, paddle.Tensor) else int(c)
            self.counts[name] = self.counts[name] + c if name in self.counts else c
        return objective

    def totals(self) -> dict[str, tuple[float, int]]:
        """{term: (sum, count)} of the step so far, as Python numbers: every sum and device count
        in one read (the counts travel as float64, exact below 2**53 tokens)."""
        import paddle

        names = list(self.sums)
        if not names:
            return {}
        dev = [n for n in names if isinstance(self.counts[n], paddle.Tensor)]
        parts = [self.sums[n].reshape([1]) for n in names]
        parts += [self.counts[n].astype("float64").reshape([1]) for n in dev]
        host = paddle.concat(parts).numpy()
        counts = {n: int(self.counts[n]) for n in names if n not in dev}
        counts.update({n: int(v) for n, v in zip(dev, host[len(names) :])})
        return {n: (float(host[i]), counts[n]) for i, n in enumerate(names)}


class SingleStageEngine:
    """One pipeline stage (``--pp 1``): forward and backward of each micro-batch in turn; gradients
    accumulate in the parameters, the optimizer is not stepped here."""

    name = "single stage"

    def __init__(self, module: nn.Layer) -> None:
        self.module = module
        self.ledger = LossLedger()

    def run(self, micro_batches: Sequence[dict[str, Any]], scales: dict[str, float]) -> dict[str, tuple[float, int]]:
        """Forward + backward of every micro-batch; returns {term: (sum, count)} (sums in float64)."""
        import paddle

        self.ledger.reset(scales)
        for mb in micro_batches:
            out = checked_output(self.module.forward_stage(None, mb), True, 0)
            objective = self.ledger.objective(out.losses, "stage 0")
            paddle.autograd.backward([objective], [paddle.ones_like(objective)])
        return self.ledger.totals()

    def evaluate(
        self, micro_batches: Sequence[dict[str, Any]], scales: dict[str, float]
    ) -> dict[str, tuple[float, int]]:
        """Forward only of every micro-batch, in evaluation mode without gradient (the module's mode
        restored after); returns {term: (sum, count)} as :meth:`run`."""
        import paddle

        self.ledger.reset(scales)
        with evaluation(self.module), paddle.no_grad():
            for mb in micro_batches:
                self.ledger.objective(checked_output(self.module.forward_stage(None, mb), True, 0).losses, "stage 0")
        return self.ledger.totals()


@contextlib.contextmanager
def evaluation(module: nn.Layer) -> Iterator[None]:
    """``module`` in evaluation mode for the block, its own mode after."""
    was = module.training
    module.eval()
    try:
        yield
    finally:
        module.train() if was else module.eval()
