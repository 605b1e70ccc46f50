"""New semantic mutants of the Checkpointer's guarantees (issues 42 and 44), in ``tests/semantic_mutants.py``'s
format, for the lead to merge into it: the run's identity, Checkpointers side by side, a step saved twice.

Until merged, importing this module adds its mutants to the registry; run them with the registry's runner:

    PYTEST_PLUGINS=tests.semantic_mutants_checkpoint python -m tests.semantic_mutants_checkpoint [NAME ...]
"""

from __future__ import annotations

import runpy
import sys

from tests import semantic_mutants as registry
from tests.semantic_mutants import Mutant, _p

CKPT = registry.CKPT
ID, SBS, EX = (
    "tests/test_checkpoint_identity.py",
    "tests/test_checkpoint_side_by_side.py",
    "tests/test_checkpoint_existing.py",
)

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "another_runs_snapshot_restored",
        CKPT,
        "A snapshot of another run is never restored (a warning names both runs) and is removed",
        "a snapshot's run id and config fingerprint are not compared: a new run at a stopped run's path restores "
        "the stopped run's weights from memory",
        (
            _p(
                "jddp.checkpoint.snapshot_format:_decode",
                ('if header.get("run") != run or header.get("fingerprint") != fingerprint:', "if False:"),
            ),
        ),
        (f"{ID}::test_a_new_run_at_a_stopped_runs_path_does_not_restore_its_snapshots",),
    ),
    Mutant(
        "checkpointers_share_orbax_barriers",
        CKPT,
        "each one's Orbax barriers carry its own prefix",
        "every Checkpointer's Orbax manager waits at Orbax's unprefixed barriers: two managers' background writes "
        "meet at one barrier",
        (
            _p(
                "jddp.checkpoint.orbax_io:manager_options",
                ("barrier_sync_key_prefix=barrier_prefix", "barrier_sync_key_prefix=None"),
            ),
        ),
        (
            f"{SBS}::test_two_open_checkpointers_wait_at_barriers_of_different_names",
            f"{SBS}::test_two_checkpointers_save_every_step_for_200_steps_in_two_processes",
        ),
    ),
    Mutant(
        "existing_step_kept_silently",
        CKPT,
        "is never kept silently",
        "a step the directory holds from another run is skipped without a word, whatever on_existing says",
        (
            _p(
                "jddp.checkpoint.checkpointer:Checkpointer._may_write",
                ("    others = sorted(", "    return False\n    others = sorted("),
            ),
        ),
        (f"{EX}::test_an_existing_step_from_another_run_is_never_kept_silently",),
    ),
)

if not any(m.name == MUTANTS[0].name for m in registry.MUTANTS):  # imported as a plugin and by the runner: once
    registry.MUTANTS = registry.MUTANTS + MUTANTS


if __name__ == "__main__":  # the registry's runner over these mutants (all of them unless named)
    names = [a for a in sys.argv[1:] if not a.startswith("-")]
    flags = [a for a in sys.argv[1:] if a.startswith("-")]
    sys.argv = [sys.argv[0], *flags, *(names or [m.name for m in MUTANTS])]
    runpy.run_path(str(registry.ROOT / "tools" / "semantic_mutants.py"), run_name="__main__")
