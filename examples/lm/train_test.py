"""A short LM run on a small generated corpus: it learns, windows cover each document once, the config is checked."""

import dataclasses
import math
import zlib

import numpy as np
import pytest

from examples.lm import data, train
from jddp import config as config_lib


def _corpus(root, files: int = 12) -> None:
    """Python-like files with a regular structure, and at least one held out (crc32 % 10 == 0)."""
    names = [f"mod{i}.py" for i in range(200)]
    held_out = [n for n in names if zlib.crc32(n.encode()) % 10 == 0][:2]
    kept = [n for n in names if n not in held_out][: files - len(held_out)]
    rng = np.random.default_rng(0)
    for name in held_out + kept:
        lines = [f"def f{k}(x):\n    return x + {k}\n\n" for k in rng.integers(0, 99, 120)]
        (root / name).write_text("".join(lines))


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_trains_on_a_small_corpus(tmp_path):
    _corpus(tmp_path)
    config = config_lib.parse(train.Config, [], path=train.DEFAULT_CONFIG)
    config = dataclasses.replace(
        config, corpus_dir=str(tmp_path), steps=40, warmup_steps=5, seq_len=32, d_model=32, layers=1,
        learning_rate=1e-2, eval_batch_size=64, log_dir=str(tmp_path / "run"), progress=False,
    )  # fmt: skip
    result = train.main(config)
    assert result["steps"] == 40
    assert result["train_loss"] < 0.5 * math.log(256)  # from ln(256) = 5.5 at the start, in float32
    assert result["test_perplexity"] < 8  # uniform over bytes is 256


def test_evaluation_is_the_exact_mean_over_every_test_byte(tmp_path):
    """jddp's evaluation of the LM (8 devices, padded last batch, windows with few real bytes) equals one
    device's mean over every real target byte of the test set, computed in NumPy from the logits."""
    import jax
    import optax

    import jddp
    from jddp import models

    _corpus(tmp_path)
    config = train.Config(seq_len=32, d_model=32, heads=4, layers=1, compute_dtype="float32")
    test = data.load(config.seq_len, root=tmp_path)["test"]
    weights = test["weights"]
    assert len(set(weights.sum(1).tolist())) > 1  # windows differ in their real bytes: a mean of means is wrong
    graphdef, params, model_state = train.make_model(config)
    dp = jddp.DataParallel(
        lambda *a: None, optax.sgd(0.0), mesh=jddp.data_mesh(), eval_fn=models.nnx_eval(graphdef, train.eval_metrics)
    )
    loader = jddp.data.DataLoader(test, global_batch_size=24, shuffle=False, drop_last=False)
    assert len(test["tokens"]) % 24  # the last batch is padded
    got = dp.evaluate(dp.init(params, model_state), loader)

    from flax import nnx

    logits = np.asarray(jax.jit(train.forward)(nnx.merge(graphdef, params, model_state), test), np.float64)
    targets = test["tokens"][:, 1:].astype(np.int64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    nll = -np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    correct = logits.argmax(-1) == targets
    assert got["examples"] == len(test["tokens"])
    assert got["loss"] == pytest.approx(float((nll * weights).sum() / weights.sum()), rel=1e-5)
    assert got["accuracy"] == pytest.approx(float((correct * weights).sum() / weights.sum()), abs=1e-6)


def test_windows_predict_each_byte_once():
    docs = [b"abcdefghij", b"xy", bytes(range(200))]
    w = data.windows(docs, seq_len=4)
    assert w["tokens"].shape[1] == 5 and w["weights"].sum() == sum(len(d) - 1 for d in docs)
    targets = [bytes(t[1:][m > 0]) for t, m in zip(w["tokens"], w["weights"], strict=True)]
    assert b"".join(targets) == b"".join(d[1:] for d in docs)  # in order, none twice, none left out


def test_stdlib_split_is_by_file():
    docs = data.documents(test_modulus=10)
    assert len(docs["test"]) >= 5 and len(docs["train"]) > 5 * len(docs["test"])
    assert not set(docs["train"]) & set(docs["test"])
    with pytest.raises(ValueError, match="test_modulus"):
        data.documents(test_modulus=1)


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_model_computes_in_bfloat16_with_float32_params():
    import jax
    import jax.numpy as jnp

    config = train.Config(seq_len=8, d_model=16, layers=1)
    graphdef, params, _ = train.make_model(config)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}
    from flax import nnx

    model = nnx.merge(graphdef, params, nnx.State({}))
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    dots = [e for e in jax.make_jaxpr(model)(tokens).eqns if e.primitive.name == "dot_general"]
    assert dots and all(e.outvars[0].aval.dtype == jnp.bfloat16 for e in dots)  # every matmul in bf16
    assert jax.eval_shape(model, tokens).dtype == jnp.float32  # logits for a float32 loss


def test_config_is_checked(tmp_path):
    assert config_lib.parse(train.Config, [], path=train.DEFAULT_CONFIG).steps == 300
    with pytest.raises(ValueError, match=r"`compute_dtype` must be 'bfloat16' or 'float32'.*'float16'"):
        config_lib.parse(train.Config, ["compute_dtype=float16"])
    with pytest.raises(ValueError, match=r"`d_model` must be divisible by `heads`.*heads=3"):
        config_lib.parse(train.Config, ["heads=3"])
    with pytest.raises(ValueError, match="`corpus_dir` must be a directory"):
        config_lib.parse(train.Config, [f"corpus_dir={tmp_path / 'missing'}"])
    with pytest.raises(config_lib.ConfigError, match=r"`steps`.*expected int"):
        config_lib.parse(train.Config, ["steps=1.5"])
