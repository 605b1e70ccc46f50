"""The persistent compilation cache, on by default for jddp runs, so a restart does not compile again.

``jddp.initialize()`` turns on JAX's persistent compilation cache unless the
script configured one itself (``jax_compilation_cache_dir`` or
``$JAX_COMPILATION_CACHE_DIR``). Where: ``$JDDP_COMPILATION_CACHE`` (a
directory; ``0``, ``off``, ``false`` or ``no`` turns it off; ``1``, ``on``,
``true`` or ``yes`` means the default), else ``$XDG_CACHE_HOME/jddp/xla``
or ``~/.cache/jddp/xla``. Every compiled program is kept
(``jax_persistent_cache_min_compile_time_secs=0``, unless set): on 2 CPU cores
the small programs of a step are what a restart waits for.

The cache is keyed by the program, its compile options, the devices and the
JAX version, so programs of other runs and topologies sit side by side; only
an identical program is read back. Processes of one group and several runs
may share the directory: jddp makes JAX write each entry atomically
(``jax_internals.make_cache_writes_atomic``), so a process killed in the
middle of a write leaves no truncated entry behind, and lets every process
write its own programs (JAX writes process 0's only, and on CPU the others'
programs have keys of their own: ``jax_internals.cache_writes_from_every_process``). JAX never evicts without
``jax_compilation_cache_max_size``; set it to bound the directory.

``enable`` says where once, on stderr of process 0 (the launcher's ``JDDP_PROCESS_ID``, else MPI's or SLURM's
rank; before JAX knows it): ``jddp: compilation cache in ~/.cache/jddp/xla (JDDP_COMPILATION_CACHE: another
directory, or 0 for none)``, ``... off (JDDP_COMPILATION_CACHE=0)`` or ``... the script's own``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from jddp import envvars

RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")  # a process's rank under MPI or SLURM
_said = False  # the cache's line was printed (or is not this process's to print)


def _say(where: str) -> None:
    """Prints ``jddp: compilation cache <where>`` to stderr, once, on process 0."""
    global _said
    if _said:
        return
    _said = True
    index = envvars.get("JDDP_PROCESS_ID")
    for name in RANK_VARIABLES:
        if index is None and os.environ.get(name, "").strip().isdigit():
            index = int(os.environ[name])
    if not index:
        print(f"jddp: compilation cache {where}", file=sys.stderr, flush=True)


def _shown(directory: str) -> str:
    """``directory`` with the home directory as ``~``."""
    home = os.path.expanduser("~")
    return "~" + directory[len(home) :] if home not in ("", "/") and directory.startswith(home + os.sep) else directory


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jddp" / "xla"


def enable() -> str | None:
    """Turns the cache on (see the module docstring); returns its directory, or None when off or the script's."""
    import jax

    from jddp.runtime import jax_internals

    setting = envvars.get("JDDP_COMPILATION_CACHE")  # a directory, True (the default one) or False (off)
    if setting is False:
        _say("off (JDDP_COMPILATION_CACHE=0)")
        return None
    own = jax.config.jax_compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR")  # pyright: ignore[reportAttributeAccessIssue]
    if own:
        jax_internals.make_cache_writes_atomic()
        jax_internals.cache_writes_from_every_process()
        _say(f"in {_shown(str(own))}, the script's own (jax_compilation_cache_dir)")
        return None  # the script chose its own
    directory = Path(setting) if isinstance(setting, str) else default_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(
            f"The compilation cache directory {str(directory)!r} cannot be created ({error}); set "
            "$JDDP_COMPILATION_CACHE to a writable directory, or to 0 to turn the cache off."
        ) from None
    jax_internals.make_cache_writes_atomic()
    jax_internals.cache_writes_from_every_process()
    jax.config.update("jax_compilation_cache_dir", str(directory))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    _say(f"in {_shown(str(directory))} (JDDP_COMPILATION_CACHE: another directory, or 0 for none)")
    return str(directory)
