"""The Flax tutorial port: it learns, the exported module predicts on the host, and a run stopped at step 200 and
resumed from its checkpoint ends exactly where an uninterrupted run does (parameters, data position, and the
running means of steps 201-300, saved in the checkpoint at step 300)."""

import pytest

from examples.flax_port import train


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path):
    straight = train.main(["--steps", "400"])
    assert straight["test_accuracy"] > 0.9  # chance is 0.1
    assert straight["host_accuracy_25"] > 0.8  # the exported module, on the host
    ckpt = str(tmp_path / "ckpt")
    first = train.main(["--steps", "400", "--stop-at", "300", "--checkpoint", ckpt])
    assert first["steps"] == 300
    resumed = train.main(["--steps", "400", "--checkpoint", ckpt])
    assert resumed == straight
