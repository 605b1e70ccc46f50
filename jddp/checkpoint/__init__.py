"""Checkpoints of the complete training state on Orbax: async, atomic, verified, resumable anywhere.

    ckpt = jddp.Checkpointer("runs/exp1/ckpt", save_every=500, max_to_keep=3, config=config)
    state, loader = ckpt.restore_or_init(state, loader)   # resumes, or keeps `state` when there is nothing
    for batch in loader:
        state, metrics = dp.step(state, batch)
        ckpt.maybe_save(state, loader)                      # every 500 steps; on SIGTERM: save and exit 75
    ckpt.save(state, loader); ckpt.close()

What a checkpoint (one directory per step, written by Orbax's
``CheckpointManager``) holds:

* ``state``: the ``TrainState`` (step, parameters, optimizer state, model
  state, RNG), every leaf as an array;
* ``loader``: the data loader's position (``DataLoader.get_state()``), global,
  so it resumes on any number of processes;
* ``meta``: the step, the process and device counts, the jddp, JAX and Orbax
  versions, a fingerprint of the config, the path, shape and dtype of every
  state leaf, and a 64-bit digest of every leaf's bytes.

Guarantees:

* **Async.** ``save`` returns before the files are written; ``close`` waits.
  Orbax is handed one copy of each replicated array per process (the buffer of
  that process's first device, not a copy), so it slices nothing while the
  caller waits and every process still writes its share. A single process on
  CPU hands Orbax's own blocking part to a writer thread and returns after
  pinning the buffers with host views (no copy; a pinned buffer is never
  donated, so the next step writes into new memory; a typed PRNG key is
  pinned through its key data) and dispatching the
  digests: medians of 3 to 8 ms at 64 MB on a loaded 2-core machine, at most
  4% of a synchronous save (``benchmarks/checkpoint_stall.py``). Orbax's part
  then runs beside the training loop and competes with it for the GIL. Saves
  do not overlap: a save first waits until Orbax has taken the previous one.
* **Atomic.** Orbax writes into ``<step>.orbax-checkpoint-tmp-*`` and renames
  when complete; a kill at any instant leaves the previous checkpoint intact.
  Leftover temporary directories are removed when a ``Checkpointer`` opens the
  directory.
* **Verified.** Orbax does not checksum: flipped bytes restore as garbage. jddp
  recomputes each leaf's digest after a restore. A damaged checkpoint (missing
  or truncated files, a digest mismatch) produces a warning naming the step and
  the reason, is renamed to ``<step>.damaged``, and the next older one is tried.
  Every process takes the same decision (the outcome of each attempt is
  all-gathered).
* **Every checkpoint damaged.** Then ``restore_or_init`` starts from the state
  passed in, with one more ``CheckpointWarning`` listing every step and reason,
  and ``Checkpointer.damaged`` lists them. It does not raise: a relaunch would
  find the damaged steps set aside and start afresh anyway, so an error would
  only add a crash (and under ``jddp launch --max-restarts``, a restart) before
  the same outcome, and an error that kept the steps in place would crash every
  relaunch. Nothing is deleted: the ``<step>.damaged`` directories stay (Orbax
  ignores them, retention never removes them) for inspection or repair. To stop
  instead, turn the warning into an error
  (``warnings.simplefilter("error", jddp.CheckpointWarning)``): it is raised
  before the step is set aside, so every relaunch stops at it.
* **One writer per directory.** A writing ``Checkpointer`` holds the lease
  ``<directory>/jddp.lease`` (owner, host, pid; its modification time is a
  heartbeat) from its construction to ``close``; in a group, process 0 holds
  it for all. A second writer (a relaunch beside the running job, a notebook)
  gets ``CheckpointLeaseError`` naming the owner before it touches anything
  (Orbax's start-up clean-up would delete the first writer's save in flight).
  A lease whose owner was a process of this host that no longer runs is taken
  over at once; one from another host once its heartbeat is
  ``lease_timeout_s`` old (60 s). A writer that froze that long and lost its
  lease raises at its next save instead of writing beside the new owner.
  ``gs://`` and ``s3://`` directories go to Orbax's own path handling and take
  no lease (an object store has no atomic create there).
* **Readers.** ``Checkpointer(directory, read_only=True)`` (an evaluator, a
  notebook) restores the newest complete step while a trainer writes: it reads
  the directory afresh each time, skips a step that the writer's retention
  removed meanwhile, never saves, never cleans up, never renames a damaged
  step, takes no lease and leaves SIGTERM alone.
* **Failed writes.** A write that fails (disk full, the directory removed or
  made read-only) raises ``CheckpointError`` once, naming the directory, the
  steps lost, the cause and the newest intact step; Orbax's own error logs of
  it are dropped (its error is the ``__cause__``). The failed steps are not
  counted as saved: the next ``save`` writes the step again. ``save``,
  ``maybe_save`` and ``restore_or_init`` after ``close`` raise
  ``CheckpointError``; ``close`` twice is fine.
* **The run's identity.** The first writer of a directory writes a run id
  to ``<directory>/jddp.run`` (``jddp.checkpoint.identity``); later writers
  of the directory (restarts, elastic rounds, relaunches) read it back. Every
  checkpoint and every in-memory snapshot carries it with the config
  fingerprint and every leaf's path, shape and dtype. A snapshot of another
  run is never restored (a warning names both runs) and is removed; a
  checkpoint step of another run is an error naming both, or with
  ``allow_other_run=True`` a warning naming both. A reader of a directory
  that does not exist or holds no checkpoint says so in a warning.
* **Side by side.** Any number of ``Checkpointer``s save in one run, also at
  every step in a group: each one's Orbax barriers carry its own prefix
  (``orbax_io.barrier_prefix``). A save whose barrier between processes
  failed raises ``CheckpointError`` naming the barrier.
* **A step saved twice.** ``save`` (or ``maybe_save``) of a step that this
  ``Checkpointer`` saved or restored last is the same state: nothing is
  written again (a run's final ``save`` after ``maybe_save`` saved that step).
  A step that the directory holds from anything else (an earlier run at the
  same path, a run that went back to an older step) is never kept silently:
  ``on_existing="refuse"`` (the default, as Orbax's ``StepAlreadyExistsError``)
  raises ``CheckpointStepExistsError`` naming the step before anything is
  written; ``"overwrite"`` deletes the old step and writes the new one (as
  ``torch.save`` replaces a file: until the new step is published only the
  older steps are on disk); ``"keep"`` keeps the old one and says so in a
  ``CheckpointWarning``. Whether the step exists is agreed: it exists when any
  process sees it.
* **No loader position.** A checkpoint saved without a loader, restored with
  one, is not damage: the state is restored, the loader starts from its
  beginning, and a ``CheckpointWarning`` says so.
* **In-memory snapshots.** Where ``$JDDP_SNAPSHOT_DIR`` names a directory in
  memory that outlives the processes (``jddp launch`` makes one per run in
  ``/dev/shm``), ``maybe_save`` also keeps snapshots of the complete state
  there (``jddp.checkpoint.snapshot``): every step, or every k steps when
  their measured cost passes ``snapshot_budget`` (1%) of the step time, the
  same steps on every process (agreed at the preemption exchanges). Each
  process keeps its newest two, each written beside them and renamed when
  complete, with a CRC-32: a kill during a write leaves the older ones. A
  restart's ``restore_or_init`` restores the newest step that every process
  holds, when it is not older than the disk's newest (agreed, CRC-checked;
  ``restored_from == "memory"``); when some processes hold none (their host
  was replaced), the newest step another process holds is sent to them over
  the devices (``"peer"``; a state split by ZeRO-1 goes to disk instead);
  when no process holds one of its own process count (an elastic run's next
  round, ``jddp launch --nnodes MIN:MAX``), the newest step that a group of
  another count left on the hosts is sent the same way (whole leaves restore
  onto any count), and those folders are removed once the restore is agreed;
  otherwise the disk as before. Of a replicated state only the first process
  of each host (``$JDDP_LOCAL_RANK`` 0) keeps snapshots, the others restore
  from it as peers: memory per host, 3 x the state (two kept, one being
  written); of a state split by ZeRO-1, every process keeps its own part.
  ``snapshots=False`` or ``JDDP_SNAPSHOTS=0``
  turns them off; closing after the run removes them, an error keeps them.
* **Kept steps: no completed step recomputed.** In a group, with snapshots on
  and a state of whole leaves, ``maybe_save`` also keeps a copy of every
  step's state on the devices (the newest ``max_inflight + 1``: a copy no
  later step donates), where they fit (``JDDP_KEEP_STEPS``: ``auto``, ``on``,
  ``off``; ``jddp.checkpoint.snapshot_kept``). When ``jddp launch`` ends the
  survivors of a failure, each writes the newest kept step that completed
  as a snapshot, and the restart restores it from that peer: the steps
  between snapshots are not recomputed. The restore takes a step some
  process holds before an older one every process holds.
* **Any topology.** The state is restored into the shardings of the ``state``
  passed to ``restore_or_init`` (Orbax reshards), and the loader continues the
  same global batch sequence on any process count.
* **Preemption.** While a ``Checkpointer`` is open it catches SIGTERM (to any
  process, e.g. forwarded by ``jddp launch`` or sent by a scheduler to one
  process). A single process stops at the next ``maybe_save``. In a group the
  processes exchange their notices with one small all-gather about every
  ``preemption_check_s`` seconds, at steps they agreed at the previous
  exchange, and all stop at the same step. ``maybe_save`` saves that step,
  waits for the write, and raises ``SystemExit(75)`` (``jddp.EXIT_PREEMPTED``).
  Running again resumes. When the last open ``Checkpointer`` closes, SIGTERM
  gets its default action back and a notice caught meanwhile is dropped.
* **Agreement.** ``maybe_save`` decides from a step counter every process
  keeps the same way (call it once per step on every process) and from
  collectives, never from local state alone. Every process takes part in every
  save (Orbax writes each process's share of every array and synchronises the
  processes: with collectives in the calling thread, which a dead peer turns
  into exit 69 through jddp's watchdog, and with key-value barriers limited by
  ``timeout_s`` in the background).
"""

from jddp.checkpoint.checkpointer import DAMAGED_SUFFIX as DAMAGED_SUFFIX
from jddp.checkpoint.checkpointer import Checkpointer as Checkpointer
from jddp.checkpoint.digest import config_fingerprint as config_fingerprint
from jddp.checkpoint.digest import digest_array as digest_array
from jddp.checkpoint.digest import state_digests as state_digests
from jddp.checkpoint.errors import CheckpointError as CheckpointError
from jddp.checkpoint.errors import CheckpointLeaseError as CheckpointLeaseError
from jddp.checkpoint.errors import CheckpointStepExistsError as CheckpointStepExistsError
from jddp.checkpoint.errors import CheckpointWarning as CheckpointWarning

__all__ = (
    "DAMAGED_SUFFIX",
    "CheckpointError",
    "CheckpointLeaseError",
    "CheckpointStepExistsError",
    "CheckpointWarning",
    "Checkpointer",
    "config_fingerprint",
    "digest_array",
    "state_digests",
)
