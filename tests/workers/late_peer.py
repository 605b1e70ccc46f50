"""Worker: process 1 reaches its first collective ``LATE_S`` seconds after process 0 (``tests/test_first_run.py``).

    python tests/workers/late_peer.py LATE_S [STEPS] [PATH]

Process 1 sleeps ``LATE_S`` seconds before ``DataParallel.init`` (its first collective), as a process still importing
or loading data on a loaded machine would; then both train a linear model ``STEPS`` steps (default 3) and print
``TRAINED <steps> <loss>``. ``PATH``: ``dp`` (default, ``DataParallel``), ``own`` (a script's own step through
``jddp.data_parallel``: its first call is then the group's first collective, no ``init`` before it) or ``step``
(``DataParallel``, process 1 late after ``init``, to its first step: the step program's first run) or ``jit`` (a
``jax.jit`` of the script's own as the first collective, met as the launch guide says: compiled, ``jddp.barrier``,
run; prints its result in place of a loss).
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jddp

jddp.initialize()
late_s = float(sys.argv[1])
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
path = sys.argv[3] if len(sys.argv) > 3 else "dp"
me = jddp.process_index()
mesh = jddp.data_mesh()


def late() -> None:
    if me == 1:
        print(f"process 1 sleeps {late_s:g} s before its first collective", flush=True)
        time.sleep(late_s)


if path != "step":
    late()
rows = 4 * mesh.size
rng = np.random.default_rng(0)
x = rng.normal(size=(rows, 3)).astype(np.float32)
y = x @ np.asarray([1.0, -2.0, 0.5], np.float32)
sharding = NamedSharding(mesh, P("data"))
share = rows // jax.process_count()  # this process's rows of the global batch
batch = {
    name: jax.make_array_from_process_local_data(sharding, v[me * share : (me + 1) * share], v.shape)
    for name, v in (("x", x), ("y", y))
}
params = {"w": np.zeros((3,), np.float32)}


def loss_fn(params, model_state, batch, rng):
    err = batch["x"] @ params["w"] - batch["y"]
    return jddp.masked_mean(err**2, batch.get("mask")), (model_state, {})


loss = float("nan")
if path in ("dp", "step"):
    dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh)
    state = dp.init(params, rng=0)
    if path == "step":
        late()
    for _ in range(steps):
        state, metrics = dp.step(state, batch)
        loss = float(metrics["loss"])
elif path == "jit":  # the launch guide's pattern for a script's own collective as its first: compile, meet, run
    total = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "data"), mesh=mesh, in_specs=P("data"), out_specs=P()))
    column = batch["x"][:, 0]
    total.lower(column).compile()
    jddp.barrier("first-run", timeout_s=120)
    loss = float(jnp.sum(total(column)))
else:
    optimizer = optax.chain(jddp.average_gradients(), optax.sgd(0.1))

    def own_step(params, opt_state, batch):
        def local(p):
            err = batch["x"] @ p["w"] - batch["y"]
            return jnp.mean(err**2)

        loss, grads = jax.value_and_grad(local)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jddp.global_mean(loss)

    step = jddp.data_parallel(own_step, batch_argnums=2)
    opt_state = optimizer.init(params)
    for _ in range(steps):
        params, opt_state, mean = step(params, opt_state, batch)
        loss = float(mean)
print(f"TRAINED {steps} {loss:.6f}", flush=True)
