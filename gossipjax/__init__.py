"""gossipjax: decentralized (gossip) optimization for JAX, as optax transforms.

Every algorithm is an ``optax.GradientTransformation`` over params whose leaves carry a
leading node axis; a topology (the mixing matrix W) says who averages with whom.
"""

import lazy_loader

# Every public name (listed, with its module, in __init__.pyi) is imported on first use: `import
# gossipjax` loads no JAX, and `gossipjax train --help` answers at once.
__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)

__version__ = "0.1.0"
