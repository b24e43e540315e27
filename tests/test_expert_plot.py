"""`glm52 plot-experts OUT` draws a readable PNG (layer x expert heatmap + balance curve) from the
expert-load block of a training run's loss.json and refuses a loss.json without one."""

from __future__ import annotations

import json

import numpy as np

from paddleformers_glm.cli import main


def _loss_json(path, expert_load=True):
    data = {"losses": [5.0, 4.9, 4.8], "steps": 3}
    if expert_load:
        data["expert_load"] = {
            "num_experts": 4,
            "layers": [3, 4],
            "bias_update_rate": 0.01,
            "steps": [1, 2, 3],
            "max_mean_ratio": [[2.0, 1.5], [1.6, 1.4], [1.2, 1.1]],
            "unused_fraction": [[0.25, 0.0], [0.0, 0.0], [0.0, 0.0]],
            "load_total": [[30, 10, 0, 8], [12, 12, 12, 12]],
            "load_last": [[10, 4, 0, 2], [4, 4, 4, 4]],
        }
    path.mkdir(parents=True, exist_ok=True)
    (path / "loss.json").write_text(json.dumps(data))
    return path


def test_plot_experts_writes_a_readable_png(tmp_path, capsys):
    import matplotlib.image as mpimg

    out = _loss_json(tmp_path / "run")
    assert main(["plot-experts", str(out)]) == 0
    png = out / "expert_load.png"
    img = mpimg.imread(str(png))
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 400
    assert float(np.std(img[..., :3])) > 0.05  # something was drawn
    assert str(png) in capsys.readouterr().out
    other = tmp_path / "elsewhere" / "plot.png"
    assert main(["plot-experts", str(out / "loss.json"), "--png", str(other)]) == 0
    assert mpimg.imread(str(other)).shape == img.shape
    assert not list(out.glob(".*.tmp"))  # written atomically (no temporary file left)


def test_plot_experts_refuses_a_run_without_expert_load(tmp_path, capsys):
    out = _loss_json(tmp_path / "toy", expert_load=False)
    assert main(["plot-experts", str(out)]) == 2
    err = capsys.readouterr().err
    assert "loss.json" in err and "expert_load" in err
    assert not (out / "expert_load.png").exists()


def test_plot_experts_without_matplotlib_names_the_extra(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = _loss_json(tmp_path / "run")
    assert main(["plot-experts", str(out)]) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "[plot]" in err and "Traceback" not in err
