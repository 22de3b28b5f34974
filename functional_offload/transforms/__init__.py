"""Gradient transformations (pure, on the device) and learning-rate schedules."""

from functional_offload.transforms.accumulate import MultiSteps, MultiStepsState
from functional_offload.transforms.clipping import clip_by_global_norm, global_norm
from functional_offload.transforms.guards import ApplyIfFiniteState, apply_if_finite
from functional_offload.transforms.hyperparams import InjectHyperparamsState, inject_hyperparams
from functional_offload.transforms.masking import masked
from functional_offload.transforms.partition import PartitionRefs, PartitionState, partition
from functional_offload.transforms.scaling import scale
from functional_offload.transforms import schedules

__all__ = ["clip_by_global_norm", "global_norm", "scale", "masked", "apply_if_finite",
           "ApplyIfFiniteState", "schedules", "MultiSteps", "MultiStepsState", "inject_hyperparams",
           "InjectHyperparamsState", "partition", "PartitionState", "PartitionRefs"]
