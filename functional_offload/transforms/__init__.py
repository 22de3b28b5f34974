"""Gradient transformations (pure, on the device) and learning-rate schedules."""

from functional_offload.transforms.clipping import clip_by_global_norm, global_norm
from functional_offload.transforms.guards import ApplyIfFiniteState, apply_if_finite
from functional_offload.transforms.masking import masked
from functional_offload.transforms.scaling import scale
from functional_offload.transforms import schedules

__all__ = ["clip_by_global_norm", "global_norm", "scale", "masked", "apply_if_finite",
           "ApplyIfFiniteState", "schedules"]
