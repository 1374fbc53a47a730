"""The main job's names, as the command line lists them: no JAX is imported to show ``--help``.

`gossipjax.train.ALGORITHMS`, `gossipjax.train.TOPOLOGIES` and the compressors build what each
name stands for; their keys are these names, in this order.
"""

ALGORITHM_NAMES = ("allreduce", "dpsgd", "dmsgd", "decentlam", "qg_dmsgd", "gradient_tracking", "exact_diffusion",
                   "extra", "sgp", "choco", "dmsgd_pga", "d_adam", "allreduce_adamw", "d_adamw", "easgd", "diloco",
                   "noloco", "streaming_diloco")

TOPOLOGY_NAMES = ("ring", "exponential", "symmetric_exponential", "one_peer_exponential", "torus", "grid", "star",
                  "hypercube", "complete", "random_pairs")

COMPRESSOR_NAMES = ("top_k", "random_k", "sign", "qsgd", "threshold_mean", "identity")
