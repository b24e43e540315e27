"""A resume holds the live state plus about one tensor: the state is read into the tensors the run
already holds (model weights, moments, fp32 masters), never into a whole second copy of them beside
it.  Measured in one process as the peak of Paddle's host allocations during ``load_resume_state``
above what was allocated when it began (exact for Paddle's tensors, unlike a sampled RSS; numpy's
temporaries are not in it), against the state's bytes, on both paths: the same layout
(``rank_*.safetensors``, one tensor set at a time) and the flex-checkpoint load a resume in another
layout takes (``flex/``, here forced by an expected profile whose pipeline split differs, so the same
run's tensors go through Paddle's resharding load, in place).  Each resumed run continues the
uninterrupted run's losses bit for bit.

Before the fix the same-layout resume built every optimizer tensor anew before setting any (240 MiB
of a 281 MiB state here) and the flex path read into a zero buffer per tensor (282 MiB: the whole
state again); now they rise 4 MiB (one tensor) and 0.4 MiB.  The bound is a quarter of the state plus
two of its largest tensors.  tests/test_train_reshard.py pins it on a real layout change (TP2 x PP2
to one process)."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from paddleformers_glm.train import loop
from paddleformers_glm.train.loop import TrainConfig, run_training

# bf16 weights (so fp32 masters and two fp32 moments: 10 bytes of optimizer state per 2 of weight),
# most of them in many small experts: the largest tensor (the 4096 x 256 embedding / LM head, 4 MiB of
# fp32 moment) is small beside the state (~70 MiB)
TOY = {"vocab_size": 4096, "hidden_size": 256, "ffn_size": 512, "num_experts": 16, "expert_ffn": 256}
STEPS, SAVE_AT = 3, 1  # two resumed updates: the second step's loss reads the restored moments and masters


def _cfg(out: Any, **kw: Any) -> TrainConfig:
    base = {
        "model": "toy", "model_args": {"seed": 3, "config": TOY}, "steps": STEPS, "seq_len": 16,
        "global_batch_size": 2, "micro_batch_size": 1, "lr": 1e-3, "warmup_steps": 0, "seed": 3,
        "dtype": "bfloat16", "out": str(out), "progress": False,
    }  # fmt: skip
    return TrainConfig(**{**base, **kw})


def _tensors(module: Any, opt: Any) -> list[Any]:
    return [*module.state_dict().values(), *(t for st in opt.state_layout().values() for t in st.values())]


def measure_resume(monkeypatch: Any, reshard: bool = False) -> dict[str, int]:
    """Wrap the trainer's ``load_resume_state`` to record (into the dict returned) ``rise``: the peak of
    Paddle's host allocations during it above those when it began, ``state``: the bytes of the live
    state it fills (weights, every accumulator, masters), and ``largest``: its largest tensor's bytes.
    ``reshard``: take the flex-checkpoint path whatever the layout (an expected pipeline split the state
    does not record)."""
    from paddle.base import core

    real, seen = loop.load_resume_state, {}

    def measured(path: str, topo: Any, module: Any, opt: Any, expect: dict[str, Any], **kw: Any) -> Any:
        if reshard:
            expect = {**expect, "pp_layout": f"{expect.get('pp_layout')} (forced reshard)"}
        sizes = [int(t.size) * t.element_size() for t in _tensors(module, opt)]  # all exist: prepare_state ran
        gc.collect()  # an earlier run's tensors, freed during the resume, would hide what it allocates
        core.host_memory_stat_reset_peak_value("Allocated", 0)
        before = core.host_memory_stat_current_value("Allocated", 0)
        meta = real(path, topo, module, opt, expect, **kw)
        seen.update(rise=core.host_memory_stat_peak_value("Allocated", 0) - before, state=sum(sizes))
        seen["largest"] = max(sizes)
        return meta

    monkeypatch.setattr(loop, "load_resume_state", measured)
    return seen


def assert_bounded(seen: dict[str, int], what: str) -> None:
    bound = seen["state"] // 4 + 2 * seen["largest"]
    mb = {k: round(v / 2**20, 1) for k, v in seen.items()}
    print(f"{what}: {mb} MiB (bound {bound / 2**20:.1f})")
    assert seen["rise"] <= bound, (
        f"{what}: the resume's allocations rose {mb['rise']} MiB over the live state of {mb['state']} MiB "
        f"(largest tensor {mb['largest']} MiB; bound a quarter of the state plus two of it)"
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The uninterrupted run; it saves its state after step 1."""
    out = tmp_path_factory.mktemp("full")
    full = run_training(_cfg(out, save_every=SAVE_AT))
    return full, out / "checkpoints" / f"step_{SAVE_AT:08d}"


@pytest.mark.parametrize("reshard", [False, True], ids=["same_layout", "flex"])
def test_a_resume_holds_the_live_state_and_about_one_tensor(saved, tmp_path, monkeypatch, reshard):
    full, ckpt = saved
    seen = measure_resume(monkeypatch, reshard)
    r = run_training(_cfg(tmp_path, resume=str(ckpt)))
    assert seen["state"] > 40 * 2**20 > 8 * seen["largest"], seen  # the state is many tensors, not one
    assert_bounded(seen, "flex (forced)" if reshard else "same layout")
    assert r["run"]["resumed_from_step"] == SAVE_AT
    for key in ("losses", "mtp_losses", "grad_norms"):  # the resumed steps are the uninterrupted ones
        assert r[key] == full[key], (key, r[key], full[key])


def test_fused_blocks_read_into_buffers_where_views_do_not_write_through(saved, tmp_path, monkeypatch):
    """The flex path's fallback for a Paddle whose slices do not write into their tensor: the fused
    tensors' blocks (the toy's qkv, its experts' up|gate) are read into buffers and set after the
    load, and the run continues as well.  Here (Paddle's strided views) the probe finds they do."""
    from paddleformers_glm.train import resume

    assert resume._views_write_through()
    full, ckpt = saved
    monkeypatch.setattr(resume, "_views_write_through", lambda: False)
    seen = measure_resume(monkeypatch, reshard=True)
    r = run_training(_cfg(tmp_path, resume=str(ckpt)))
    assert 0 < seen["rise"] < seen["state"], seen  # the fused blocks' buffers (most of the toy's experts)
    for key in ("losses", "mtp_losses", "grad_norms"):
        assert r[key] == full[key], (key, r[key], full[key])
