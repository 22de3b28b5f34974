"""The class :class:`TorchOptimizer` (see :mod:`functional_offload.compat.torch_optim`)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

from functional_offload.base import Optimizer
from functional_offload.combine import fresh_leaves, keeping, through
from functional_offload.state import (FAILED, flush, land, refuse_missed_landings,
                                      tensors_of, terminal_states)
from functional_offload.compat.torch_optim.algorithms import Algorithm, algorithm_for
from functional_offload.compat.torch_optim.groups import GroupStates, GroupStep
from functional_offload.compat.torch_optim.state_dicts import (from_earlier_format,
                                                               pack_state_dict, unpack_state_dict)
from functional_offload.compat.torch_optim.views import Slot
from functional_offload.optimizers import adamw
from functional_offload.transforms import clip_by_global_norm
from functional_offload.tree import check_grad, local

__all__ = ["TorchOptimizer"]


class TorchOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose step is a functional_offload terminal optimizer.

    Args:
      params: tensors, ``(name, tensor)`` pairs (``model.named_parameters()``), or param-group
        dicts holding either, as ``torch.optim`` accepts (names are kept in the group's
        ``param_names``, as torch does).
      optimizer: the functional constructor: ``fo.adamw``, ``fo.adam``, ``fo.sgd`` (or a
        ``functools.partial`` of one), or another constructor of a terminal optimizer.
      max_grad_norm: if set, gradients are clipped by their global norm over all groups
        (``clip_grad_norm_`` semantics) before the step.
      **defaults: torch's options of that algorithm (``lr``, ``betas``, ``eps``,
        ``weight_decay``, ``maximize``, ``momentum``, ``nesterov``…; torch's defaults where not
        given) and the functional constructor's keyword options (``placement``, ``mu_dtype``,
        ``master_dtype``, ``ema_decay``, ``cpu_kernel``, ``delayed``…). Groups may override
        any of them.

    Options torch has and the adapter refuses raise ``ValueError`` (at construction, or at the
    next step if written into a group later): ``amsgrad=True``, SGD's ``dampening != 0``,
    ``capturable=True``, ``differentiable=True``. ``foreach`` and ``fused`` are accepted and
    ignored (the functional optimizer picks its kernels: fused on the GPU, native on the host).
    Other keys in a group (``name``, ``initial_lr``…) are ignored, as torch ignores them.

    Per-param state: ``optimizer.state[p]`` holds the functional state's leaves themselves
    (``exp_avg``, ``exp_avg_sq`` / ``momentum_buffer``), ``step`` (one float tensor per group:
    the state's single count), ``master`` for a low-precision param and ``ema`` with
    ``ema_decay``. Writing into these tensors changes the state; a tensor or step put in their
    place is copied into the state before the next step.

    Checkpoints: ``state_dict()`` is torch's format; ``torch.optim.AdamW``'s (``Adam``, ``SGD``)
    loads into the matching adapter and continues the same trajectory, and the adapter's loads
    into torch's class, which keeps ``master`` as unused state (drop it with a
    ``register_load_state_dict_pre_hook`` if unwanted). On load, a master is taken from the
    state_dict only at its own dtype; otherwise, and for the fp32 host copies that are not shown,
    it is set from its param (the model's values are the truth then). A state_dict of another
    algorithm is refused before anything is copied: a param's state that lacks a key the
    algorithm reads (torch's class would fail at its next step) or holds another algorithm's
    (``momentum_buffer`` loaded into AdamW, ``exp_avg_sq`` into Lion) raises ``ValueError``
    naming the param and the keys. A delayed step in flight is dropped by a load, not landed
    over the params (restore them from the model's checkpoint). Two differences stay: one
    step count per group (torch keeps one per param; a torch state whose params' steps differ
    continues from the largest, with a warning), and params that never had a grad still have
    (zero) state.

    Masters: a param whose state has a master (low-precision params; GPU params whose state is
    on the host; with ``delayed``, every param whose state is on the host, fp32 ones too) is
    written from that master at every step. After changing such params' values outside the
    optimizer (``model.load_state_dict`` mid-run, a ``clamp_`` after each step), call
    :meth:`sync_masters`, or the next step overwrites the change.

    ``accelerate``: ``Accelerator.prepare`` copies every tensor of an optimizer's
    ``state_dict()`` to the accelerator and loads it back. The state is created at the first
    step, so preparing a new optimizer (the usual order, and ``transformers.Trainer``'s) moves
    nothing. To prepare one that already has state (resumed before ``prepare``), pass
    ``device_placement=False`` for it (``accelerator.prepare_optimizer(opt,
    device_placement=False)`` or ``prepare(model, opt, device_placement=[True, False])``), or
    load its checkpoint after ``prepare``; otherwise its host-resident state makes a round trip
    through GPU memory.

    ``delayed=True``: the host-resident leaves' step lands at the next ``step()`` (as the
    look-ahead of that step's grads, :class:`~functional_offload.Delay`), or exactly at
    :meth:`flush` or ``state_dict()``; read ``optimizer.state`` after :meth:`flush`.

    Failures: after a step that failed part-way, ``step()``, ``state_dict()``, copies, pickles
    and :meth:`sync_masters` raise :class:`~functional_offload.StateError` until a checkpoint
    is loaded: ``load_state_dict``, or ``fo.load`` / DCP into :attr:`fo_states`, with the
    model's params restored from its own checkpoint. While another thread's step holds the
    state, the same calls, ``load_state_dict`` and :attr:`fo_states` raise it too.

    Example::

        >>> import torch, functional_offload as fo
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = fo.TorchOptimizer(model.named_parameters(), fo.adamw, lr=1e-3)
        >>> sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
        >>> model(torch.ones(3, 4)).sum().backward(); opt.step(); sched.step(); opt.zero_grad()
        >>> sorted(opt.state[model.weight])
        ['exp_avg', 'exp_avg_sq', 'step']
    """

    def __init__(self, params: Iterable[Any], optimizer: Callable[..., Optimizer] = adamw, *,
                 max_grad_norm: Optional[float] = None, **defaults: Any):
        algo, preset = algorithm_for(optimizer)
        unknown = set(defaults) - algo.accepts
        if unknown:
            raise TypeError(f"TorchOptimizer over {algo.name} does not take {sorted(unknown)}; "
                            f"it takes {sorted(algo.accepts)}")
        self._setup(optimizer, algo, max_grad_norm)
        merged = {**algo.defaults, **preset, **defaults}
        states = self._states  # the values are checked before the params, as torch checks them
        states.compile(states.values(merged, {}), states.options(merged), "")
        super().__init__(params, merged)

    def _setup(self, optimizer: Callable[..., Optimizer], algo: Algorithm,
               max_grad_norm: Optional[float]) -> None:
        self._make = optimizer
        self._max_grad_norm = max_grad_norm
        self._clip = clip_by_global_norm(max_grad_norm) if max_grad_norm is not None else None
        self._states = GroupStates(algo)
        self._zeroed: dict[int, tuple[torch.Tensor, int]] = {}  # zero_grad(set_to_none=False):
        #                                      each param's zeroed grad and its version then

    # ---- pickling (torch's __getstate__ keeps defaults, state and param_groups) ----------------
    def __getstate__(self) -> dict[str, Any]:
        self._states.check_marks(self.param_groups, "be copied or pickled")
        self.flush()
        return {**super().__getstate__(), "_fo_optimizer": self._make,
                "_fo_max_grad_norm": self._max_grad_norm}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        optimizer = state.pop("_fo_optimizer", adamw)
        self._setup(optimizer, algorithm_for(optimizer)[0], state.pop("_fo_max_grad_norm", None))
        super().__setstate__(state)  # the functional states are rebuilt from self.state

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (as ``torch.optim``); its values are checked first, with torch's messages."""
        if isinstance(param_group, dict) and hasattr(self, "_states"):
            states, merged = self._states, {**self.defaults, **param_group}
            states.compile(states.values(merged, self.defaults), states.options(merged),
                           f"param group {len(self.param_groups)}: ")
        super().add_param_group(param_group)

    # ---- state dicts ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch.optim's format: ``{"state": {id: {...}}, "param_groups": [...]}``, ids being
        positions over all groups, names in ``param_names``; the layout options (placement,
        dtypes…) are the optimizer's construction, not its state, and are left out. ``step`` is
        a tensor per param (torch's optimizers add to it in place). Runs torch's state-dict
        hooks; lands delayed steps first."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        self._states.check_marks(self.param_groups, "take a state_dict")
        self.flush()
        sd = pack_state_dict(self._states, self.param_groups, self.state)
        for hook in self._optimizer_state_dict_post_hooks.values():
            out = hook(self, sd)
            if out is not None:
                sd = out
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch.optim's format (this adapter's, or torch's class of the same algorithm).

        Params are matched by position, as torch does (names are kept, not used); state_dicts
        of the first TorchOptimizer (params by name) are converted. Everything is checked —
        group sizes, each param's state keys (those the algorithm reads, and none of another
        algorithm's), option values, every tensor's shape — before anything is copied. The
        values are copied into the functional state (keeping its placement); masters not in
        the state_dict are set from the params. A failed state is recovered; a delayed step
        in flight is dropped; a state in another thread's step is refused
        (:class:`~functional_offload.StateError`). Runs torch's load-state-dict hooks.
        """
        state_dict = from_earlier_format(state_dict.copy())
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = hook(self, state_dict)
            if out is not None:
                state_dict = out
        self.state = unpack_state_dict(self._states, self.param_groups, self.defaults, self.state,
                                       state_dict)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    # ---- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One step of every group (as ``torch.optim``; ``closure`` re-evaluates the loss).

        Every group's values, state and grads are checked before any group steps. A Ctrl-C
        during the step lets every group finish its step, then is raised.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._zeroed:
            self._land_untouched()
        runs = self._states.steps(self.param_groups, self.defaults)
        for run in runs:
            self._states.ready(run, self.state)
        for run in runs:
            self._gather(run)
        made: dict = {}  # the clip's new grads: the steps may keep them, as in a chain
        if self._clip is not None and runs:
            caches = [s.params.cache for r in runs for s in terminal_states(r.slot.state)
                      if s.params.cache is not None and s.params.cache.wants_scale]
            # delayed=Delay(exact_when_clipped=True) is told whether the clip scaled, as in a chain
            raw = [r.grads for r in runs]
            clipped, _ = through([self._clip], raw, (self._clip.init(None),), caches or None)
            made = fresh_leaves(raw, clipped)
            for r, g in zip(runs, clipped):
                r.grads = g
        # a missed landing is refused before any group steps
        refuse_missed_landings([(run.slot.state, run.grads) for run in runs],
                               lambda n, path: self._label(runs[n], path))
        interrupt: Optional[BaseException] = None
        stepped = False
        for run in runs:
            slot = run.slot
            state = slot.state
            hidden = (Slot.moment_fields(state) - run.moments) if run.moments is not None else ()
            given = state._replace(**{f: () for f in hidden}) if hidden else state
            count = int(state.count)
            grads = run.grads.values() if isinstance(run.grads, dict) else run.grads
            idle = all(g is None for g in grads)  # torch.optim leaves such a group alone
            try:
                if idle:  # its step count stays; a delayed step in flight lands, as at an update
                    new = flush(state)
                else:
                    with keeping(given, made):
                        _, new = run.opt.update(run.grads, given)
            except BaseException as e:
                if int(state.count) == count + 1:  # a signal's handler raised once the step
                    new = given  # had completed into the state passed in (the core's contract)
                    interrupt = interrupt or e
                else:
                    # the state is as it was, or marked failed; if another group already
                    # stepped, the optimizer as a whole is torn: every group is marked failed
                    if stepped or int(state.count) == FAILED:
                        for other in runs:
                            if other.slot.state is not None:
                                other.slot.state.count.fill_(FAILED)
                        if stepped:  # whatever the error says of its own group's state
                            e.add_note(f"fo.TorchOptimizer: param groups before group "
                                       f"{run.index} had stepped, so every group is marked "
                                       "failed; restore the model's params and "
                                       "optimizer.load_state_dict(...) a checkpoint")
                    for other in runs:
                        if other.slot.state is not None:
                            other.slot.refresh()
                    raise
            stepped = stepped or not idle
            if hidden:
                new = new._replace(**{f: getattr(state, f) for f in hidden})
            slot.state = new
            slot.refresh()
        if interrupt is not None:
            raise interrupt
        return loss

    @staticmethod
    def _label_at(run: GroupStep, j: int) -> str:
        """How errors name a group's ``j``-th param: its name in the group's ``param_names``,
        else its place in ``param_groups``."""
        names = run.slot.group.get("param_names")
        return (names[j] if isinstance(names, list) and j < len(names)
                else f"param_groups[{run.index}]['params'][{j}]")

    def _label(self, run: GroupStep, path: str) -> str:
        """:meth:`_label_at` of the param at ``path`` of the group's state."""
        keys = [str(k) for k in run.slot.keys]
        return self._label_at(run, keys.index(path)) if path in keys else path

    def _gather(self, run: GroupStep) -> None:
        slot = run.slot
        grads = []
        for j, p in enumerate(slot.params):
            label = self._label_at(run, j)
            # checked here, handed on as they are: a DTensor grad keeps its mesh, so that
            # clipping takes the norm over every rank's shards
            grads.append(None if check_grad(str(label), p.grad, p) is None else p.grad)
        if run.values.get("maximize"):
            grads = [None if g is None else torch.neg(g) for g in grads]
        run.grads = (dict(zip(slot.keys, grads)) if isinstance(slot.state.params.tree, dict)
                     else grads)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim``'s. With ``set_to_none=False`` the zeroed grads are noted: one that
        the next backward leaves untouched (its param unused) is no grad to the landed form's
        check (``fo.land_before_forward``), as ``None`` would be; its param lands at the step."""
        super().zero_grad(set_to_none)
        self._zeroed = {} if set_to_none else {
            id(p): (p.grad, p.grad._version)
            for g in self.param_groups for p in g["params"] if p.grad is not None}

    def _land_untouched(self) -> None:
        """Land the params whose grads zero_grad(set_to_none=False) zeroed and no backward
        wrote since (see :meth:`zero_grad`)."""
        zeroed, self._zeroed = self._zeroed, {}
        untouched = [p for g in self.param_groups for p in g["params"]
                     if (z := zeroed.get(id(p))) is not None and p.grad is z[0]
                     and p.grad._version == z[1]]
        if untouched:
            self.land(untouched)

    # ---- public extras ----------------------------------------------------------------------
    def flush(self) -> None:
        """Land every delayed step still in flight (``delayed=True``): the params get their new
        values and ``optimizer.state`` shows a finished step. A no-op otherwise."""
        for slot in self._states.slots:
            if slot.state is not None and slot.state.params.pending is not None:
                flush(slot.state)

    def land(self, params: Any) -> None:
        """Land the new values of ``params`` from a delayed step in flight before the rest
        (``delayed=fo.Delay(lookahead=False)``; :func:`~functional_offload.land`):
        ``fo.land_before_forward(model, optimizer)`` calls it before each module's forward, so
        that the forward reads the exact new params while the host step goes on."""
        ps = tensors_of(params, "TorchOptimizer.land params")
        for slot in self._states.slots:
            if slot.state is not None and slot.state.params.pending is not None:
                land(slot.state, ps)

    def sync_masters(self) -> None:
        """Set every master from its param's current value, after the params were changed
        outside the optimizer (e.g. ``model.load_state_dict`` mid-run); without it the next step
        would write the masters' values back over the change. A delayed step in flight is
        landed first, under the change (the params are copied for that while). A failed state
        is refused: load a checkpoint into it instead."""
        self._states.check_marks(self.param_groups, "sync masters")
        with torch.no_grad():
            for slot in self._states.slots:
                if slot.state is None:
                    continue
                if slot.state.params.pending is not None:  # its landing would undo the change
                    changed = [local(p).clone() for p in slot.params]
                    flush(slot.state)
                    for p, c in zip(slot.params, changed):
                        local(p).copy_(c)
                for j, p in enumerate(slot.params):
                    master = slot.state.master[slot.keys[j]]
                    if master is not None:
                        master.copy_(local(p))

    @property
    def fo_states(self) -> list[Any]:
        """The functional states, one per param group (``None`` for an empty group), created
        now if no step made them yet. For reading and for loading checkpoints into
        (``fo.load(path, like=tuple(opt.fo_states))``, DCP): ``step()`` donates them. A failed
        state is given as it is, so that a checkpoint loaded into it recovers it; until then
        saving it and stepping raise :class:`~functional_offload.StateError`."""
        runs = {r.index: r for r in self._states.steps(self.param_groups, self.defaults)}
        for run in runs.values():
            state = run.slot.state
            if state is None or int(state.count) != FAILED:
                self._states.ready(run, self.state, "read its functional state")
        return [runs[i].slot.state if i in runs else None for i in range(len(self.param_groups))]
