"""Kept for ``python -m jddp.launch``: the launcher is ``jddp.cli.launch`` (``jddp launch``), whose docstring is its
manual."""

import sys

from jddp.cli.launch import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m jddp.launch"))
