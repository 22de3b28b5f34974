"""``TorchOptimizer``: a ``torch.optim.Optimizer`` whose step is a functional_offload optimizer.

Module loops keep their shape — ``loss.backward(); opt.step(); opt.zero_grad()`` — and the tools
written for ``torch.optim`` (LR and momentum schedulers, ``GradScaler``, ``swa_utils``,
``transformers.Trainer``, ``accelerate``) see the contract they expect:

- Each param group holds every option torch's class would (``betas``, ``eps``, ``amsgrad``…),
  and at every step the functional optimizer is built from the group's current values, so
  whatever a scheduler or ``load_state_dict`` writes there (``lr``, ``betas``, ``momentum``,
  ``eps``, ``weight_decay``) is what the step uses. Values are checked with torch's messages at
  construction, in ``add_param_group`` and at each step before anything changes.
- ``optimizer.state[p]`` shows the functional state's own leaves under torch's keys
  (:mod:`.views`); ``state_dict()`` is torch's format (integer ids, ``param_names``), loads into
  ``torch.optim``'s class of the same algorithm and back, and runs torch's state-dict hooks.
- The functional state is created at the first step (or load), as torch creates its state, so
  that tools that move a fresh optimizer's state (``accelerate``'s ``prepare``) move nothing.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, Optional

import torch

from functional_offload.base import FAILED, Optimizer, ParamRefs, flush
from functional_offload.compat.torch_optim.algorithms import FREE_OPTIONS, algorithm_for
from functional_offload.compat.torch_optim.state_dicts import Run, StateDicts, apply_copies
from functional_offload.compat.torch_optim.views import (Slot, mark_error, quiesce,
                                                         signature, tree_of)
from functional_offload.optimizers import adamw
from functional_offload.transforms import clip_by_global_norm
from functional_offload.tree import check_grad, local

__all__ = ["TorchOptimizer"]


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # noqa: BLE001 - objects without a plain equality are compared by identity
        return False


class TorchOptimizer(StateDicts, torch.optim.Optimizer):
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
    on the host) is written from that master at every step. After changing such params' values
    outside the optimizer (``model.load_state_dict`` mid-run), call :meth:`sync_masters`, or the
    next step overwrites the change.

    ``accelerate``: ``Accelerator.prepare`` copies every tensor of an optimizer's
    ``state_dict()`` to the accelerator and loads it back. The state is created at the first
    step, so preparing a new optimizer (the usual order, and ``transformers.Trainer``'s) moves
    nothing. To prepare one that already has state (resumed before ``prepare``), pass
    ``device_placement=False`` for it (``accelerator.prepare_optimizer(opt,
    device_placement=False)`` or ``prepare(model, opt, device_placement=[True, False])``), or
    load its checkpoint after ``prepare``; otherwise its host-resident state makes a round trip
    through GPU memory.

    ``delayed=True``: the params of the host-resident leaves land at the next ``step()``,
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
        self._setup(optimizer, max_grad_norm)
        merged = {**algo.defaults, **preset, **defaults}
        self._compile(self._values(merged), self._options(merged), "")  # before params, as torch
        super().__init__(params, merged)

    def _setup(self, optimizer: Callable[..., Optimizer], max_grad_norm: Optional[float]) -> None:
        self._make = optimizer
        self._algo, _ = algorithm_for(optimizer)
        self._max_grad_norm = max_grad_norm
        self._clip = clip_by_global_norm(max_grad_norm) if max_grad_norm is not None else None
        self._slots: dict[int, Slot] = {}

    # ---- pickling (torch's __getstate__ keeps defaults, state and param_groups) ----------------
    def __getstate__(self) -> dict[str, Any]:
        self._check_marks("be copied or pickled")
        self.flush()
        return {**super().__getstate__(), "_fo_optimizer": self._make,
                "_fo_max_grad_norm": self._max_grad_norm}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self._setup(state.pop("_fo_optimizer", adamw), state.pop("_fo_max_grad_norm", None))
        super().__setstate__(state)  # the functional states are rebuilt from self.state

    # ---- groups and their values ------------------------------------------------------------
    def _values(self, group: dict) -> dict[str, Any]:
        d = getattr(self, "defaults", {})
        return {k: group[k] if k in group else d.get(k, v) for k, v in self._algo.defaults.items()}

    def _options(self, group: dict) -> dict[str, Any]:
        return {k: group[k] for k in self._algo.options if k in group}

    def _compile(self, values: dict, options: dict, where: str) -> tuple[Optimizer, Optional[frozenset]]:
        """Check a group's values and build this step's functional optimizer from them."""
        try:
            self._algo.check(values)
            return self._algo.build(values, options), self._algo.moments(values)
        except (ValueError, TypeError, RuntimeError) as e:
            if not where:
                raise
            try:
                err = type(e)(f"{where}{e}")
            except Exception:  # noqa: BLE001 - an exception type with another signature
                raise e from None
            raise err from None

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (as ``torch.optim``); its values are checked first, with torch's messages."""
        if isinstance(param_group, dict) and hasattr(self, "_algo"):
            merged = {**self.defaults, **param_group}
            self._compile(self._values(merged), self._options(merged),
                          f"param group {len(self.param_groups)}: ")
        super().add_param_group(param_group)

    def _slot(self, group: dict) -> Slot:
        slot = self._slots.get(id(group))
        if slot is None or slot.group is not group:
            slot = self._slots[id(group)] = Slot(group)
        return slot

    def _prune(self) -> None:
        live = {id(g) for g in self.param_groups}
        for k in [k for k in self._slots if k not in live]:
            del self._slots[k]

    def _fixed(self, options: dict) -> dict:
        return {k: v for k, v in options.items() if k not in FREE_OPTIONS}

    def _check_marks(self, action: str) -> None:
        """Raise :class:`StateError` if a group's state is failed or in a step (nothing reads
        or writes it then but a load)."""
        for i, g in enumerate(self.param_groups):
            slot = self._slots.get(id(g))
            if slot is not None and slot.state is not None:
                err = mark_error(slot.state, f"param group {i}: ", action)
                if err is not None:
                    raise err

    # ---- the functional states --------------------------------------------------------------
    def _runs(self) -> list[Run]:
        """Check every group and build its optimizer for this step (nothing changes yet)."""
        self._prune()
        runs = []
        for i, group in enumerate(self.param_groups):
            if not group["params"]:
                continue
            values, options = self._values(group), self._options(group)
            opt, moments = self._compile(values, options, f"param group {i}: ")
            runs.append(Run(i, self._slot(group), opt, values, options, moments))
        return runs

    def _compatible(self, slot: Slot, params: list, run: Run) -> bool:
        """Whether the slot's state fits the group as it is now (else it is laid out anew)."""
        fixed = self._fixed(run.options)
        return (len(params) == len(slot.params) and all(a is b for a, b in zip(params, slot.params))
                and signature(params) == slot.signature
                and fixed.keys() == slot.fixed.keys()
                and all(_same(fixed[k], slot.fixed[k]) for k in fixed)
                and (run.moments is None or run.moments <= Slot.moment_fields(slot.state)))

    def _entries(self, params: list) -> list[Optional[dict]]:
        """Snapshots of the params' dicts in ``self.state`` (``None`` where a param has none)."""
        out = []
        for p in params:
            e = self.state.get(p) if hasattr(self.state, "get") else None
            out.append(dict(e) if isinstance(e, dict) and e else None)
        return out

    def _lay_out(self, run: Run, params: list, group: Optional[dict] = None) -> tuple[Any, list]:
        tree, keys = tree_of(run.slot.group if group is None else group, params)
        try:
            state = run.opt.init(tree)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{run.where}{e}") from None
        if not isinstance(getattr(state, "params", None), ParamRefs) or not hasattr(state, "master"):
            raise TypeError(f"{run.where}{self._algo.name} made a {type(state).__name__} state; "
                            "TorchOptimizer needs a terminal optimizer's state (fo.adamw, fo.adam, "
                            "fo.sgd...); clip with max_grad_norm= instead of a chain")
        return state, keys

    def _ready(self, run: Run, action: str = "step") -> None:
        """Make the run's slot hold a usable state that shows what ``self.state`` shows: lay it
        out at the first step or when the group changed (params, their devices or dtypes, layout
        options, moments now needed), taking in values written into the views."""
        slot, params = run.slot, list(run.slot.group["params"])
        if slot.state is not None:
            err = mark_error(slot.state, run.where, action)
            if err is not None:
                raise err
            slot.follow()
            if self._compatible(slot, params, run):
                if slot.edited(self.state):
                    self._sync(run)
                return
            quiesce(slot.state, dropping=False)
        entries = self._entries(params)
        state, keys = self._lay_out(run, params)
        names = run.slot.group.get("param_names")
        copies, count = Slot.copies_for(state, keys, params, entries, reset=False, resync_masters=False,
                                  where=run.where, names=names)
        apply_copies(state, copies, count)
        slot.install(state, keys, params, self._fixed(run.options))
        slot.write_views(self.state, entries)

    def _sync(self, run: Run) -> None:
        """Take values written into the views into the state (see :mod:`.views`)."""
        slot = run.slot
        entries = self._entries(slot.params)
        gone = sum(e is None for e in entries)
        if 0 < gone < len(entries):
            warnings.warn(f"{run.where}{gone} params have no entry in optimizer.state any more: "
                          "their state restarts from zero, but they share the group's step count",
                          stacklevel=4)
        copies, count = Slot.copies_for(slot.state, slot.keys, slot.params, entries, reset=True,
                                  resync_masters=False, where=run.where,
                                  names=slot.group.get("param_names"))
        quiesce(slot.state, dropping=False)
        apply_copies(slot.state, copies, count)
        slot.write_views(self.state, entries)

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
        runs = self._runs()
        for run in runs:
            self._ready(run)
        for run in runs:
            self._gather(run)
        if self._clip is not None and runs:
            clipped, _ = self._clip.update([r.grads for r in runs], self._clip.init(None))
            for r, g in zip(runs, clipped):
                r.grads = g
        interrupt: Optional[BaseException] = None
        stepped = False
        for run in runs:
            slot = run.slot
            state = slot.state
            hidden = (Slot.moment_fields(state) - run.moments) if run.moments is not None else ()
            given = state._replace(**{f: () for f in hidden}) if hidden else state
            count = int(state.count)
            try:
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
                    for other in runs:
                        if other.slot.state is not None:
                            other.slot.refresh()
                    raise
            stepped = True
            if hidden:
                new = new._replace(**{f: getattr(state, f) for f in hidden})
            slot.state = new
            slot.refresh()
        if interrupt is not None:
            raise interrupt
        return loss

    def _gather(self, run: Run) -> None:
        slot = run.slot
        names = slot.group.get("param_names")
        grads = []
        for j, p in enumerate(slot.params):
            label = names[j] if isinstance(names, list) and j < len(names) else \
                f"param_groups[{run.index}]['params'][{j}]"
            # checked here, handed on as they are: a DTensor grad keeps its mesh, so that
            # clipping takes the norm over every rank's shards
            grads.append(None if check_grad(str(label), p.grad, p) is None else p.grad)
        if run.values.get("maximize"):
            grads = [None if g is None else torch.neg(g) for g in grads]
        run.grads = (dict(zip(slot.keys, grads)) if isinstance(slot.state.params.tree, dict)
                     else grads)

    # ---- public extras ----------------------------------------------------------------------
    def flush(self) -> None:
        """Land every delayed step still in flight (``delayed=True``): the params get their new
        values and ``optimizer.state`` shows a finished step. A no-op otherwise."""
        for slot in list(self._slots.values()):
            if slot.state is not None and slot.state.params.pending is not None:
                flush(slot.state)

    def sync_masters(self) -> None:
        """Set every master from its param's current value, after the params were changed
        outside the optimizer (e.g. ``model.load_state_dict`` mid-run); without it the next step
        would write the masters' values back over the change. A failed state is refused: load a
        checkpoint into it instead."""
        self._check_marks("sync masters")
        self.flush()
        with torch.no_grad():
            for slot in self._slots.values():
                if slot.state is None:
                    continue
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
        runs = {r.index: r for r in self._runs()}
        for run in runs.values():
            state = run.slot.state
            if state is None or int(state.count) != FAILED:
                self._ready(run, "read its functional state")
        return [runs[i].slot.state if i in runs else None for i in range(len(self.param_groups))]
