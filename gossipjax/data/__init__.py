"""Data over nodes: partitions, jitted per-node sampling, and loaders that need no network."""

from gossipjax.data._datasets import Dataset, load_cifar10, load_digits, load_mnist
from gossipjax.data._partition import partition_by_class, partition_dirichlet, partition_iid
from gossipjax.data._sampling import NodeData, node_data, sample_batches

__all__ = (
    "Dataset",
    "NodeData",
    "load_cifar10",
    "load_digits",
    "load_mnist",
    "node_data",
    "partition_by_class",
    "partition_dirichlet",
    "partition_iid",
    "sample_batches",
)
