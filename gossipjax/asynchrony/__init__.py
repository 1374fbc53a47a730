"""Asynchrony and heterogeneity: simulated clusters with stragglers, slow links and faults;
AD-PSGD, synchronous D-PSGD / AllReduce and SGP with bounded staleness in simulated time;
asynchronous pairwise gossip across real MPI processes (`gossipjax.asynchrony.mpi_adpsgd`)."""

from gossipjax.asynchrony._cluster import (
    Cluster,
    allreduce_time,
    cluster,
    compute_time,
    random_speed_cluster,
    straggler_cluster,
    transfer_time,
)
from gossipjax.asynchrony._faults import (
    Faults,
    delivered_edges,
    delivered_mask,
    faults,
    faulty_mix,
    is_up,
    renormalize,
)
from gossipjax.asynchrony._mpi_async import MPIAsyncResult, mpi_adpsgd
from gossipjax.asynchrony._sgp_sim import SGPSimState, sgp_bounded_staleness, sgp_params
from gossipjax.asynchrony._simulator import AsyncState, Simulator, SyncState, adpsgd, synchronous

__all__ = (
    "AsyncState",
    "Cluster",
    "Faults",
    "MPIAsyncResult",
    "SGPSimState",
    "Simulator",
    "SyncState",
    "adpsgd",
    "allreduce_time",
    "cluster",
    "compute_time",
    "delivered_edges",
    "delivered_mask",
    "faults",
    "faulty_mix",
    "is_up",
    "mpi_adpsgd",
    "random_speed_cluster",
    "renormalize",
    "sgp_bounded_staleness",
    "sgp_params",
    "straggler_cluster",
    "synchronous",
    "transfer_time",
)
