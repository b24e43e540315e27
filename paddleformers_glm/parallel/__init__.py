"""Hybrid parallelism (TP / SP / PP / EP / ETP / DP) that runs on CPU gloo and GPU NCCL.

See docs/parallel.md for how the dimensions map onto the model and for the CPU caveats.
"""

from .experts import ExpertMLP, ExpertParallelDispatcher, LocalExperts
from .fleet_pipeline import FleetPipeline
from .grads import GradSynchronizer, clip_main_grads
from .layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    ShardSpec,
    VocabParallelEmbedding,
    get_shard_spec,
    local_slice,
    mark_expert,
    mark_sequence_parallel,
    merge_slices,
    parallel_cross_entropy,
    set_shard_spec,
)
from .pipeline import (
    LossTerm,
    SingleStageEngine,
    StageOutput,
    StageSpec,
    layout_string,
    parse_pp_layout,
    split_stages,
    validate_shared_layer_starts,
)
from .state import gather_full_state, shard_full_state, sharded_state_dict
from .topology import ParallelConfig, ParallelConfigError, Topology, get_topology, init_topology, set_topology

__all__ = [
    "ColumnParallelLinear",
    "ExpertMLP",
    "ExpertParallelDispatcher",
    "FleetPipeline",
    "GradSynchronizer",
    "LocalExperts",
    "LossTerm",
    "ParallelConfig",
    "ParallelConfigError",
    "ParallelLMHead",
    "RowParallelLinear",
    "ShardSpec",
    "SingleStageEngine",
    "StageOutput",
    "StageSpec",
    "Topology",
    "VocabParallelEmbedding",
    "clip_main_grads",
    "gather_full_state",
    "get_shard_spec",
    "get_topology",
    "init_topology",
    "layout_string",
    "local_slice",
    "mark_expert",
    "mark_sequence_parallel",
    "merge_slices",
    "parallel_cross_entropy",
    "parse_pp_layout",
    "set_shard_spec",
    "set_topology",
    "shard_full_state",
    "sharded_state_dict",
    "split_stages",
    "validate_shared_layer_starts",
]
