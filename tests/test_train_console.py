"""What `glm52 train` shows on the console: its own lines, not Paddle's set-up logging (that stays in
OUT/logs/workerlog.*, and reaches the console with --verbose); a progress bar only on a terminal."""

from __future__ import annotations

from paddleformers_glm.train.console import PaddleChatter
from paddleformers_glm.train.loop import TrainConfig, run_training

# the start of a tp2 x pp2 worker's output, as Paddle 3.3 writes it (shortened model print)
SAMPLE = """\
[2026-12-02 05:02:00,013] [    INFO] distributed_strategy.py:341 - distributed strategy initialized
======================= Modified FLAGS detected =======================
FLAGS(name='FLAGS_enable_pir_in_executor', current_value=True, default_value=False)
=======================================================================
[2026-12-02 05:02:04,626] [    INFO] topology.py:526 - Total 2 pipe comm group(s) create successfully!
[2026-12-02 05:02:06,328] [    INFO] pp_layers.py:909 - 0: PipelineChunk(stage=GlmStage(
  (model): GlmMoeDsaStageModel(
    (embedding): Embedding(
      (embed_tokens): _PaddedVocabParallelEmbedding()
    )
  )
))
[2026-12-02 05:02:06,335] [    INFO] pipeline_parallel.py:776 - start broadcast mp parameters
[glm52 train] rank 0 loaded 219,144 local elements, read 438,304 checkpoint bytes in 0.11 s
[2026-12-02 05:02:06,881] [ WARNING] hybrid_parallel_optimizer.py:327 - While using ClipGradByGlobalNorm the grad clip of original optimizer will be changed.
  indented continuation of a warning
step 1/2 | loss 5.575691 | mtp 5.541740 | lr 1.650e-04 | grad norm 2.1675 | 93 tok/s | 1.38 s
Traceback (most recent call last):
  File "x.py", line 1, in <module>
"""


def test_chatter_filter_keeps_the_runs_own_lines_warnings_and_errors():
    f = PaddleChatter()
    kept = [ln for ln in SAMPLE.splitlines(keepends=True) if f.keep(ln)]
    assert [ln.split(" - ")[0] if ln.startswith("[2026") else ln.rstrip("\n") for ln in kept] == [
        "[glm52 train] rank 0 loaded 219,144 local elements, read 438,304 checkpoint bytes in 0.11 s",
        "[2026-12-02 05:02:06,881] [ WARNING] hybrid_parallel_optimizer.py:327",
        "  indented continuation of a warning",
        "step 1/2 | loss 5.575691 | mtp 5.541740 | lr 1.650e-04 | grad norm 2.1675 | 93 tok/s | 1.38 s",
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
    ]


def test_no_progress_bar_into_a_pipe(tmp_path, capfd):
    """Progress on (the default), stderr not a terminal: the step lines, no redrawn bar."""
    cfg = TrainConfig(model="toy", steps=2, seq_len=16, global_batch_size=2, micro_batch_size=1, out=str(tmp_path))
    run_training(cfg)
    out, err = capfd.readouterr()
    assert "step 2/2" in out + err
    assert "step/s" not in err and "\r" not in err and "%|" not in err
