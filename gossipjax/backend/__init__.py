"""Where the nodes live: one device (simulate), sharded devices, pmap, or MPI ranks."""

from gossipjax.backend._base import Backend, Mixer, current, use
from gossipjax.backend._cpu_threads import reserve_cpu_threads
from gossipjax.backend._mpi import LAUNCH_ENV as mpi_launch_env
from gossipjax.backend._mpi import Mpi, mpi
from gossipjax.backend._mpi_fault import abort_on_error as mpi_abort_on_error
from gossipjax.backend._mpi import launch_prefix as mpi_launch_prefix
from gossipjax.backend._pmapped import Pmapped, pmapped
from gossipjax.backend._sharded import Sharded, hierarchical, sharded
from gossipjax.backend._simulate import Simulate, simulate

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
    "reserve_cpu_threads",
    "sharded",
    "simulate",
    "use",
)
