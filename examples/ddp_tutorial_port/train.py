# A port to jddp of PyTorch's DDP tutorial script: pytorch/examples (https://github.com/pytorch/examples),
# distributed/ddp-tutorial-series/multigpu_torchrun.py with MyTrainDataset from datautils.py beside it,
# BSD-3-Clause license. This is a port, not the original: the Trainer, its methods and the CLI are the original's;
# the lines marked "jddp:" say what changed and why.
#
#   jddp launch -n 2 --devices-per-process 2 examples/ddp_tutorial_port/train.py 4 2

import numpy as np
import optax
from flax import nnx

import jddp
from jddp import models


def ddp_setup():
    jddp.initialize()  # jddp: init_process_group; joins the group under `jddp launch`, alone a no-op


def MyTrainDataset(size):  # jddp: datautils.py's random data, one seed so that every process holds the same
    rng = np.random.default_rng(0)
    return {"x": rng.random((size, 20), np.float32), "y": rng.random((size, 1), np.float32)}


def mse_loss(model, batch, rng):  # jddp: _run_batch's loss, on one device's slice of the global batch
    return jddp.masked_mean(((model(batch["x"]) - batch["y"]) ** 2).mean(-1), batch["mask"])


class Trainer:
    def __init__(
        self,
        model: nnx.Module,
        train_data: jddp.data.DataLoader,
        optimizer: optax.GradientTransformation,
        save_every: int,
        snapshot_path: str,
    ) -> None:
        self.gpu_id = jddp.process_index()  # jddp: a process drives several devices; LOCAL_RANK -> process index
        graphdef, params, model_state = models.nnx_split(model)
        self.train_data = train_data
        self.dp = jddp.DataParallel(models.nnx_loss(graphdef, mse_loss), optimizer, mesh=jddp.data_mesh())
        self.state = self.dp.init(params, model_state, rng=0)  # jddp: DDP(model): replicated on every device
        self.save_every = save_every
        self.epochs_run = 0
        self.epoch_losses = []
        self.snapshot_path = snapshot_path  # jddp: save_every epochs -> steps; every process saves its part
        self.checkpointer = jddp.Checkpointer(snapshot_path, save_every=save_every * len(train_data))
        self._load_snapshot(snapshot_path)

    def _load_snapshot(self, snapshot_path):
        self.state, self.train_data = self.checkpointer.restore_or_init(self.state, self.train_data)
        self.epochs_run = self.train_data.epoch  # jddp: params, optimizer state, step and the loader's position
        if int(self.state.step) > 0:
            print(f"Resuming training from snapshot at Epoch {self.epochs_run} (step {int(self.state.step)})")

    def _run_batch(self, batch):
        self.state, metrics = self.dp.step(self.state, batch)  # jddp: zero_grad, forward, backward, all-reduce, step
        return metrics["loss"]

    def _run_epoch(self, epoch):
        b_sz = self.train_data.per_device_batch_size
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        losses = []
        for batch in self.train_data:  # jddp: the global batch, each process reading its slice
            losses.append(self._run_batch(batch))
            self._save_snapshot(epoch)  # jddp: once per step: saves every save_every steps, and on preemption
        self.epoch_losses.append(float(np.mean(losses)))
        if jddp.is_main_process():
            print(f"Epoch {epoch} | loss {self.epoch_losses[-1]:.4f}")

    def _save_snapshot(self, epoch):
        if self.checkpointer.maybe_save(self.state, self.train_data) and jddp.is_main_process():
            print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path} (step {int(self.state.step)})")

    def train(self, max_epochs: int):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)


def load_train_objs():
    train_set = MyTrainDataset(2048)  # load your dataset
    model = nnx.Linear(20, 1, rngs=nnx.Rngs(0))  # load your model
    optimizer = optax.sgd(learning_rate=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset: dict, batch_size: int):
    return jddp.data.DataLoader(  # jddp: DataLoader and DistributedSampler in one, world-size invariant
        dataset,
        per_device_batch_size=batch_size,
        seed=0,
    )


def main(save_every: int, total_epochs: int, batch_size: int, snapshot_path: str = "snapshot"):
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    trainer.checkpointer.close()  # jddp: waits for the last save (destroy_process_group has no counterpart)
    return trainer


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each device (default: 32)")
    args = parser.parse_args()

    main(args.save_every, args.total_epochs, args.batch_size)
