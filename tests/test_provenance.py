"""Provenance: which examples formed any past training step, from the loader's state alone, and skipping batches.

The runs here record what each step actually consumed (the ``i`` field of the batch the devices got, its padding
left out), independently of ``examples_at``, which recomputes it from the settings and the position; across
epochs, a resume onto another device count, and skips.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import jddp
from jddp.data.sampler import DistributedBatchSampler

N, BATCH = 45, 8  # 6 batches an epoch, the last one 5 real examples and 3 of padding


def source() -> dict[str, np.ndarray]:
    return {"i": np.arange(N, dtype=np.int32), "x": np.random.default_rng(0).normal(size=(N, 3)).astype(np.float32)}


def loader(devices: int) -> jddp.data.DataLoader:
    mesh = jddp.data_mesh(jax.devices()[:devices])
    return jddp.data.DataLoader(source(), global_batch_size=BATCH, seed=3, drop_last=False, mesh=mesh)


def consume(data: jddp.data.DataLoader, steps: int) -> list[np.ndarray]:
    """What ``steps`` training steps would train on: each global batch's real examples, as the devices hold them."""
    seen: list[np.ndarray] = []
    while len(seen) < steps:
        for batch in data:
            i, mask = np.asarray(batch["i"]), np.asarray(batch["mask"])
            seen.append(i[mask > 0])
            if len(seen) == steps:
                break
    return seen


def test_examples_at_any_step_are_what_the_run_consumed_across_epochs_and_a_resume_on_other_devices():
    first = loader(8)
    consumed = consume(first, 14)  # 2 epochs and 2 steps
    state = first.get_state()
    second = loader(4)  # resumed on another device count
    second.set_state(state)
    consumed += consume(second, 9)
    for step, seen in enumerate(consumed):
        np.testing.assert_array_equal(second.examples_at(step), seen, err_msg=f"step {step}")
    assert [len(s) for s in consumed[:6]] == [8, 8, 8, 8, 8, 5]  # the padding is not an example
    assert sorted(np.concatenate(consumed[6:12])) == list(range(N))  # epoch 1: every example once


def test_a_resume_that_skips_batches_trains_on_the_expected_examples_and_keeps_the_record():
    """Steps 0-19, then a 'loss spike': back to the checkpoint of step 10, skip the batches of steps 10-14, go on
    to step 20. The skipped batches are never read, steps 10+ take the batches 5 positions later, and a further
    resume (the state through JSON) and ``examples_at`` account for the skip."""
    reference = loader(8)
    uninterrupted = consume(reference, 25)
    run = loader(8)
    before = consume(run, 10)
    checkpoint = run.get_state()
    consume(run, 10)  # steps 10-19, thrown away with the spike
    resumed = loader(4)
    resumed.set_state(checkpoint)
    resumed.skip(5)
    after = consume(resumed, 5)  # steps 10-14 of the new history
    saved = resumed.get_state()
    assert saved["skipped"] == [[10, 15]]
    again = loader(8)
    again.set_state(json.loads(json.dumps(saved)))  # as a checkpoint holds it
    after += consume(again, 5)  # steps 15-19
    for step, seen in enumerate(before):
        np.testing.assert_array_equal(seen, uninterrupted[step])
    for step, seen in enumerate(after, start=10):
        np.testing.assert_array_equal(seen, uninterrupted[step + 5], err_msg=f"step {step}")
        np.testing.assert_array_equal(again.examples_at(step), seen, err_msg=f"step {step}")
    for step in range(10):
        np.testing.assert_array_equal(again.examples_at(step), uninterrupted[step])


def test_position_of_step_with_several_skips_against_a_replay():
    """Two skips; every step's position recomputed by walking the positions and leaving the skipped out."""
    s = DistributedBatchSampler(100, global_batch_size=10)
    s.position = 7
    s.skip(3)
    s.position = 25
    s.skip(4)
    skipped = {p for a, b in s.skipped for p in range(a, b)}
    taken = [p for p in range(60) if p not in skipped]
    assert [s.position_of_step(step) for step in range(50)] == taken[:50]


@pytest.mark.parametrize(
    ("skipped", "why"),
    [
        ([[3, 3]], "empty"),
        ([[5, 8], [6, 9]], "overlapping"),
        ([[0, 99]], "past the position"),
        ("oops", "not a list"),
        ([[1.0, 2]], "not integers"),
    ],
)
def test_a_state_with_bad_skipped_ranges_is_refused_and_changes_nothing(skipped, why):
    s = DistributedBatchSampler(100, global_batch_size=10)
    state = {**s.state_dict(), "position": 20, "skipped": skipped}
    with pytest.raises(ValueError, match=r"skipped=.* must be a list of increasing, disjoint \[start, stop\)"):
        s.load_state_dict(state)
    assert s.position == 0 and s.skipped == []


def test_skip_refuses_nothing_to_skip():
    s = DistributedBatchSampler(100, global_batch_size=10)
    for bad in (0, -2, 1.5, True):
        with pytest.raises((ValueError, TypeError), match="batches"):
            s.skip(bad)
    assert s.position == 0 and s.skipped == []


