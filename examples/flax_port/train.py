"""Flax's NNX MNIST tutorial (``docs_nnx/mnist_tutorial``), ported to jddp: data-parallel on any number of devices
and processes, resumable, with the tutorial's model, optimizer, step count and metrics.

What the port changes, and why, is ``docs/guides/porting.md``. The data is scikit-learn's digits (8x8 images, no
download) in place of TFDS MNIST (28x28), so the first linear layer takes 64 x 2 x 2 features instead of
64 x 7 x 7; nothing else of the model differs.

    python -m examples.flax_port.train                       # every local device
    python -m examples.flax_port.train --devices 8           # 8 simulated CPU devices
    jddp launch -n 2 --devices-per-process 4 -m examples.flax_port.train
    python -m examples.flax_port.train --checkpoint runs/flax_port/ckpt   # resumes when killed
"""

from __future__ import annotations

import argparse
from functools import partial

import numpy as np

TRAIN_STEPS, EVAL_EVERY, BATCH_SIZE = 1200, 200, 32  # the tutorial's
LEARNING_RATE, MOMENTUM = 0.005, 0.9  # the tutorial's adamw(learning_rate, momentum)


def load_digits() -> tuple[dict, dict]:
    """scikit-learn's digits as the tutorial's ``{"image": [n, 8, 8, 1] in [0, 1], "label": [n]}``, 80/20 split."""
    from sklearn.datasets import load_digits as digits
    from sklearn.model_selection import train_test_split

    d = digits()
    x, x_test, y, y_test = train_test_split(
        (d.images / 16.0).astype(np.float32)[..., None], d.target.astype(np.int32), test_size=0.2,
        random_state=0, stratify=d.target,
    )  # fmt: skip
    return {"image": x, "label": y}, {"image": x_test, "label": y_test}


def make_cnn():
    from flax import nnx

    class CNN(nnx.Module):
        """The tutorial's CNN: two 3x3 convolutions with average pooling, then two linear layers."""

        def __init__(self, *, rngs: nnx.Rngs):
            self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
            self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
            self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
            self.linear1 = nnx.Linear(64 * 2 * 2, 256, rngs=rngs)  # 8x8 images: 8 -> 4 -> 2
            self.linear2 = nnx.Linear(256, 10, rngs=rngs)

        def __call__(self, x):
            x = self.avg_pool(nnx.relu(self.conv1(x)))
            x = self.avg_pool(nnx.relu(self.conv2(x)))
            x = nnx.relu(self.linear1(x.reshape(x.shape[0], -1)))
            return self.linear2(x)

    return CNN(rngs=nnx.Rngs(0))


def loss_fn(model, batch, rng):
    """One device's slice: the mean loss over its real examples (jddp weights it), and the accuracy."""
    import optax

    import jddp

    logits = model(batch["image"])
    mask = batch.get("mask")
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch["label"])
    accuracy = (logits.argmax(-1) == batch["label"]).astype(np.float32)
    return jddp.masked_mean(loss, mask), {"accuracy": jddp.masked_mean(accuracy, mask)}


def eval_fn(model, batch):
    loss, metrics = loss_fn(model, batch, None)
    return {"loss": loss, **metrics}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=0, help="simulated CPU devices per process (0: JAX's)")
    parser.add_argument("--steps", type=int, default=TRAIN_STEPS)
    parser.add_argument("--checkpoint", default="", help="a directory to checkpoint to and resume from")
    parser.add_argument("--stop-at", type=int, default=0, help="stop and save at this step, as a preemption would")
    args = parser.parse_args(argv)

    import jddp  # after parsing: --help needs no JAX

    jddp.initialize(local_devices=args.devices or None)  # joins the group under `jddp launch`; alone a no-op
    import optax

    from jddp import models

    train_ds, test_ds = load_digits()
    graphdef, params, model_state = models.nnx_split(make_cnn())
    dp = jddp.DataParallel(
        models.nnx_loss(graphdef, loss_fn),
        optax.adamw(LEARNING_RATE, MOMENTUM),
        mesh=jddp.data_mesh(),
        eval_fn=models.nnx_eval(graphdef, eval_fn),
    )
    state = dp.init(params, model_state, rng=0)
    train_loader = jddp.data.DataLoader(train_ds, global_batch_size=BATCH_SIZE, seed=0)  # reshuffled every epoch
    test_loader = jddp.data.DataLoader(test_ds, global_batch_size=BATCH_SIZE, shuffle=False, drop_last=False)
    ckpt = jddp.Checkpointer(args.checkpoint, save_every=EVAL_EVERY) if args.checkpoint else None
    means = jddp.RunningMeans()  # the tutorial's nnx.MultiMetric: means over the steps since the last report
    if ckpt is not None:
        state, train_loader = ckpt.restore_or_init(state, train_loader, extra=means)

    step = int(state.step)
    stop = min(args.stop_at or args.steps, args.steps)
    history = []
    while step < stop:
        for batch in train_loader:  # one epoch; the loader resumes mid-epoch after a restore
            state, metrics = dp.step(state, batch)
            means.add(metrics)
            step += 1
            if step % EVAL_EVERY == 0 or step == args.steps:
                train = means.compute()
                means.reset()
                test = dp.evaluate(state, test_loader)  # exact over all 360 test images
                history.append({"step": step, "train": train, "test": test})
                if jddp.is_main_process():
                    print(f"[train] step: {step}, loss: {train['loss']:.4f}, accuracy: {train['accuracy'] * 100:.2f}")
                    print(f"[test] step: {step}, loss: {test['loss']:.4f}, accuracy: {test['accuracy'] * 100:.2f}")
            if ckpt is not None:
                ckpt.maybe_save(state, train_loader, extra=means)
            if step == stop:
                break
    if ckpt is not None:
        ckpt.save(state, train_loader, extra=means)
        ckpt.close()

    # The tutorial's pred_step, on the host: the trained NNX module back from the TrainState, in eval mode.
    model = models.nnx_module(graphdef, state)
    predicted = np.asarray(model(test_ds["image"][:25])).argmax(axis=1)
    final = history[-1]["test"] if history else {}
    result = {"steps": step, **{f"test_{k}": v for k, v in final.items()}}
    if history:
        result["train_loss"] = history[-1]["train"]["loss"]  # the mean over the last 200 steps
    result["host_accuracy_25"] = float(np.mean(predicted == test_ds["label"][:25]))
    if jddp.is_main_process():
        print("result: " + " ".join(f"{k}={v:.4g}" for k, v in result.items()))
    return result


if __name__ == "__main__":
    main()
