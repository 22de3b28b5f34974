"""A recomputed group's function: checkpoint recomputes it, and the tensors its forward saves
are checked for changes in place as autograd checks them."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from functional_offload.activations._transfer import Versioned

__all__ = ["Recomputed"]


def _checkpoint_hooks() -> Optional[tuple[Callable, Callable]]:
    """The saved-tensor hooks on top (checkpoint's, in its forward), where torch tells them
    (about 2.8 on: earlier versions recompute unchecked, as checkpoint does)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False)


class Recomputed:
    """A recomputed group's function. Its first call, the forward (under checkpoint's hooks),
    keeps each saved tensor's version counter and checks it when backward unpacks the tensor,
    as autograd does: changed in place after it was saved, inside the group or later, it would
    otherwise be recomputed from the changed values. The recomputes call ``fn`` plainly."""

    def __init__(self, fn: Callable, index: int):
        self.fn, self.index, self.ran = fn, index, False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hooks = None if self.ran else _checkpoint_hooks()
        self.ran = True
        if hooks is None:
            return self.fn(*args, **kwargs)
        (pack, unpack), index = hooks, self.index
        with torch.autograd.graph.saved_tensors_hooks(lambda t: Versioned(pack(t), t, index),
                                                      lambda h: unpack(h.get())):
            return self.fn(*args, **kwargs)
