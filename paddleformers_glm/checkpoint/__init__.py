"""GLM-5.2 checkpoints: strict safetensors I/O, the HF <-> Fleet contract, AOA-driven load and save.

Entry points used by the model class::

    load_pretrained_state(model, path, dtype="float32")       # from_pretrained
    save_pretrained_state(model, model.config, out_dir, ...)  # save_pretrained

See docs/checkpoints.md.
"""

from .errors import CheckpointError
from .layout import (
    EXPERT_LAYOUTS,
    fleet_param_specs,
    hf_param_specs,
    layer_plan,
    model_param_specs,
    paddlefleet_param_specs,
    param_specs,
    resolve_dtype,
)
from .loader import LoadReport, detect_layout, load_pretrained_state
from .safetensors_io import Checkpoint, SafetensorsFile
from .saver import SaveReport, save_pretrained_state

__all__ = [
    "CheckpointError",
    "Checkpoint",
    "SafetensorsFile",
    "fleet_param_specs",
    "model_param_specs",
    "paddlefleet_param_specs",
    "EXPERT_LAYOUTS",
    "hf_param_specs",
    "param_specs",
    "layer_plan",
    "resolve_dtype",
    "detect_layout",
    "load_pretrained_state",
    "LoadReport",
    "save_pretrained_state",
    "SaveReport",
]
