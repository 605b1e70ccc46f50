"""``Checkpointer.save`` of a step the directory already holds (issue 44): never kept silently; ``on_existing``
refuses (the default), replaces or keeps it with a warning; a step this Checkpointer saved or restored last is the
same state and is not written again."""

from __future__ import annotations

import inspect
import warnings

import jax
import numpy as np
import optax
import pytest

import jddp
from jddp.checkpoint import checks


def loss_fn(params, model_state, batch, key):
    return ((batch["x"] @ params["w"]) ** 2).mean(), (model_state, {})


def make(scale: float):
    """A state at step 0 whose weights are ``scale`` (runs told apart by their weights)."""
    mesh = jddp.data_mesh(jax.devices()[:1])
    dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh)
    return dp.init({"w": np.full((4, 1), scale, np.float32)})


def saved_weight(directory) -> float:
    with jddp.Checkpointer(directory, read_only=True) as reader:
        return float(np.asarray(reader.restore_or_init(make(0.0)).params["w"])[0, 0])


def test_the_choices_are_the_documented_ones():
    default = inspect.signature(jddp.Checkpointer).parameters["on_existing"].default
    assert checks.ON_EXISTING[0] == default == "refuse"
    for choice in checks.ON_EXISTING:
        assert f'"{choice}"' in (jddp.Checkpointer.__doc__ or "") and f'"{choice}"' in (jddp.checkpoint.__doc__ or "")


@pytest.mark.parametrize("on_existing", checks.ON_EXISTING)
def test_an_existing_step_from_another_run_is_never_kept_silently(tmp_path, on_existing):
    """Run A saves step 0 (weights 1); run B, at the same path, saves step 0 with weights 2 without restoring."""
    with jddp.Checkpointer(tmp_path) as a:
        a.save(make(1.0), wait=True)
    b = jddp.Checkpointer(tmp_path, on_existing=on_existing)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        if on_existing == "refuse":
            with pytest.raises(jddp.checkpoint.CheckpointStepExistsError, match=r"already holds step 0.*on_existing"):
                b.save(make(2.0), wait=True)
        else:
            b.save(make(2.0), wait=True)
    b.close()
    kept = [w for w in said if issubclass(w.category, jddp.CheckpointWarning)]
    expected = {"refuse": 1.0, "overwrite": 2.0, "keep": 1.0}[on_existing]
    assert saved_weight(tmp_path) == expected
    assert (len(kept) == 1 and "step 0" in str(kept[0].message)) == (on_existing == "keep")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["0"]


@pytest.mark.parametrize("on_existing", checks.ON_EXISTING)
def test_a_step_this_checkpointer_saved_or_restored_is_not_written_again(tmp_path, on_existing):
    """A run's final save after maybe_save saved that step, and a resumed run at its last step: no error, no
    warning, whatever on_existing says."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with jddp.Checkpointer(tmp_path, save_every=1, on_existing=on_existing) as c:
            state = make(1.0)
            c.save(state, wait=True)
            c.save(state, wait=True)
        with jddp.Checkpointer(tmp_path, on_existing=on_existing) as c:
            state = c.restore_or_init(make(5.0))
            c.save(state, wait=True)
    assert saved_weight(tmp_path) == 1.0


@pytest.mark.parametrize("bad", ["replace", "", None, 1, True], ids=repr)
def test_a_bad_choice_is_refused_naming_it(tmp_path, bad):
    with pytest.raises((TypeError, ValueError), match="on_existing"):
        jddp.Checkpointer(tmp_path, on_existing=bad)
    assert not tmp_path.joinpath("jddp.lease").exists()


@pytest.mark.multiprocess  # two worker processes, twice
@pytest.mark.parametrize(
    ("on_existing", "expected"),
    [("refuse", "refused 1.0"), ("overwrite", "saved 2.0"), ("keep", "saved+warned 1.0")],
)
def test_in_a_group_every_process_takes_the_same_decision(tmp_path, on_existing, expected):
    """Two processes save step 0 (weights 1), then two new ones save step 0 again (weights 2): every process
    refuses, replaces (process 0 removes, all wait, all read the directory afresh) or keeps, and the group ends."""
    from tests import multiprocess

    worker = str(multiprocess.WORKERS / "ckpt_existing.py")
    for scale, mode, said in (("1", "refuse", "saved 1.0"), ("2", on_existing, expected)):
        codes, outputs = multiprocess.collect(multiprocess.spawn(worker, 2, 1, str(tmp_path), scale, mode), 300)
        assert codes == [0, 0], multiprocess.show(codes, outputs)
        assert f"OUTCOME {said}" in outputs[0], multiprocess.show(codes, outputs)
