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
"""

from __future__ import annotations

import os
from pathlib import Path

from jddp import envvars


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jddp" / "xla"


def enable() -> str | None:
    """Turns the cache on (see the module docstring); returns its directory, or None when off or the script's."""
    import jax

    from jddp.runtime import jax_internals

    setting = envvars.get("JDDP_COMPILATION_CACHE")  # a directory, True (the default one) or False (off)
    if setting is False:
        return None
    if jax.config.jax_compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # pyright: ignore[reportAttributeAccessIssue]
        jax_internals.make_cache_writes_atomic()
        jax_internals.cache_writes_from_every_process()
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
    return str(directory)
