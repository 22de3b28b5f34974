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

from functional_offload.compat.torch_optim.optimizer import TorchOptimizer

__all__ = ["TorchOptimizer"]
