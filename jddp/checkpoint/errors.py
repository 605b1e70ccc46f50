"""The checkpoint layer's exceptions and warning (imported by its modules and re-exported by ``jddp``)."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or the ``Checkpointer`` cannot do what was asked.

    The message names the directory, the step and what to do. A save that
    raised it is not recorded as saved: the previous checkpoint is intact and
    the next save writes the step again.
    """


class CheckpointStepExistsError(CheckpointError):
    """``save`` of a step the directory already holds, by a ``Checkpointer`` with ``on_existing="refuse"`` (as
    Orbax's ``StepAlreadyExistsError``): nothing was written, the step on disk is unchanged."""


class CheckpointLeaseError(CheckpointError):
    """The checkpoint directory is written by another run, or this run lost its lease to one."""


class CheckpointWarning(UserWarning):
    """A checkpoint could not be used (damaged): an older one is used instead, or, when none is left, none."""
