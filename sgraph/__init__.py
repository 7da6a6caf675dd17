"""sgraph: JAX-style functional transforms over PyTorch.

Write one pure train step over pytrees of tensors; ``sg.static`` captures it whole
(forward, backward and optimizer update) and replays it.
"""

from . import optim, random, tree
from ._src.api import Transformed, fuse, plan_memory, shard, static
from ._src.errors import (
    ArgumentError,
    ArgumentTypeError,
    CaptureError,
    DonationWarning,
    FallbackWarning,
    RetraceError,
    RetraceWarning,
    SgraphError,
    SgraphWarning,
    StaleBufferError,
    TreeStructureError,
    UnsupportedError,
)
from ._src.functional import functional
from ._src.grad import grad, value_and_grad
from ._src.passes.memory.analysis import MemoryAnalysis
from ._src.passes.memory.plan import MemoryPlan
from ._src.passes.shard.cost import CostAnalysis, Links
from ._src.sharding import P, ddp, distribute, fsdp, mesh, replicate, tp
from ._src.stages import Compiled, CompiledStats, Lowered, Traced
from ._src.tags import checkpoint_name

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "UnsupportedError",
    "CaptureError",
    "Compiled",
    "CostAnalysis",
    "CompiledStats",
    "Links",
    "Lowered",
    "MemoryAnalysis",
    "MemoryPlan",
    "P",
    "Traced",
    "Transformed",
    "DonationWarning",
    "FallbackWarning",
    "RetraceError",
    "RetraceWarning",
    "SgraphError",
    "SgraphWarning",
    "StaleBufferError",
    "TreeStructureError",
    "checkpoint_name",
    "ddp",
    "distribute",
    "fsdp",
    "functional",
    "fuse",
    "grad",
    "mesh",
    "plan_memory",
    "replicate",
    "shard",
    "static",
    "tp",
    "value_and_grad",
    "optim",
    "random",
    "tree",
]
