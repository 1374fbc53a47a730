# Scripts launched by the tests under mpiexec or as subprocesses: not modules to import during collection.
collect_ignore_glob = ["tests/mpi/*", "examples/*", "benchmarks/*"]

import os
import tempfile

# gj.gossip_sgd_step builds its native kernel at first use; a fresh cache directory per test
# session makes every run build it from source rather than reuse a library from an earlier run.
os.environ.setdefault("GOSSIPJAX_CACHE_DIR", tempfile.mkdtemp(prefix="gossipjax-native-"))