def test_a_state_without_skipped_loads_as_none_skipped():
    """States saved before skipping existed have no `skipped` entry."""
    s = DistributedBatchSampler(100, global_batch_size=10)
    state = s.state_dict()
    del state["skipped"]
    state["position"] = 12
    s.load_state_dict(state)
    assert s.skipped == [] and s.position_of_step(12) == 12


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_fit_skips_the_data_of_the_steps_asked_and_a_resume_repeats_the_decision(tmp_path, capsys):
    """fit(skip_steps=(10, 14)): steps 10+ train on the batches 5 positions later (recorded from the batches
    dp.step got), the skip is in the log and the loader state, and a run resumed from step 8 with the same
    argument trains on the same examples."""
    import jax.numpy as jnp
    import optax

    def loss_fn(params, model_state, batch, rng):
        return jddp.masked_mean(batch["x"] @ params["w"], batch["mask"]), (model_state, {})

    def run(steps: int, ckpt_dir, **kwargs) -> list[np.ndarray]:
        dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh())
        seen: list[np.ndarray] = []
        step = dp.step

        def recording(state, batch):
            i, mask = np.asarray(batch["i"]), np.asarray(batch["mask"])
            seen.append(i[mask > 0])
            return step(state, batch)

        dp.step = recording  # type: ignore[method-assign]
        data = loader(8)
        ckpt = jddp.Checkpointer(ckpt_dir, save_every=4)
        result = jddp.fit(dp, dp.init({"w": jnp.zeros(3)}), data, steps=steps, checkpointer=ckpt,
                          log_dir=tmp_path / "log", progress=False, **kwargs)  # fmt: skip
        run.data = data  # type: ignore[attr-defined]
        run.history = result.history  # type: ignore[attr-defined]
        return seen

    expected = consume(loader(8), 25)
    seen = run(20, tmp_path / "a", skip_steps=(10, 14))
    assert len(seen) == 20
    for step in range(20):
        np.testing.assert_array_equal(seen[step], expected[step + (5 if step >= 10 else 0)], err_msg=f"step {step}")
        np.testing.assert_array_equal(run.data.examples_at(step), seen[step])  # type: ignore[attr-defined]
    assert run.data.get_state()["skipped"] == [[10, 15]]  # type: ignore[attr-defined]
    assert {"step": 10, "split": "skip", "position": 10.0, "batches": 5.0}.items() <= next(
        r
        for r in run.history
        if r["split"] == "skip"  # type: ignore[attr-defined]
    ).items()
    assert "fit: skipped the data of steps 10 to 14 (loader positions 10 to 14)" in capsys.readouterr().out

    # A run stopped at step 9 (before the skip) and resumed with the same argument.
    first = run(9, tmp_path / "b", skip_steps=(10, 14))
    assert all(np.array_equal(a, b) for a, b in zip(first, seen[:9], strict=True))
    resumed = run(20, tmp_path / "b", skip_steps=(10, 14))  # restores step 9 (the final save), then 9..19
    for step, got in enumerate(resumed, start=9):
        np.testing.assert_array_equal(got, seen[step], err_msg=f"step {step}")


def test_fit_refuses_a_bad_skip_steps():
    import optax

    dp = jddp.DataParallel(lambda p, s, b, r: (p["w"].sum(), (s, {})), optax.sgd(0.1), mesh=jddp.data_mesh())
    state = dp.init({"w": np.zeros(3, np.float32)})
    for bad in ((5, 3), (-1, 2), (1.0, 2), 7, (1, 2, 3)):
        with pytest.raises(ValueError, match=r"skip_steps=.* must be \(first, last\)"):
            jddp.fit(dp, state, loader(8), steps=3, progress=False, skip_steps=bad)


@pytest.mark.multiprocess
def test_examples_at_equals_what_every_process_consumed_across_a_resume_onto_another_process_count(tmp_path):
    """2 processes x 2 devices take 14 steps (2 epochs and 2 steps), then 1 process x 1 device resumes from the
    loader state for 9 more: for every step, the union of what the processes' devices actually held (recorded by
    each process from its own shards) is ``examples_at(step)``, as computed by the resumed run."""
    from tests import multiprocess

    script = str(multiprocess.WORKERS / "provenance.py")
    multiprocess.run(script, 2, 2, str(tmp_path), "a", "14")
    multiprocess.run(script, 1, 1, str(tmp_path), "b", "9", str(tmp_path / "state-a.json"))
    consumed: dict[int, list[int]] = {}
    for name in ("consumed-a-0", "consumed-a-1", "consumed-b-0"):
        for step, own in json.loads((tmp_path / f"{name}.json").read_text()).items():
            consumed.setdefault(int(step), []).extend(own)
    assert sorted(consumed) == list(range(23))
    recomputed = json.loads((tmp_path / "examples_at-b.json").read_text())
    for step in range(23):
        assert sorted(consumed[step]) == sorted(recomputed[str(step)]), step
    a0 = json.loads((tmp_path / "consumed-a-0.json").read_text())
    a1 = json.loads((tmp_path / "consumed-a-1.json").read_text())
    assert all(a0[s] and a1[s] and not set(a0[s]) & set(a1[s]) for s in a0)  # each process its own part
    assert [len(consumed[s]) for s in range(6)] == [8, 8, 8, 8, 8, 5]
    assert sorted(i for s in range(6, 12) for i in consumed[s]) == list(range(N))
