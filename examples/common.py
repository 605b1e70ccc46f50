"""Pieces the examples share: classification metrics, the classifiers' training and the `jddp.fit` call.

Imports of JAX happen inside the functions, after ``jddp.initialize`` ran in
the example's ``main``.
"""

from __future__ import annotations

from typing import Any


def classification_metrics(logits, batch) -> tuple[Any, dict]:
    """Cross-entropy and accuracy, exact means over the batch's real examples.

    Args:
      logits: ``[batch, classes]``.
      batch: a dict with integer labels ``y`` and an optional 0/1 ``mask``.

    Returns:
      ``(loss, {"accuracy": accuracy})``, both ``jddp.masked_mean`` scalars.
    """
    import jax.numpy as jnp
    import optax

    import jddp

    mask = batch.get("mask")
    logits = logits.astype(jnp.float32)
    loss = jddp.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), mask)
    accuracy = jddp.masked_mean((jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32), mask)
    return loss, {"accuracy": accuracy}


def classification_eval(model, batch) -> dict:
    """``eval_fn`` body for ``jddp.models.nnx_eval``: loss and accuracy of ``model(batch["x"])``."""
    loss, metrics = classification_metrics(model(batch["x"]), batch)
    return {"loss": loss, **metrics}


def train(dp, state, train_loader, test_loader, config, *, steps: int | None = None) -> dict[str, float]:
    """Runs ``jddp.loop.fit`` with the example's config and returns its final metrics.

    Args:
      dp: the ``DataParallel``.
      state: from ``dp.init``.
      train_loader: global training batches.
      test_loader: ``shuffle=False, drop_last=False``: every test example once.
      config: the example's ``Config``; reads ``epochs`` (or ``steps``), ``eval_every``,
        ``log_dir``, ``log_every``, ``checkpoint_dir``, ``save_every`` and ``progress``.
      steps: train this many steps instead of ``config.epochs`` epochs.

    Returns:
      ``steps``, ``train_loss`` (the loss of the last step's global batch), the test
      metrics prefixed ``test_`` and the loop's timings (``wall_s`` ...).
    """
    import dataclasses

    import jax

    from jddp import checkpoint, loop

    if getattr(config, "devices", None) == 0:  # 0 means all: the config fit prints and saves says how many there are
        config = dataclasses.replace(config, devices=jax.local_device_count())
    checkpointer = None
    if config.checkpoint_dir:
        checkpointer = checkpoint.Checkpointer(
            config.checkpoint_dir, save_every=config.save_every or None, config=config
        )
    length: dict[str, Any] = {"steps": steps} if steps is not None else {"epochs": config.epochs}
    result = loop.fit(
        dp,
        state,
        train_loader,
        **length,
        eval_loader=test_loader,
        eval_every=config.eval_every or None,
        checkpointer=checkpointer,
        log_dir=config.log_dir or None,
        log_every=config.log_every,
        config=config,
        progress=config.progress,
    )
    train_records = [r for r in result.history if r.get("split") == "train"]
    out = {"steps": int(result.summary["final_step"])}  # counted from step 0, also after a resume
    if train_records:
        out["train_loss"] = float(train_records[-1]["loss"])
    out.update({f"test_{k}": float(v) for k, v in result.final_eval.items() if k != "examples"})
    out.update({k: float(v) for k, v in result.summary.items() if k not in ("steps", "final_step")})
    return out


def train_classifier(config, data: dict, model: tuple) -> dict[str, float]:
    """The classifier examples' training: loaders, AdamW with cosine decay, ``DataParallel``, ``fit``.

    Args:
      config: the example's ``Config``: ``global_batch_size``, ``seed``,
        ``learning_rate``, ``weight_decay``, ``epochs``, ``shard_optimizer`` and what ``train`` reads.
      data: ``x``, ``y``, ``x_test``, ``y_test`` arrays.
      model: ``(graphdef, params, model_state)`` of an NNX classifier
        (``jddp.models.nnx_split``).

    Returns:
      ``train``'s final metrics.
    """
    import optax

    import jddp
    from jddp import models

    graphdef, params, model_state = model
    train_loader = jddp.data.DataLoader(
        {"x": data["x"], "y": data["y"]}, global_batch_size=config.global_batch_size, seed=config.seed
    )
    test_loader = jddp.data.DataLoader(
        {"x": data["x_test"], "y": data["y_test"]},
        global_batch_size=config.global_batch_size,
        shuffle=False,
        drop_last=False,  # every test example once; the padding is masked
    )
    schedule = optax.cosine_decay_schedule(config.learning_rate, config.epochs * len(train_loader))
    dp = jddp.DataParallel(
        models.nnx_loss(graphdef, lambda model, batch, rng: classification_metrics(model(batch["x"]), batch)),
        optax.adamw(schedule, weight_decay=config.weight_decay),
        mesh=jddp.data_mesh(),
        eval_fn=models.nnx_eval(graphdef, classification_eval),
        shard_optimizer=config.shard_optimizer,
        compute_dtype=compute_dtype(config),
    )
    state = dp.init(params, model_state, rng=config.seed)
    return train(dp, state, train_loader, test_loader, config)


def compute_dtype(config):
    """``config.compute_dtype`` as ``DataParallel``'s ``compute_dtype``: None for float32 (the params' own)."""
    import jax.numpy as jnp

    names = {"float32": None, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
    if config.compute_dtype not in names:
        raise ValueError(f"`compute_dtype` must be one of {sorted(names)}, got compute_dtype={config.compute_dtype!r}.")
    return names[config.compute_dtype]


def report(result: dict[str, float]) -> None:
    """Prints the final metrics on one line, on process 0 only."""
    import jddp

    if jddp.is_main_process():
        print("result: " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
