"""Worker: a few training steps and an evaluation; prints how its compilations went, as one JSON line.

    python tests/workers/compile_cache.py

Prints ``CACHE {"requests": r, "hits": h, "first_step_s": s}``: compile requests that went to the persistent
cache, those it answered, and the time to the first step's result.
"""

import json
import time

import jax

import jddp

counts = {"requests": 0, "hits": 0}


def listen(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/compile_requests_use_cache":
        counts["requests"] += 1
    elif event == "/jax/compilation_cache/cache_hits":
        counts["hits"] += 1


jax.monitoring.register_event_listener(listen)
jddp.initialize()

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


def loss_fn(params, model_state, batch, key):
    logits = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"]
    loss = jddp.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), batch.get("mask"))
    return loss, (model_state, {})


rng = np.random.default_rng(0)
x = rng.normal(size=(96, 8)).astype(np.float32)
y = (x[:, 0] > 0).astype(np.int32)
params = {"w1": rng.normal(size=(8, 16)).astype(np.float32), "w2": rng.normal(size=(16, 2)).astype(np.float32)}
start = time.perf_counter()
dp = jddp.DataParallel(loss_fn, optax.adam(1e-2), mesh=jddp.data_mesh())
state = dp.init(params, rng=0)
loader = jddp.data.DataLoader({"x": x, "y": y}, global_batch_size=16, seed=0)
first = None
for i, batch in enumerate(loader):
    state, metrics = dp.step(state, batch)
    if first is None:
        float(metrics["loss"])
        first = time.perf_counter() - start
    if i == 3:
        break
dp.evaluate(state, jddp.data.DataLoader({"x": x, "y": y}, global_batch_size=16, shuffle=False, drop_last=False))
print("CACHE " + json.dumps({**counts, "first_step_s": first}), flush=True)
