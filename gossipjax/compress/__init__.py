"""Compressors for communication-efficient gossip (CHOCO-SGD): sparsifiers and quantizers.

Each compressor is static data with ``compress(tree, key)`` (the dense ``C(x)``) for one
node's pytree, ``encode_leaf``/``decode_leaf`` for the compact arrays that cross the wire
(``wire_spec`` gives their shapes) and ``bits(tree)``, their size; every layer (leaf) is
compressed on its own.
"""

from gossipjax.compress._base import Compressor, Identity, identity
from gossipjax.compress._quantize import QSGD, Sign, qsgd, sign
from gossipjax.compress._sparsify import RandomK, ThresholdMean, TopK, random_k, threshold_mean, top_k

__all__ = (
    "Compressor",
    "Identity",
    "QSGD",
    "RandomK",
    "Sign",
    "ThresholdMean",
    "TopK",
    "identity",
    "qsgd",
    "random_k",
    "sign",
    "threshold_mean",
    "top_k",
)
