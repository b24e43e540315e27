"""transformers' ``PreTrainedModel`` API for GLM-5.2: ``from_config``, ``from_pretrained`` and
``save_pretrained`` (the checkpoint package reads and writes), ``dtype`` / ``device`` / ``to``, the
embeddings (get, set, resize), ``num_parameters``, ``generation_config`` and ``generate``.
:class:`~paddleformers_glm.modeling.model.GlmMoeDsaForCausalLM` is built on it; its layers and its
forward are in model.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import paddle
from paddle import nn

from ..configuration import HF_DOWNLOAD_KWARGS, GlmMoeDsaConfig
from ..ops import cpu_bf16
from ..parallel.layers import get_shard_spec, set_shard_spec
from ..parallel.topology import Topology
from .moe import TopkRouter
from .rope import RotaryEmbedding

if TYPE_CHECKING:  # the checkpoint package is imported when a load or save runs, not with the model
    from ..checkpoint.saver import SaveReport


_LOG = logging.getLogger("paddleformers_glm.checkpoint")


def _added_rows(old: np.ndarray, added: int, mean_resizing: bool, std: float) -> np.ndarray:
    """``added`` new rows for a vocabulary matrix ``old`` [V, H] (float32), as transformers 5.23
    initialises them (``_init_added_embeddings_weights_with_mean``, ``_init_weights``): N(mean,
    1e-9 * covariance) of the old rows, or their mean where the Cholesky factor of that covariance
    fails (not positive definite); without ``mean_resizing`` N(0, std)."""
    H = old.shape[1]
    if not mean_resizing:
        return paddle.normal(0.0, std, [added, H]).numpy().astype("float32")
    mean = old.mean(axis=0, dtype="float32")
    centered = old - mean
    cov = (centered.T @ centered / np.float32(old.shape[0])).astype("float32")
    try:
        factor = np.linalg.cholesky(np.float32(1e-9) * cov)
    except np.linalg.LinAlgError:
        return np.repeat(mean[None], added, axis=0)
    z = paddle.randn([added, H], dtype="float32").numpy()
    return (mean[None] + z @ factor.T).astype("float32")


def _resized_param(layer: nn.Layer, weight: paddle.Tensor, new: int, axis: int, mean_resizing: bool, std: float):
    """A new parameter of ``layer``: ``weight`` with ``new`` entries along its vocabulary ``axis``
    (the first ones kept; added ones from :func:`_added_rows`), its dtype and trainability kept."""
    rows = weight.astype("float32").numpy()
    rows = rows if axis == 0 else rows.T  # [V, H]
    old = rows.shape[0]
    if new > old:
        rows = np.concatenate([rows, _added_rows(rows, new - old, mean_resizing, std)], axis=0)
    rows = rows[:new]
    rows = rows if axis == 0 else rows.T
    param = layer.create_parameter(list(rows.shape), dtype=weight.dtype)
    param.set_value(paddle.to_tensor(rows).astype(weight.dtype))
    param.stop_gradient = weight.stop_gradient
    set_shard_spec(param, get_shard_spec(weight), 1)
    return param


@contextlib.contextmanager
def _skip_random_init() -> Iterator[None]:
    """Parameters created inside are allocated but not initialised (no random draw, no memset).

    For ``from_pretrained`` only: every parameter is overwritten by the load right after (and what
    a ``strict=False`` load does not fill is initialised as HF does), and drawing normals for a
    large model costs several times the load itself. Distributed parameters get zeros. The switch is
    process-wide while the block runs (another thread building layers then gets no init either).
    """
    from paddle.base.framework import _current_expected_place
    from paddle.nn.initializer import Constant
    from paddle.nn.initializer.initializer import Initializer

    zero = Constant(0.0)
    real = Initializer.__call__

    def allocate(self: Any, param: Any, block: Any = None) -> Any:
        if getattr(param, "is_dist", lambda: False)() or not paddle.in_dynamic_mode():
            return zero.forward(param, block)
        out = paddle._C_ops.empty(param.shape, param.dtype, _current_expected_place())
        out._share_underline_tensor_to(param)
        return None

    Initializer.__call__ = allocate  # type: ignore[method-assign]
    try:
        yield
    finally:
        Initializer.__call__ = real  # type: ignore[method-assign]


# transformers' from_pretrained keywords that change nothing when loading a local folder: dropped
# there as there (they became config keys, written into a save's config.json)
_NOOP_LOADING_KEYS = frozenset(HF_DOWNLOAD_KWARGS) | frozenset(
    "use_auth_token use_safetensors low_cpu_mem_usage resume_download weights_only".split()
)
# ... and those that would change what is loaded or where: refused by name
_UNSUPPORTED_LOADING_KEYS = (
    "variant",
    "device_map",
    "max_memory",
    "offload_folder",
    "offload_state_dict",
    "offload_buffers",
    "load_in_8bit",
    "load_in_4bit",
    "gguf_file",
    "key_mapping",
    "tp_plan",
    "tp_size",
    "device_mesh",
    "state_dict",
    "from_tf",
    "from_flax",
    "adapter_name",
    "adapter_kwargs",
    # True re-initialises the tensors whose shape differs from the file's; False (a mismatch is an
    # error, as here always) is taken, as None
    "ignore_mismatched_sizes",
)


def _loading_keywords(path: str | os.PathLike, kwargs: dict[str, Any]) -> tuple[str | os.PathLike, dict[str, Any]]:
    """``from_pretrained``'s keywords split as transformers 5.23 splits them: its loading keywords
    are not config overrides. Those that change nothing for a local folder are dropped (transformers
    writes none of them into a save's config.json); ``subfolder`` is read under ``path``; the
    others (``device_map``, ``variant`` ...) are refused by name given anything but None."""
    overrides = {k: v for k, v in kwargs.items() if k not in _NOOP_LOADING_KEYS}
    subfolder = overrides.pop("subfolder", None)
    if subfolder:
        path = os.path.join(os.fspath(path), os.fspath(subfolder))
    if overrides.get("ignore_mismatched_sizes") is False:
        overrides.pop("ignore_mismatched_sizes")
    refused = [k for k in _UNSUPPORTED_LOADING_KEYS if overrides.get(k) is not None]
    if refused:
        raise ValueError(
            f"from_pretrained: {', '.join(f'{k}={overrides[k]!r}' for k in refused)} is not supported (a "
            "transformers loading option: the weights load as the folder holds them, onto paddle.get_device(); "
            "a model split over ranks takes topology=)"
        )
    return path, {k: v for k, v in overrides.items() if k not in _UNSUPPORTED_LOADING_KEYS}


# transformers' save_pretrained keywords and the value each must have here (None: any value, ignored)
_HF_SAVE_KEYWORDS = {
    "safe_serialization": None,  # transformers 5.23 writes safetensors whatever it says
    "push_to_hub": False,
    "variant": None,
    "state_dict": None,
    "token": None,
    "save_peft_format": None,
    "save_original_format": None,
    "distributed_checkpoint": False,
    "commit_message": None,
    "repo_id": None,
    "create_pr": None,
}


def _short_repr(value: Any) -> str:
    """A keyword's value as an error names it: a dict of tensors by its size (their reprs run to
    megabytes on a real model, and formatting device tensors copies them), anything else by its repr."""
    if isinstance(value, dict):
        return f"<dict of {len(value)} tensors>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _hf_save_keywords(kwargs: dict[str, Any]) -> bool:
    """Pop transformers' ``save_pretrained`` keywords from ``kwargs``: those that change nothing are
    dropped, ``push_to_hub=True`` / a ``variant`` / ``distributed_checkpoint=True`` refused by name;
    ``state_dict`` stays in ``kwargs`` for :meth:`GlmMoeDsaPreTrainedModel._state_to_save`.
    -> whether to write (transformers' ``is_main_process``, default True)."""
    write = bool(kwargs.pop("is_main_process", True))
    for key, allowed in _HF_SAVE_KEYWORDS.items():
        if key not in kwargs or key == "state_dict":
            continue
        value = kwargs.pop(key)
        refused = value is not None if key == "variant" else allowed is not None and value != allowed
        if refused:
            raise ValueError(
                f"save_pretrained: {key}={_short_repr(value)} is not supported (a transformers save option)"
            )
    return write


_PER_LAYER_KEYS = ("indexer_types", "mlp_layer_types", "layer_types", "index_topk_pattern")


def _config_with_overrides(
    path: str | os.PathLike, overrides: dict[str, Any]
) -> tuple[GlmMoeDsaConfig, GlmMoeDsaConfig | None]:
    """``from_pretrained``'s config: ``path``'s with ``overrides``, and the file's own config when
    ``num_hidden_layers`` is overridden below the file's (else None). As transformers 5.23's
    ``from_pretrained(path, num_hidden_layers=n)`` (a model of the first n layers, each the kind
    the file's per-layer lists give it), the per-layer lists the file holds are cut to their first n
    entries (transformers keeps them whole and then cannot save the model). More layers than the
    file has are refused (transformers raises IndexError building the model)."""
    if "num_hidden_layers" not in overrides:
        return _config_of(path, overrides), None
    n = overrides["num_hidden_layers"]
    file_config = GlmMoeDsaConfig.from_pretrained(path)
    file_layers = int(file_config.num_hidden_layers)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= file_layers:
        raise ValueError(
            f"from_pretrained: num_hidden_layers={n!r}: the checkpoint has {file_layers} decoder layers; "
            f"a model of its first n layers takes 1 <= n <= {file_layers}"
        )
    if n == file_layers:
        return _config_of(path, overrides), None
    cut = dict(overrides)
    file_dict = file_config.to_dict()
    for key in _PER_LAYER_KEYS:
        value = file_dict.get(key)
        if key not in overrides and isinstance(value, (list, tuple, str)) and len(value) > n:
            cut[key] = value[:n]
    return _config_of(path, cut), file_config


def _config_of(path: str | os.PathLike, overrides: dict[str, Any]) -> GlmMoeDsaConfig:
    """``path``'s config with ``overrides``; a keyword that is neither a config key nor a loading
    keyword is refused by name, as transformers 5.23 (the model's ``__init__`` raises "got an
    unexpected keyword argument 'foo'"), not dropped where a typo would pass unseen."""
    config, unused = GlmMoeDsaConfig.from_pretrained(path, return_unused_kwargs=True, **overrides)
    if unused:
        raise TypeError(
            f"from_pretrained: unexpected keyword argument(s) {sorted(unused)}: neither a key of "
            f"{os.fspath(path)}'s config.json, a GlmMoeDsaConfig setting nor a loading keyword"
        )
    return config


def _deeper_file_config(path: str | os.PathLike, config: GlmMoeDsaConfig) -> GlmMoeDsaConfig | None:
    """The checkpoint's own config when the ``config`` given to ``from_pretrained`` has fewer decoder
    layers than it (transformers then builds the first ones, as with ``num_hidden_layers=n``),
    else None (no readable config.json beside the weights: the load checks the keys as before)."""
    file = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(file):
        return None
    try:
        file_config = GlmMoeDsaConfig.from_pretrained(path)
    except ValueError:
        return None
    return file_config if int(file_config.num_hidden_layers) > int(config.num_hidden_layers) else None


def _load_first_layers(
    state: dict[str, paddle.Tensor],
    path: str | os.PathLike,
    dtype: str,
    strict: bool,
    config: GlmMoeDsaConfig,
    file_config: GlmMoeDsaConfig,
    folder_identity: tuple[int, int] | None = None,
):
    """Fill ``state`` (a model of ``config``: the first n decoder layers of the checkpoint at ``path``,
    whose config is ``file_config``) from that checkpoint: the decoder layers 0..n-1 as they are, the
    MTP layers from where the file holds them (``model.layers.{L_file + j}``); the file's decoder layers
    n..L_file-1 are not read, and a warning names them, as transformers' load report lists them as
    unexpected keys. ``folder_identity``: as ``load_pretrained_state``'s."""
    from ..checkpoint import load_pretrained_state

    n, file_n = int(config.num_hidden_layers), int(file_config.num_hidden_layers)

    def renamed(key: str, a: int, b: int) -> str:  # model.layers.{a + j}.* -> model.layers.{b + j}.*
        parts = key.split(".")
        if len(parts) > 2 and parts[:2] == ["model", "layers"] and int(parts[2]) >= a:
            parts[2] = str(int(parts[2]) - a + b)
        return ".".join(parts)

    as_file = {renamed(k, n, file_n): v for k, v in state.items()}
    where = {"config": file_config, "keys": set(as_file), "folder_identity": folder_identity}
    report = load_pretrained_state(as_file, path, dtype=dtype, strict=strict, **where)
    report.loaded = [renamed(k, file_n, n) for k in report.loaded]
    report.initialized = [renamed(k, file_n, n) for k in report.initialized]
    report.missing = [renamed(k, file_n, n) for k in report.missing]
    msg = (
        f"{os.fspath(path)}: decoder layers {n}..{file_n - 1} of the checkpoint's {file_n} are not read: "
        f"num_hidden_layers={n} builds its first {n}"
        + (
            f" (its MTP layers, model.layers.{file_n}.*, are the model's model.layers.{n}.*)"
            if config.num_mtp_layers
            else ""
        )
    )
    warnings.warn(msg, UserWarning, stacklevel=3)
    report.warnings.append(msg)
    return report


def _output_takes_gradient(layer: nn.Layer, inputs: Any, output: paddle.Tensor) -> None:
    output.stop_gradient = False


def dtype_name(value: Any) -> str | None:
    """The model dtype ``value`` names (a Paddle / numpy dtype or a name such as "bfloat16"), else None
    (a device: "cpu", "gpu:0", a place)."""
    from ..checkpoint.loader import normalize_dtype

    if value is None or (isinstance(value, str) and value.lower() == "auto"):
        return None
    try:
        return normalize_dtype(value)
    except ValueError:
        return None


def _whole_model(dtype: str, excluded_layers: Any) -> str:
    """``dtype``, where Paddle's cast was asked for the whole model (its ``excluded_layers`` are refused:
    the model's own float32 parts are the only ones it keeps)."""
    if excluded_layers is not None:
        raise NotImplementedError(
            f"casting to {dtype} with excluded_layers={excluded_layers!r}: use model.to(dtype=...)"
        )
    return dtype


def _deprecated(old: str, new: str) -> None:
    """transformers 5.23's warning for a name it renamed (the caller's caller is named)."""
    warnings.warn(f"`{old}` is deprecated and will be removed in v6. Use `{new}` instead.", FutureWarning, stacklevel=3)


class GlmMoeDsaPreTrainedModel(nn.Layer):
    """What every GLM model class shares with transformers' ``PreTrainedModel`` (as transformers'
    ``GlmMoeDsaPreTrainedModel``): loading, saving, dtype and device, the embeddings and generation.
    A subclass holds ``config``, ``model`` (the decoder stack with ``embedding``), ``lm_head``,
    ``stage``, ``topology`` and ``distributed``."""

    config_class = GlmMoeDsaConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True

    # ------------------------------------------------------------------ construction / IO
    def init_weights(self, seed: int | None = None) -> None:
        """HF-style init: N(0, initializer_range) for matrices, ones for norms, zeros for biases and
        for the embedding row `pad_token_id`."""
        from ..checkpoint.loader import init_like_hf

        if seed is not None:
            paddle.seed(seed)
        init_like_hf(dict(self.named_parameters()), self.config.initializer_range)
        self._zero_pad_row()

    def _zero_pad_row(self) -> None:
        """As transformers (nn.Embedding's padding_idx): an initialised embedding's row ``pad_token_id``
        starts at zero (it gets no gradient); on this rank's rows only."""
        emb, pad = getattr(getattr(self.model, "embedding", None), "embed_tokens", None), self.config.pad_token_id
        if emb is not None and pad is not None:
            start = int(getattr(emb, "start", getattr(emb, "vocab_start_index", 0)))  # this rank's first row
            if 0 <= pad - start < emb.weight.shape[0]:
                with paddle.no_grad():
                    emb.weight[pad - start] = 0.0

    @classmethod
    def from_config(cls, config: GlmMoeDsaConfig, dtype: Any = "float32", seed: int | None = None):
        from ..checkpoint.loader import resolve_model_dtype

        # a name ("bf16", "bfloat16") or a Paddle / numpy dtype, kept as its name (what the forward compares)
        model = cls(config, dtype=resolve_model_dtype(dtype, config))
        model.init_weights(seed)
        return model

    @classmethod
    def _from_config(cls, config: GlmMoeDsaConfig, dtype: Any = None, **kwargs: Any):
        """transformers' name, the one its ``AutoModel.from_config`` calls: :meth:`from_config`
        (``dtype`` None: float32, this model's default; ``torch_dtype``, its older name, is taken
        too). Other keywords (``attn_implementation`` ...) are refused by name rather than dropped."""
        torch_dtype = kwargs.pop("torch_dtype", None)
        seed = kwargs.pop("seed", None)
        if kwargs:
            raise TypeError(f"_from_config: unexpected keyword argument(s) {sorted(kwargs)}")
        dtype = dtype if dtype is not None else torch_dtype  # from_config resolves it (None: float32)
        return cls.from_config(config, dtype=dtype, seed=seed)

    @property
    def name_or_path(self) -> str:
        """transformers' ``model.name_or_path``: the config's ``_name_or_path`` (the folder
        ``from_pretrained`` read, "" for a model built from a config)."""
        return self.config._name_or_path

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        dtype: object = "auto",
        strict: bool = True,
        output_loading_info: bool = False,
        config: GlmMoeDsaConfig | None = None,
        *,
        topology: Topology | None = None,
        check_finite: bool = True,
        **config_overrides,
    ):
        """Load an official HF-layout (or Fleet-layout, or block-FP8) checkpoint folder.

        With a multi-rank ``topology`` the model is built in its split shapes and each rank reads
        only its slices. ``dtype`` ``"auto"`` is the config's dtype on an accelerator, else float32
        (checkpoint.load_pretrained_state). ``output_loading_info=True`` returns ``(model, report)``
        as transformers does; ``check_finite`` refuses weights holding NaN or Inf, naming them.
        Other keywords naming config keys override the file's (``num_hidden_layers=n`` below the
        file's: its first n layers); transformers' loading keywords are not config keys: those that
        change nothing for a local folder (``trust_remote_code``, ``revision``, ``cache_dir`` ...) are
        dropped, ``subfolder`` is read, ``torch_dtype`` is ``dtype`` (``dtype`` wins), the rest
        (``device_map``, ``variant`` ...) refused by name.
        """
        from ..checkpoint import load_pretrained_state
        from ..checkpoint.loader import init_like_hf, resolve_model_dtype
        from ..checkpoint.safetensors_io import folder_identity

        path, config_overrides = _loading_keywords(path, config_overrides)
        # the folder the config is read from: its weights are then read from that folder or refused
        # (a save publishing over it between the two), never a new checkpoint's under the old config
        folder = folder_identity(path)
        torch_dtype = config_overrides.pop("torch_dtype", None)  # transformers: dtype's older name
        if torch_dtype is not None and (isinstance(dtype, str) and dtype == "auto"):
            dtype = torch_dtype
        file_config = None  # the checkpoint's own config, when an override takes fewer decoder layers
        if config is None:
            config, file_config = _config_with_overrides(path, config_overrides)
        elif config_overrides:
            raise TypeError(
                f"from_pretrained: config overrides {sorted(config_overrides)} given with an explicit config"
            )
        else:  # a config of fewer decoder layers than the checkpoint's: its first layers, as transformers
            file_config = _deeper_file_config(path, config)
        dtype = resolve_model_dtype(dtype, config)
        # float64 (as transformers computes it on CPU): read in float32, which Paddle's checkpoint
        # engine casts to, then widened exactly
        widen, dtype = dtype == "float64", "float32" if dtype == "float64" else dtype
        if file_config is not None and topology is not None and topology.world_size > 1:
            raise NotImplementedError(
                f"from_pretrained: num_hidden_layers={config.num_hidden_layers} (the checkpoint has "
                f"{file_config.num_hidden_layers}) loads in one process only"
            )
        with _skip_random_init():  # every parameter is overwritten below: do not draw random numbers
            model = cls(config, dtype=dtype, topology=topology)
        if model.distributed:  # built split over ranks: read only this rank's slices
            from ..parallel.state import sharded_state_dict

            state, shard_info = sharded_state_dict(model, model.topology)
            slices = {"keys": set(state), "shard_info": shard_info, "folder_identity": folder}
            # keys: expert parallel leaves the other ranks' experts out
            report = load_pretrained_state(state, path, dtype=None, strict=strict, config=config, **slices)
        elif file_config is not None:  # the first layers of a deeper checkpoint (transformers' num_hidden_layers=)
            state = model.state_dict()
            report = _load_first_layers(state, path, dtype, strict, config, file_config, folder)
        else:
            state = model.state_dict()
            report = load_pretrained_state(model, path, dtype=dtype, strict=strict, folder_identity=folder)
        params = model.state_dict()
        unfilled = set(params) - set(report.loaded) - set(report.initialized)
        if unfilled:  # strict=False: what the checkpoint lacks is initialised as HF does, seeded by key
            # name so that every rank holds its piece of the same model (replicas equal)
            init_like_hf({k: state[k] for k in sorted(unfilled)}, config.initializer_range, seeded=True)
            if any(k.endswith("embed_tokens.weight") for k in unfilled):
                model._zero_pad_row()  # as transformers initialises a missing embedding
        if check_finite:
            from ..checkpoint.finite import check_finite_state

            check_finite_state(params, os.path.abspath(os.fspath(path)))
        _LOG.info("%s", report.summary())
        if widen:
            model.to(dtype="float64")
        model.source_path = os.path.abspath(os.fspath(path))
        # transformers sets the config's _name_or_path to the path as given (model.name_or_path); not a saved key
        model.config.set_loaded_from(path)
        model.eval()  # as transformers' from_pretrained: evaluation mode (training calls model.train())
        return (model, report) if output_loading_info else model

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs) -> SaveReport | None:
        """Official HF layout by default (`layout="fleet"`, `quantization="fp8"`: checkpoint package);
        all or nothing, carrying a loaded folder's tokenizer and generation files along. Built for a
        multi-rank topology it is collective: every rank writes the tensors it owns, no rank gathers
        the model, and the files are the same bytes as a one-process save. -> a
        ``checkpoint.SaveReport`` (``out_dir``, ``layout``, ``files``, ``tensors``, ``total_size``,
        ``seconds``; transformers' ``save_pretrained`` returns None). The tensors are written in the
        model's dtype, as transformers writes them (a float32 model: float32, config.json saying so);
        ``dtype="auto"`` writes the dtype its config.json states (the checkpoint's: a float32 model
        loaded from the BF16 release saves BF16 again), ``dtype="bfloat16"`` etc. that one;
        ``quantization="fp8"`` writes the official FP8 release, its other tensors in the config's dtype.
        transformers' keywords: those
        that change nothing here are accepted (``safe_serialization``: safetensors either way, as
        transformers 5.23 writes; ``push_to_hub=False``, ``token``, ``variant=None`` ...);
        ``is_main_process=False`` writes nothing and returns None, as there (a model split over ranks
        ignores it: its save is collective); ``state_dict`` (what transformers' Trainer passes) is
        written in place of the model's tensors when it holds the model's keys and shapes (one
        process), refused otherwise; ``push_to_hub=True`` or a ``variant`` are refused by name. A
        ``generation_config`` changed since it was read that transformers' ``validate`` finds options
        in that its mode ignores (``temperature`` without ``do_sample``) is refused before anything is
        written, as transformers' save refuses it."""
        from ..checkpoint import save_pretrained_state

        if not _hf_save_keywords(kwargs) and not self.distributed:
            return None  # is_main_process=False: transformers writes nothing
        state = self._state_to_save(kwargs.pop("state_dict", None))
        held = self.__dict__.get("_generation_config")
        if hasattr(held, "check_before_save"):  # transformers: a changed generation config with issues is refused
            held.check_before_save()
        kwargs.setdefault("carry_from", getattr(self, "source_path", None))
        kwargs.setdefault("generation_config", self._changed_generation_config())
        if kwargs.get("dtype") is None and kwargs.get("quantization") in (None, "none"):
            kwargs["dtype"] = self.compute_dtype  # what the model holds, as transformers writes
        if self.distributed:
            from ..checkpoint.distributed import save_pretrained_distributed

            return save_pretrained_distributed(self, save_directory, topo=self.topology, **kwargs)
        return save_pretrained_state(state, self.config, save_directory, **kwargs)

    def _state_to_save(self, given: Any) -> Any:
        """What ``save_pretrained(state_dict=...)`` writes (transformers' Trainer passes the model's
        own state dict): None is the model itself; a dict of tensors with exactly the model's keys and
        shapes (values of another dtype are cast as the model's would be) on a model in one process;
        anything else is refused, naming the first difference and not the tensors (their reprs run to
        megabytes)."""
        if given is None:
            return self
        if self.distributed or not isinstance(given, dict):
            where = "on a model split over ranks (its save is collective)" if self.distributed else "(not a dict)"
            raise ValueError(
                f"save_pretrained: state_dict={_short_repr(given)} is not supported {where}; "
                "save the model itself (leave state_dict out)"
            )
        own = self.state_dict()
        problem = None
        if set(given) != set(own):
            extra, lacking = sorted(set(given) - set(own)), sorted(set(own) - set(given))
            problem = f"keys differ from the model's (not in the model: {extra[:3]}, missing: {lacking[:3]})"
        else:
            for key, value in given.items():
                if not isinstance(value, paddle.Tensor):
                    problem = f"{key!r} is a {type(value).__name__}, not a paddle.Tensor"
                elif list(value.shape) != list(own[key].shape):
                    problem = f"{key!r} has shape {list(value.shape)}, the model's {list(own[key].shape)}"
                if problem:
                    break
        if problem:
            raise ValueError(
                f"save_pretrained: state_dict={_short_repr(given)}: {problem}; a state_dict must hold the "
                "model's keys and shapes (transformers' Trainer passes model.state_dict())"
            )
        return given

    def _changed_generation_config(self) -> dict | None:
        """``generation_config`` as a save writes it (``generation.generation_config_to_save``): None
        when the loaded folder's generation_config.json is carried as it is."""
        from ..generation import generation_config_to_save

        return generation_config_to_save(self)

    # ------------------------------------------------------------------ activation checkpointing
    def activation_checkpointing_enable(
        self,
        activation_checkpointing_kwargs: dict[str, Any] | None = None,
        every_n_layers: int = 1,
        offload: bool = False,
    ) -> None:
        """transformers 5.23's activation checkpointing: decoder layers 0, n, 2n, ... (n =
        ``every_n_layers``, counted over the model's layers as transformers counts them) keep only their
        input and are run again in backward; the same gradients. It is the trainer's ``--recompute
        full`` (Fleet's recompute, parallel/recompute.py) on those layers; the MTP layers keep their
        activations. ``activation_checkpointing_kwargs`` are torch.utils.checkpoint's keywords:
        ``use_reentrant`` (either value: Fleet's hook-based form serves both) and ``preserve_rng_state=True``
        (the random state is always restored) are taken, others refused by name; so is ``offload=True``
        (activations held in host memory)."""
        given = dict(activation_checkpointing_kwargs or {})
        unknown = sorted(set(given) - {"use_reentrant", "preserve_rng_state"})
        if unknown or given.get("preserve_rng_state", True) is not True:
            what = f"unknown keywords {unknown}" if unknown else "preserve_rng_state=False"
            raise ValueError(
                f"activation_checkpointing_enable: {what}; use_reentrant and preserve_rng_state=True are supported"
            )
        if offload:
            raise NotImplementedError("activation_checkpointing_enable: offload=True (activations in host memory)")
        if isinstance(every_n_layers, bool) or not isinstance(every_n_layers, int) or every_n_layers < 1:
            raise ValueError(
                f"activation_checkpointing_enable: every_n_layers must be an int >= 1, got {every_n_layers!r}"
            )
        self.recompute, self.recompute_every = "full", every_n_layers
        self.enable_input_require_grads()  # as transformers: a frozen embedding still feeds layer 0 a gradient

    def enable_input_require_grads(self) -> None:
        """transformers': the token embedding's output takes a gradient even where the embedding is frozen
        (adapter training), so the first checkpointed layer gets an input to recompute from. A hook on
        ``get_input_embeddings()``; set once."""
        if getattr(self, "_input_grads_hook", None) is None:
            hook = self.get_input_embeddings().register_forward_post_hook(_output_takes_gradient)
            self.__dict__["_input_grads_hook"] = hook

    def disable_input_require_grads(self) -> None:
        """Removes :meth:`enable_input_require_grads`' hook."""
        hook = self.__dict__.pop("_input_grads_hook", None)
        if hook is not None:
            hook.remove()

    def activation_checkpointing_disable(self) -> None:
        """Every layer keeps its activations again (``recompute`` "none")."""
        self.recompute, self.recompute_every = "none", 1

    @property
    def is_activation_checkpointing(self) -> bool:
        """Whether layers are recomputed in backward (``activation_checkpointing_enable`` or the
        trainer's ``--recompute``)."""
        return self.recompute != "none"

    def gradient_checkpointing_enable(
        self, gradient_checkpointing_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """transformers' deprecated name of :meth:`activation_checkpointing_enable` (a FutureWarning, as there)."""
        _deprecated("gradient_checkpointing_enable", "activation_checkpointing_enable")
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        """transformers' deprecated name of :meth:`activation_checkpointing_disable`."""
        _deprecated("gradient_checkpointing_disable", "activation_checkpointing_disable")
        self.activation_checkpointing_disable()

    @property
    def is_gradient_checkpointing(self) -> bool:
        """transformers' deprecated name of :attr:`is_activation_checkpointing`."""
        _deprecated("is_gradient_checkpointing", "is_activation_checkpointing")
        return self.is_activation_checkpointing

    # ------------------------------------------------------------------ dtype, device, embeddings
    @property
    def dtype(self) -> paddle.dtype:
        """The dtype of the first floating-point parameter (the token embedding's, or the first one this
        stage holds), as transformers' ``model.dtype``: ``paddle.float32`` / ``paddle.bfloat16``."""
        for p in self.parameters():
            if p.dtype in (paddle.float32, paddle.bfloat16, paddle.float16, paddle.float64):
                return p.dtype
        return paddle.get_default_dtype()

    @property
    def device(self) -> Any:
        """Where the parameters are (the first one's ``place``: ``paddle.CPUPlace()``, ``CUDAPlace(0)``),
        as transformers' ``model.device``; ``ids.to(model.device)`` and ``paddle.to_tensor(x,
        place=model.device)`` take it."""
        params = self.parameters()
        return params[0].place if params else paddle.get_device()

    def to(self, device: Any = None, dtype: Any = None, blocking: bool | None = None) -> GlmMoeDsaPreTrainedModel:
        """Paddle's ``Layer.to``, keeping what the model keeps in float32 whatever its dtype (the
        routers' weight and correction bias, the rope frequencies: as a model built in that dtype
        holds them, their values unchanged) and, for bfloat16 on a CPU-only Paddle, supplying the
        kernels it lacks (as building a bfloat16 model does). ``model.to(dtype="bfloat16")`` then
        computes as ``from_pretrained(..., dtype="bfloat16")``; without this the routers were
        cast too and a CPU forward stopped in Paddle ("kernel `where` is not registered"). A dtype as the
        first argument (``model.to(paddle.bfloat16)``, ``model.to("bfloat16")``: torch's ``Module.to(dtype)``)
        is the dtype."""
        from ..checkpoint.loader import normalize_dtype

        if dtype is None and dtype_name(device) is not None:
            device, dtype = None, device
        if dtype is None:
            super().to(device=device, blocking=blocking)
            return self
        name = normalize_dtype(dtype)
        cpu_bf16.check_model_dtype(name)
        if name == "bfloat16":
            cpu_bf16.install()
        fp32 = [m for m in self.sublayers() if isinstance(m, (TopkRouter, RotaryEmbedding))]
        kept = [{k: t.numpy() for k, t in m.state_dict(include_sublayers=True).items()} for m in fp32]
        kept_bufs = [[(b, b.numpy()) for b in m.buffers()] for m in fp32]
        super().to(device=device, dtype=name, blocking=blocking)
        for m, values, bufs in zip(fp32, kept, kept_bufs):
            m.to(dtype="float32")
            for k, t in m.state_dict(include_sublayers=True).items():
                t.set_value(values[k])
            for b, v in bufs:
                b.set_value(v)
        self.compute_dtype = name
        return self

    # Paddle's other casts, each `to(dtype=...)`: every cast keeps the same float32 parts (Paddle's own
    # bfloat16() / float16() / float() leave this model's parameters as they are, type() and half() cast the routers)
    def astype(self, dtype: Any = None) -> GlmMoeDsaPreTrainedModel:
        return self.to(dtype=dtype)

    def type(self, dst_type: Any) -> GlmMoeDsaPreTrainedModel:
        return self.to(dtype=dst_type)

    def bfloat16(self, excluded_layers: Any = None) -> GlmMoeDsaPreTrainedModel:
        return self.to(dtype=_whole_model("bfloat16", excluded_layers))

    def float16(self, excluded_layers: Any = None) -> GlmMoeDsaPreTrainedModel:
        return self.to(dtype=_whole_model("float16", excluded_layers))

    def float(self, excluded_layers: Any = None) -> GlmMoeDsaPreTrainedModel:
        return self.to(dtype=_whole_model("float32", excluded_layers))

    def half(self) -> GlmMoeDsaPreTrainedModel:
        return self.to(dtype="float16")

    def double(self) -> GlmMoeDsaPreTrainedModel:
        return self.to(dtype="float64")

    def tie_weights(self) -> None:
        """transformers' ``tie_weights``: nothing to tie, the LM head is the model's own
        (``tie_word_embeddings`` false: the config refuses true, docs/config.md); returns None."""
        if getattr(self.config, "tie_word_embeddings", False):
            raise NotImplementedError("tie_word_embeddings=True is not supported: the LM head is untied")

    def get_input_embeddings(self) -> nn.Layer:
        """The token embedding layer (its `.weight` is [vocab, hidden])."""
        return self.model.embedding.embed_tokens

    def set_input_embeddings(self, value: nn.Layer) -> None:
        self.model.embedding.embed_tokens = value

    def get_output_embeddings(self) -> nn.Layer:
        """The LM head (its `.weight` is [hidden, vocab], Paddle's orientation)."""
        return self.lm_head

    def set_output_embeddings(self, value: nn.Layer) -> None:
        """Replace the LM head, as transformers' ``set_output_embeddings``: the logits are
        ``value(hidden)`` from then on (a layer taking [..., hidden] to [..., vocab])."""
        self.lm_head = value

    def get_decoder(self) -> nn.Layer:
        """The decoder stack (``model.model``), as transformers' ``get_decoder``."""
        return self.model

    @property
    def base_model(self) -> nn.Layer:
        """transformers' ``base_model``: the decoder stack (``model.model``, ``base_model_prefix``)."""
        return getattr(self, self.base_model_prefix)

    def set_decoder(self, decoder: nn.Layer) -> None:
        """transformers' ``set_decoder``: the decoder stack becomes ``decoder``."""
        self.model = decoder

    def get_parameter_or_buffer(self, target: str) -> paddle.Tensor:
        """transformers': the parameter, else the buffer, of that dotted name (this rank's tensor)."""
        found = dict(self.named_parameters()).get(target)
        if found is None:
            found = dict(self.named_buffers()).get(target)
        if found is None:
            raise AttributeError(f"`{target}` is neither a parameter, buffer, nor extra state.")  # transformers' words
        return found

    def get_memory_footprint(self, return_buffers: bool = True) -> int:
        """transformers': the bytes the parameters (and with ``return_buffers`` the buffers) take; under
        model parallelism this rank's share."""
        tensors = list(self.parameters()) + (list(self.buffers()) if return_buffers else [])
        return sum(int(np.prod(t.shape)) * t.element_size() for t in tensors)

    @classmethod
    def can_generate(cls) -> bool:
        """True, as transformers' classmethod for a causal LM: ``generate`` is available (callable
        on the class, ``GlmMoeDsaForCausalLM.can_generate()``, as on a model)."""
        return True

    def resize_token_embeddings(
        self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None, mean_resizing: bool = True
    ) -> nn.Layer:
        """transformers' ``resize_token_embeddings``: the token embedding and the LM head (untied) get
        ``new_num_tokens`` rows (rounded up to a multiple of ``pad_to_multiple_of``; None with it: the
        current size rounded up), the first rows kept, rows past the end dropped, and
        ``config.vocab_size`` follows, so ``save_pretrained`` writes a checkpoint of the new size that
        transformers loads. Added rows, as transformers initialises them: ``mean_resizing=True`` (its
        default) draws them from N(mean, 1e-9 * covariance) of the old rows, in float32 (the mean
        alone where that covariance is not positive definite); ``mean_resizing=False`` from
        N(0, ``initializer_range``). Draws use Paddle's generator (``paddle.seed``). An embedding row
        ``pad_token_id`` past the new size stops being the padding row, as in transformers. ->
        the input embedding layer. One process only (a model split over ranks raises)."""
        emb = self.get_input_embeddings()
        if pad_to_multiple_of is not None:
            if not isinstance(pad_to_multiple_of, int) or isinstance(pad_to_multiple_of, bool):
                raise ValueError(
                    f"Asking to pad the embedding matrix to a multiple of `{pad_to_multiple_of}`, which is not "
                    "an integer. Please make sure to pass an integer"
                )
            if new_num_tokens is None:
                new_num_tokens = int(emb.weight.shape[0])
            new_num_tokens = -(-int(new_num_tokens) // pad_to_multiple_of) * pad_to_multiple_of
        if new_num_tokens is None:
            return emb
        if self.distributed or not (self.stage.has_embedding and self.stage.has_head):
            raise NotImplementedError("resize_token_embeddings runs on a whole model in one process")
        new = int(new_num_tokens)
        if new <= 0:
            raise ValueError(f"resize_token_embeddings: new_num_tokens must be positive, got {new_num_tokens}")
        head = self.get_output_embeddings()
        if int(emb.weight.shape[0]) != new:
            std = self.config.initializer_range
            emb.weight = _resized_param(emb, emb.weight, new, 0, mean_resizing, std)
            for attr in ("num_embeddings", "per_rank", "_num_embeddings"):
                if hasattr(emb, attr):
                    setattr(emb, attr, new)
            pad = getattr(emb, "padding_idx", None)
            if pad is not None and new - 1 < pad:
                emb.padding_idx = None
        if int(head.weight.shape[1]) != new:  # [hidden, vocab]: the vocabulary is axis 1
            head.weight = _resized_param(head, head.weight, new, 1, mean_resizing, self.config.initializer_range)
            if getattr(head, "bias", None) is not None:
                raise NotImplementedError("resize_token_embeddings: an LM head with a bias")
            if hasattr(head, "out_features"):
                head.out_features = new
        self.config.vocab_size = new
        return emb

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """Parameter count of this model (this rank's share under model parallelism).
        ``exclude_embeddings`` leaves out the token embedding only, as transformers (its nn.Embedding
        modules; the untied LM head counts)."""
        skip = set()
        if exclude_embeddings:
            skip = {id(p) for p in self.get_input_embeddings().parameters()}
        kept = [p for p in self.parameters() if id(p) not in skip and not (only_trainable and p.stop_gradient)]
        return sum(int(np.prod(p.shape)) for p in kept)

    # ------------------------------------------------------------------ generation
    @property
    def generation_config(self):
        """`generate`'s defaults (a `generation.GenerationConfig`): the checkpoint's
        generation_config.json, else the config's special tokens; assign one to change them."""
        if self.__dict__.get("_generation_config") is None:
            from ..generation import generation_config_of

            self.__dict__["_generation_config"] = generation_config_of(self)
        return self.__dict__["_generation_config"]

    @generation_config.setter
    def generation_config(self, value) -> None:
        self.__dict__["_generation_config"] = value

    def generate(self, input_ids: paddle.Tensor | None = None, attention_mask: paddle.Tensor | None = None, **kwargs):
        """Prompt + new tokens [B, S + n] int64 (HF's options; defaults from `generation_config`);
        see `paddleformers_glm.generation.generate`."""
        from ..generation import generate

        kwargs.setdefault("generation_config", self.generation_config)
        return generate(self, input_ids, attention_mask, **kwargs)

    def prepare_inputs_for_generation(
        self,
        input_ids: paddle.Tensor | None,
        next_sequence_length: int | None = None,
        past_key_values: Any = None,
        attention_mask: paddle.Tensor | None = None,
        inputs_embeds: paddle.Tensor | None = None,
        is_first_iteration: bool | None = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """transformers 5.23's ``prepare_inputs_for_generation``: the forward's keywords for one step
        of a caller's own decoding loop, ``model(**inputs)``. ``inputs_embeds`` on the first iteration
        (their last ``next_sequence_length`` rows), else the ids' last ``next_sequence_length``
        columns; the cache, ``position_ids`` (their last columns) and the [B, past + new] mask as
        given (the forward reads the new tokens' part); every other keyword passed on but ``labels``.
        No 4-D mask is made: this model's cache needs none."""
        inputs: dict[str, Any] = {}
        n = next_sequence_length
        if inputs_embeds is not None and is_first_iteration:
            inputs["input_ids"] = None
            inputs["inputs_embeds"] = inputs_embeds[:, -n:] if n is not None else inputs_embeds
        else:
            inputs["input_ids"] = input_ids[:, -n:] if n is not None else input_ids
        length = (inputs["input_ids"] if inputs["input_ids"] is not None else inputs["inputs_embeds"]).shape[1]
        if past_key_values is not None:
            inputs["past_key_values"] = past_key_values
        position_ids = kwargs.pop("position_ids", None)
        if position_ids is not None:
            inputs["position_ids"] = position_ids[..., -length:] if position_ids.shape[-1] != length else position_ids
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask
        for key, value in kwargs.items():
            if key not in ("labels", "next_sequence_length") and key not in inputs:
                inputs[key] = value
        return inputs

    def compute_transition_scores(
        self,
        sequences: paddle.Tensor,
        scores: tuple[paddle.Tensor, ...],
        beam_indices: paddle.Tensor | None = None,
        normalize_logits: bool = False,
    ) -> paddle.Tensor:
        """Each generated token's score [rows, steps] from ``generate``'s output, as transformers';
        see `paddleformers_glm.generation.compute_transition_scores`."""
        from ..generation import compute_transition_scores

        return compute_transition_scores(sequences, scores, beam_indices, normalize_logits)
