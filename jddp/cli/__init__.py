"""Command-line tools of the ``jddp`` command: ``main`` (the command itself, ``--version`` and ``info``),
``launch`` (``jddp launch``, the launcher; its docstring is the manual) and ``bench`` (``jddp bench``).

Importing the package, ``main`` or ``launch`` pulls in no JAX; ``info`` and ``bench`` import it when they run.
"""
