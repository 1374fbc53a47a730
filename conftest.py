# Scripts launched by the tests under mpiexec or as subprocesses: not modules to import during collection.
collect_ignore_glob = ["tests/mpi/*", "examples/*", "benchmarks/*"]
