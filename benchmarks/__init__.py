"""gossipjax benchmark suite: ``python -m benchmarks`` prints a table and writes JSON.

Every figure that matters is a ratio measured within one run (interleaved repetitions,
medians), so the suite can be rerun on a busy machine and still say something.
"""
