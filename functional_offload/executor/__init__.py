"""Movement: run the host-resident part of an update (streams, pinned staging, worker threads)."""

from functional_offload.executor.pipeline import HostExecutor, HostLeaf, physical_cores
from functional_offload.executor.timeline import Timeline

__all__ = ["HostExecutor", "HostLeaf", "Timeline", "physical_cores"]
