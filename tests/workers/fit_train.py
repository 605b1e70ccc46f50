"""Worker: trains a small MLP with jddp.fit, checkpointing and logging; optionally killed or preempted.

    python tests/workers/fit_train.py OUT STEPS

OUT gets the checkpoints (OUT/ckpt), the logs (OUT/log, or OUT/log<process>
with PER_PROCESS_LOG=1), each process's history (OUT/history<process>.json) and
process 0's final parameters (OUT/final.npz). KILL_AT=k: after step k's
``maybe_save`` (and the saves in flight are published), SIGKILL this process; KILL_AT=k0,k1,...: at k0 in the
first attempt, k1 in the second (JDDP_RESTART_COUNT), the last one for the attempts after. Each process appends
"<attempt> <step>" to OUT/steps<process>.txt for every step it takes (at its ``maybe_save``).
TRAIN_BATCH=n, EVAL_BATCH=n: the global batches (24, 16); PER_DEVICE_LIMIT=L: the loaders'
max_per_device_batch_size (padded and accumulated to fit any device count). STEP_SLEEP=s: every step takes s
seconds more; STEP_SLEEP=s0,s1,...: s0 in the first attempt (an elastic run's round), s1 in the second, the last one
for the attempts after.
TERM_AT=k: SIGTERM this process just before step k's ``maybe_save`` (a
preemption: the save is at step k, then exit 75).
"""

import dataclasses
import json
import os
import signal
import sys
import time

import jddp

jddp.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jddp.loop import fit  # noqa: E402

out, steps = sys.argv[1], int(sys.argv[2])
rank = jax.process_index()
attempt = int(os.environ.get("JDDP_RESTART_COUNT", "0"))
kills = [int(k) for k in os.environ.get("KILL_AT", "-1").split(",")]  # one per attempt; the last for the rest
kill_at, term_at = kills[min(attempt, len(kills) - 1)], int(os.environ.get("TERM_AT", "-1"))
eval_batch = int(os.environ.get("EVAL_BATCH", "16"))
train_batch = int(os.environ.get("TRAIN_BATCH", "24"))
sleeps = [float(s) for s in os.environ.get("STEP_SLEEP", "0").split(",")]  # one per attempt; the last for the rest
step_sleep = sleeps[min(attempt, len(sleeps) - 1)]  # seconds added to every step (a run long enough to act on)
steps_taken = open(os.path.join(out, f"steps{rank}.txt"), "a")  # every step this process took, by attempt


@dataclasses.dataclass(frozen=True)
class Config:
    learning_rate: float = 1e-2
    hidden: int = 32


class Interrupted(jddp.Checkpointer):
    """A Checkpointer whose process dies at a chosen step (the test's stand-in for a crash or a scheduler)."""

    def maybe_save(self, state, loader=None, *, extra=None):
        step = int(jax.device_get(state.step))
        time.sleep(step_sleep)
        steps_taken.write(f"{attempt} {step}\n")
        steps_taken.flush()
        if step == term_at:
            os.kill(os.getpid(), signal.SIGTERM)
        saved = super().maybe_save(state, loader, extra=extra)
        if step == kill_at:
            self.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return saved


rng = np.random.default_rng(0)
x = rng.normal(size=(300, 16)).astype(np.float32)
y = (x[:, :4].argmax(1) + (x[:, 4] > 1)).astype(np.int32) % 4


def loss_fn(params, model_state, batch, key):
    logits = jnp.tanh(batch["x"] @ params["w1"] + params["b1"]) @ params["w2"]
    mask = batch.get("mask")
    loss = jddp.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), mask)
    accuracy = jddp.masked_mean((logits.argmax(-1) == batch["y"]).astype(jnp.float32), mask)
    return loss, (model_state, {"accuracy": accuracy})


config = Config()
init = np.random.default_rng(1)
params = {
    "w1": init.normal(size=(16, config.hidden)).astype(np.float32) * 0.3,
    "b1": np.zeros(config.hidden, np.float32),
    "w2": init.normal(size=(config.hidden, 4)).astype(np.float32) * 0.3,
}
limit = int(os.environ.get("PER_DEVICE_LIMIT", "0")) or None  # the same batches on any device count (padded)
train = jddp.data.DataLoader(
    {"x": x[:240], "y": y[:240]}, global_batch_size=train_batch, seed=3, max_per_device_batch_size=limit
)
test = jddp.data.DataLoader(
    {"x": x[240:], "y": y[240:]}, global_batch_size=eval_batch, shuffle=False, drop_last=False,
    max_per_device_batch_size=limit,
)  # fmt: skip
dp = jddp.DataParallel(
    loss_fn, optax.adamw(config.learning_rate), mesh=jddp.data_mesh(), accumulate_steps=train.accumulate_steps
)
state = dp.init(params, rng=3)
log_dir = os.path.join(out, f"log{rank}" if os.environ.get("PER_PROCESS_LOG") else "log")
ckpt = Interrupted(os.path.join(out, "ckpt"), save_every=4, max_to_keep=2)
result = fit(
    dp,
    state,
    train,
    steps=steps,
    eval_loader=test,
    eval_every=5,
    checkpointer=ckpt,
    log_dir=log_dir,
    log_every=2,
    config=config,
    progress=True,  # fit shows the bar on process 0 only
)
with open(os.path.join(out, f"history{rank}.json"), "w") as f:
    json.dump({"history": result.history, "final_eval": result.final_eval, "summary": result.summary}, f)
if rank == 0:
    np.savez(os.path.join(out, "final.npz"), **{k: np.asarray(v) for k, v in result.state.params.items()})
