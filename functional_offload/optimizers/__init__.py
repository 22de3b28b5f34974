"""Terminal optimizers: their ``update`` applies the step and returns the params.

Each optimizer is an :class:`~functional_offload.optimizers.spec.OptimizerSpec` (its state, its
hyperparameters, its math) and a constructor that hands the spec and the user's options to
:func:`~functional_offload.optimizers.terminal.terminal`.
"""

from functional_offload.optimizers.adam import AdamState, adam, adamw
from functional_offload.optimizers.sgd import SGDState, sgd
from functional_offload.optimizers.spec import Moment, OptimizerSpec

__all__ = ["AdamState", "SGDState", "adam", "adamw", "sgd", "Moment", "OptimizerSpec"]
