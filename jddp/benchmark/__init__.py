"""What ``jddp bench`` runs: ``models`` (the benchmark models, synthetic batches and the
hand-written reference step), ``custom`` (the user's own model, ``--model MODULE:FUNCTION``,
whose ``FUNCTION`` returns a ``BenchModel``) and ``worker`` (one configuration, started as
``python -m jddp.benchmark.worker`` under ``jddp launch``). Imports no JAX.
"""

from jddp.benchmark.custom import BenchModel

__all__ = ["BenchModel"]
