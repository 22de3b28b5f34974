"""Movement: run the host-resident part of an update (streams, pinned staging, worker threads)."""

from functional_offload.executor.pipeline import HostExecutor, HostLeaf, physical_cores

__all__ = ["HostExecutor", "HostLeaf", "physical_cores"]
