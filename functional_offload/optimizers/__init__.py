"""Terminal optimizers: their ``update`` applies the step and returns the params."""

from functional_offload.optimizers.adam import AdamState, adam, adamw
from functional_offload.optimizers.sgd import SGDState, sgd

__all__ = ["AdamState", "SGDState", "adam", "adamw", "sgd"]
