"""The optimizers under test: one entry each, with its oracle. ``test_registry.py`` runs every
entry through the properties every optimizer must have; a new optimizer gets them all by
adding its entry here."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import optree
import torch

import functional_offload as fo

Oracle = Callable[[Any, list], Any]  # (params, grads per step) -> params after the steps


class Entry(NamedTuple):
    name: str
    make: Callable[..., fo.Optimizer]  # make(**hypers, **options)
    hypers: dict  # the hyperparameters of this entry
    oracle: Oracle
    exact: bool  # the torch kernel gives the oracle's bits (same ops in the same order)
    native: bool = True  # has a native host op
    delayed: bool = True  # offers delayed=True
    remainders: bool = True  # offers store_param_remainders=True


def torch_oracle(cls: type, **kwargs: Any) -> Oracle:
    """``torch.optim`` itself: ``cls(params, **kwargs)`` stepped on the grads."""
    def run(params: Any, grads: list) -> Any:
        ps = optree.tree_map(lambda t: t.detach().clone().requires_grad_(), params)
        leaves = optree.tree_leaves(ps)
        opt = cls(leaves, **kwargs)
        for g in grads:
            for p, gi in zip(leaves, optree.tree_leaves(g)):
                p.grad = gi.clone()
            opt.step()
        return optree.tree_map(lambda t: t.detach(), ps)
    return run


def lion_by_hand(lr: float, betas: tuple, weight_decay: float) -> Oracle:
    """Lion as the paper writes it (no reference in torch.optim)."""
    b1, b2 = betas

    def run(params: Any, grads: list) -> Any:
        ps, ms = [p.clone() for p in optree.tree_leaves(params)], None
        for g in grads:
            gs = optree.tree_leaves(g)
            ms = ms or [torch.zeros_like(p) for p in ps]
            for p, m, gi in zip(ps, ms, gs):
                p.mul_(1 - lr * weight_decay)
                p.add_(torch.sign(m * b1 + gi * (1 - b1)), alpha=-lr)
                m.copy_(m * b2 + gi * (1 - b2))
        return optree.tree_unflatten(optree.tree_structure(params), ps)
    return run


ADAMW = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
ADAM = dict(lr=1e-2, betas=(0.8, 0.999), eps=1e-6, weight_decay=0.05)
SGD = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)

SGDM = dict(lr=0.05, momentum=0.9, weight_decay=1e-3)
LION = dict(lr=3e-3, betas=(0.9, 0.99), weight_decay=0.3)
ADAFACTOR = dict(lr=1e-2, weight_decay=0.1)

OPTIMIZERS = [
    Entry("adamw", fo.adamw, ADAMW, torch_oracle(torch.optim.AdamW, **ADAMW), True),
    Entry("adamw-nowd", fo.adamw, dict(lr=3e-3, weight_decay=0.0),
          torch_oracle(torch.optim.AdamW, lr=3e-3, weight_decay=0.0), True),
    Entry("adam", fo.adam, ADAM, torch_oracle(torch.optim.Adam, **ADAM), True),
    Entry("sgd", fo.sgd, dict(lr=0.05), torch_oracle(torch.optim.SGD, lr=0.05), True),
    Entry("sgd-momentum", fo.sgd, SGDM, torch_oracle(torch.optim.SGD, **SGDM), True),
    Entry("sgd-nesterov", fo.sgd, SGD, torch_oracle(torch.optim.SGD, **SGD), True),
    Entry("lion", fo.lion, LION, lion_by_hand(**LION), True),
    Entry("adafactor", fo.adafactor, ADAFACTOR, torch_oracle(torch.optim.Adafactor, **ADAFACTOR), True,
          native=False, delayed=False),
]
