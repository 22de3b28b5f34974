"""Movement: run the host-resident part of an update (streams, pinned staging, worker threads).

``chunking`` cuts host leaves into chunks, ``run`` is one run's state machine (its own driver
and lander threads), ``transport`` the copies and events, ``host`` the executor owning rings and
workers (and the process-wide default), ``timeline`` an opt-in recording, ``faults`` the hooks
:mod:`functional_offload.testing` injects failures through.
"""

from functional_offload.executor.host import (HostExecutor, SplitStep, default_executor, node_share,
                                              physical_cores)
from functional_offload.executor.chunking import HostLeaf
from functional_offload.executor.run import HostStepError, Run
from functional_offload.executor.timeline import Timeline

__all__ = ["HostExecutor", "HostLeaf", "HostStepError", "Run", "SplitStep", "Timeline",
           "default_executor", "node_share", "physical_cores"]
