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
    assert result["test_perplexity"] == pytest.approx(math.exp(result["test_loss"]))
    assert result["test_perplexity"] < 8  # uniform over bytes is 256


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
