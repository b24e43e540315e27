"""GlmMoeDsaConfig's Python API against transformers 5.23's ``GlmMoeDsaConfig`` (``PreTrainedConfig``):
what a user calling it as transformers' gets. Each live comparison runs only with the reference extra
installed; its torch-free twin pins the measured value.
"""

from __future__ import annotations

import copy
import json
import pickle

import pytest

from paddleformers_glm import GlmMoeDsaConfig

from .conftest import TINY_CONFIG


def _tiny(**changes) -> dict:
    return json.loads(TINY_CONFIG.read_text()) | changes


def _hf():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import GlmMoeDsaConfig as HFConfig

    return HFConfig


# ------------------------------------------------------------------ setting an attribute


def _set_and_read(cls) -> tuple:
    c = cls.from_dict(_tiny(seq_aux=True, num_local_experts=8))
    c.num_local_experts, c.seq_aux = 4, False
    d = c.to_dict()
    return c.n_routed_experts, d["n_routed_experts"], c.seq_aux, d["seq_aux"]


def test_transformers_sets_the_attribute_map_name_and_saves_a_set_unknown_key():
    """transformers 5.23 (measured): ``num_local_experts = 4`` sets ``n_routed_experts`` 4 (its
    attribute_map) and a set file key (``seq_aux`` False) is saved as set."""
    assert _set_and_read(_hf()) == (4, 4, False, False)


def test_setting_another_producers_name_sets_the_setting_and_a_file_key_is_saved_as_set():
    """Before: ``config.num_local_experts = 4`` left ``n_routed_experts`` 8 (the model built 8 experts)
    and ``config.seq_aux = False`` was saved as the loaded ``true``. transformers: (4, 4, False, False)."""
    assert _set_and_read(GlmMoeDsaConfig) == (4, 4, False, False)
    c = GlmMoeDsaConfig.from_dict(_tiny(num_local_experts=8))
    c.num_local_experts = 4
    assert c.to_dict()["num_local_experts"] == 4  # written under the file's name
    c.dsa_index_topk = 4  # PaddleFleet's name, read the same way
    assert c.index_topk == 4 and c.to_dict()["index_topk"] == 4
    assert copy.deepcopy(c) == c and pickle.loads(pickle.dumps(c)) == c
