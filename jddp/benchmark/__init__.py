"""What ``jddp bench`` runs: ``models`` (the benchmark models, synthetic batches and the
hand-written reference step) and ``worker`` (one configuration, started as
``python -m jddp.benchmark.worker`` under ``jddp launch``). Imports no JAX.
"""
