"""Where the nodes live: one device (simulate), sharded devices, pmap, or MPI ranks."""

from gossipjax.backend import _cpu_threads
from gossipjax.backend._base import Backend, Mixer, current, use
from gossipjax.backend._mpi import LAUNCH_ENV as mpi_launch_env
from gossipjax.backend._mpi import Mpi, mpi
from gossipjax.backend._mpi_fault import abort_on_error as mpi_abort_on_error
from gossipjax.backend._mpi import launch_prefix as mpi_launch_prefix
from gossipjax.backend._pmapped import Pmapped, pmapped
from gossipjax.backend._sharded import Sharded, hierarchical, sharded
from gossipjax.backend._simulate import Simulate, simulate

# Before JAX starts its CPU client: multi-device steps queued without waiting need 2 threads per
# CPU device there, or they deadlock it (see _cpu_threads).
_cpu_threads.reserve_collective_threads()

__all__ = (
    "Backend",
    "Mixer",
    "Mpi",
    "Pmapped",
    "Sharded",
    "Simulate",
    "current",
    "hierarchical",
    "mpi",
    "mpi_abort_on_error",
    "mpi_launch_env",
    "mpi_launch_prefix",
    "pmapped",
    "sharded",
    "simulate",
    "use",
)
