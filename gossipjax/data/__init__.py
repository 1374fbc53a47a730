"""Data over nodes: partitions, jitted per-node sampling, and loaders (images and text) that need no network."""

from gossipjax.data._datasets import Dataset, load_cifar10, load_digits, load_mnist
from gossipjax.data._partition import partition_by_class, partition_by_source, partition_dirichlet, partition_iid
from gossipjax.data._sampling import NodeData, node_data, sample_batches
from gossipjax.data._text import load_python_stdlib, load_text, text_sources

__all__ = (
    "Dataset",
    "NodeData",
    "load_cifar10",
    "load_digits",
    "load_mnist",
    "load_python_stdlib",
    "load_text",
    "node_data",
    "partition_by_class",
    "partition_by_source",
    "partition_dirichlet",
    "partition_iid",
    "sample_batches",
    "text_sources",
)
