"""The DDP tutorial port on 8 simulated devices: the loss falls, and a second run into the same snapshot directory
resumes at the saved step and epoch (as a restart under ``jddp launch --max-restarts`` does), not from step 0."""

from examples.ddp_tutorial_port import train

BATCH_SIZE = 8  # per device: 64 a step on 8 devices, 2048 // 64 = 32 steps an epoch


def test_trains_and_resumes_from_the_snapshot(tmp_path, capsys):
    snapshot = str(tmp_path / "snapshot")
    first = train.main(save_every=1, total_epochs=2, batch_size=BATCH_SIZE, snapshot_path=snapshot)
    assert first.train_data.global_batch_size == BATCH_SIZE * 8
    assert (first.epochs_run, int(first.state.step)) == (0, 2 * 32)
    assert first.epoch_losses[1] < 0.9 * first.epoch_losses[0]
    assert "Resuming" not in capsys.readouterr().out

    resumed = train.main(save_every=1, total_epochs=4, batch_size=BATCH_SIZE, snapshot_path=snapshot)
    assert "Resuming training from snapshot at Epoch 2 (step 64)" in capsys.readouterr().out
    assert resumed.epochs_run == 2 and int(resumed.state.step) == 4 * 32
    assert len(resumed.epoch_losses) == 2  # epochs 2 and 3 only
    assert resumed.epoch_losses[0] < first.epoch_losses[1] and resumed.epoch_losses[1] < resumed.epoch_losses[0]
