"""functional_offload: optax-style optimizers for PyTorch whose state can live in host memory.

    import functional_offload as fo
    opt = fo.chain(fo.clip_by_global_norm(1.0),
                   fo.adamw(lr=3e-4, placement=fo.placement.offload_fraction(1.0)))
    state = opt.init(params)
    params, state = opt.update(grads, state)
"""

from functional_offload import activations, compat, placement
from functional_offload.activations import ActivationOffload
from functional_offload.base import (EmptyState, GradientTransformation, Optimizer, ParamRefs,
                                     StateError, Step)
from functional_offload.checkpoint import CheckpointError, load, load_state_dict, save, state_dict
from functional_offload.combine import chain
from functional_offload.executor import HostExecutor, HostStepError
from functional_offload.compat import TorchOptimizer
from functional_offload.optimizers import AdamState, SGDState, adam, adamw, sgd
from functional_offload.optimizers.delay import Delay
from functional_offload.optimizers.adafactor import AdafactorState, adafactor
from functional_offload.optimizers.lion import LionState, lion
from functional_offload.placement import plan
from functional_offload.report import PlacementReport, placement_report
from functional_offload.state import ema_params, flush, land, params_of
from functional_offload.landing import LandingHooks, land_before_forward
from functional_offload.streaming import GradStream, stream
from functional_offload.transforms import (ApplyIfFiniteState, apply_if_finite,
                                           clip_by_global_norm, global_norm, masked, scale,
                                           schedules)
from functional_offload.transforms import (InjectHyperparamsState, MultiSteps, MultiStepsState,
                                           PartitionRefs, PartitionState, inject_hyperparams,
                                           partition)

__version__ = "0.1.0"


def __getattr__(name: str):
    """``fo.dcp`` is imported on first use: it imports torch.distributed.checkpoint (~1 s)."""
    if name == "dcp":
        import importlib
        return importlib.import_module("functional_offload.dcp")
    raise AttributeError(f"module 'functional_offload' has no attribute {name!r}")


__all__ = [
    "GradientTransformation", "Optimizer", "Step", "EmptyState", "ParamRefs", "StateError",
    "chain", "params_of", "ema_params", "flush", "land", "land_before_forward", "LandingHooks",
    "plan", "HostStepError",
    "adam", "adamw", "sgd", "lion", "adafactor", "AdamState", "SGDState", "LionState",
    "AdafactorState", "Delay", "stream", "GradStream",
    "clip_by_global_norm", "global_norm", "scale", "masked", "apply_if_finite",
    "ApplyIfFiniteState", "schedules",
    "MultiSteps", "MultiStepsState", "inject_hyperparams", "InjectHyperparamsState", "partition",
    "PartitionState", "PartitionRefs",
    "placement", "HostExecutor", "placement_report", "PlacementReport",
    "compat", "TorchOptimizer", "activations", "ActivationOffload",
    "save", "load", "state_dict", "load_state_dict", "CheckpointError", "dcp",
]
