"""Command-line tools: ``jddp info`` (later ``launch``, ``bench``); no JAX at import."""
