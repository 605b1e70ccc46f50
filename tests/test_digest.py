"""jddp.checkpoint.digest: leaf digests against a NumPy reference, and the config fingerprint's properties."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jddp import config as config_lib
from jddp.checkpoint import digest

MASK = (1 << 32) - 1


def reference_digest(x: np.ndarray) -> str:
    """The documented digest, computed in NumPy: two weighted sums of the leaf's words, mod 2^32."""
    if x.dtype.itemsize == 2:
        words = x.view(np.uint16).astype(np.uint64)
    elif x.dtype.itemsize == 1:
        words = x.view(np.uint8).astype(np.uint64)
    else:
        words = x.view(np.uint32).astype(np.uint64)
    words = words.reshape(-1)
    size = words.size
    rows = np.pad(words, (0, -size % 1024)).reshape(-1, 1024)
    columns = ((np.arange(1024, dtype=np.uint64) * 0x9E3779B1) & MASK) | 1
    row_weights = ((np.arange(rows.shape[0], dtype=np.uint64) * 0x85EBCA77) & MASK) | 1
    row_sums = (rows * columns[None, :]).sum(axis=1) & MASK  # uint64 wraps mod 2^64: mod 2^32 is kept
    first = (int(row_sums.sum()) & MASK) ^ size
    second = int((row_sums * row_weights).sum()) & MASK
    return f"{first:08x}{second:08x}"


CASES = {
    "float32 of 3 rows": np.random.default_rng(0).normal(size=(2500,)).astype(np.float32),
    "float32 matrix": np.random.default_rng(1).normal(size=(7, 13)).astype(np.float32),
    "int32": np.arange(-500, 1700, dtype=np.int32),
    "uint32 scalar": np.asarray(4_000_000_000, np.uint32),
    "bfloat16": np.random.default_rng(2).normal(size=(1500,)).astype(jnp.bfloat16),
    "float16": np.random.default_rng(3).normal(size=(33,)).astype(np.float16),
    "int8": np.arange(-128, 128, dtype=np.int8),
    "bool": np.random.default_rng(4).random(2049) > 0.5,
    "empty": np.zeros((0, 4), np.float32),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_leaf_digest_equals_the_numpy_reference(name):
    x = CASES[name]
    assert digest.state_digests({"x": jnp.asarray(x)}) == [reference_digest(x)]


@pytest.mark.parametrize("name", ["float32 of 3 rows", "int32", "bfloat16"])
def test_leaf_digests_are_the_same_under_x64(name):
    """With jax_enable_x64 (float64 users) the checksum's arithmetic must stay uint32: integers default to 64 bits
    there, so a missing dtype would change every digest, and checkpoints written without x64 would look damaged."""
    x = CASES[name]
    with jax.enable_x64(True):
        assert digest.state_digests({"x": jnp.asarray(x)}) == [reference_digest(x)]


def test_a_typed_key_is_digested_through_its_key_data():
    key = jax.random.key(42)
    data = np.asarray(jax.random.key_data(key))
    assert digest.state_digests([key]) == [reference_digest(data)] == digest.state_digests([jnp.asarray(data)])


@pytest.mark.parametrize("position", [0, 1, 1023, 1024, 2049, 2499])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int8])
def test_a_change_of_one_element_anywhere_changes_the_digest(position, dtype):
    x = np.random.default_rng(5).normal(size=(2500,)).astype(dtype)
    y = x.copy()
    y.view(np.uint8)[position * x.dtype.itemsize] ^= 1  # one bit of one element
    before, after = digest.state_digests([jnp.asarray(x), jnp.asarray(y)])
    assert before != after


def test_the_size_is_part_of_the_digest():
    """Trailing zeros are the padding's own value: without the size, [x] and [x, 0] would agree."""
    x = np.ones(5, np.float32)
    assert len(set(digest.state_digests([jnp.asarray(x), jnp.asarray(np.append(x, 0))]))) == 2


def test_a_replicated_leaf_is_digested_once_as_its_host_value():
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    value = np.arange(4096, dtype=np.float32)
    replicated = jax.device_put(value, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    assert np.asarray(digest.digest_array([replicated])).shape == (1, 2)
    assert digest.state_digests([replicated]) == [reference_digest(value)]


def test_describe_leaves_gives_path_shape_and_dtype():
    tree = {"b": np.zeros((2, 3), np.int8), "a": [np.float32(1)]}
    assert digest.describe_leaves(tree) == [["['a'][0]", [], "float32"], ["['b']", [2, 3], "int8"]]


# ------------------------------------------------------------------ config fingerprint


@dataclasses.dataclass(frozen=True)
class Inner:
    width: int = 4
    log_dir: str = config_lib.run_field("runs/a")


@dataclasses.dataclass(frozen=True)
class Outer:
    lr: float = 0.1
    layers: tuple = (Inner(), Inner(width=8))
    inner: Inner = Inner()
    devices: int = config_lib.run_field(8)


def sha(plain) -> str:
    return hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()[:16]


def test_the_fingerprint_is_a_hash_of_the_sorted_json_without_run_fields_at_any_depth():
    fingerprint, plain = digest.config_fingerprint(Outer())
    expected = {"lr": 0.1, "layers": [{"width": 4}, {"width": 8}], "inner": {"width": 4}}
    assert plain == expected and fingerprint == sha(expected)
    moved = Outer(devices=2, inner=Inner(log_dir="elsewhere"), layers=(Inner(log_dir="x"), Inner(8, "y")))
    assert digest.config_fingerprint(moved)[0] == fingerprint  # where the run happens does not count
    assert digest.config_fingerprint(Outer(inner=Inner(width=5)))[0] != fingerprint
    assert digest.config_fingerprint(Outer(layers=(Inner(), Inner(width=9))))[0] != fingerprint


def test_mappings_and_omegaconf_give_the_fingerprint_of_their_content():
    from omegaconf import OmegaConf

    content = {"b": [1, 2], "a": {"y": 1.5, "x": "s"}}
    fingerprint, plain = digest.config_fingerprint(content)
    assert plain == content and fingerprint == sha(content)
    assert digest.config_fingerprint({"a": {"x": "s", "y": 1.5}, "b": [1, 2]})[0] == fingerprint  # order
    assert digest.config_fingerprint(OmegaConf.create(content)) == (fingerprint, content)
    assert digest.config_fingerprint({**content, "b": [2, 1]})[0] != fingerprint
    assert digest.config_fingerprint(None) == ("", {})


def test_values_json_cannot_hold_are_fingerprinted_as_text():
    fingerprint, plain = digest.config_fingerprint({"path": np.float32(0.5), "dtype": np.dtype("float32")})
    assert plain == {"path": "0.5", "dtype": "float32"} and fingerprint == sha(plain)


def test_a_config_of_another_kind_is_refused_naming_it():
    with pytest.raises(TypeError, match=r"`config` must be a dataclass, an OmegaConf config or a mapping, got list"):
        digest.config_fingerprint([1, 2])
    with pytest.raises(TypeError, match=r"got type"):
        digest.config_fingerprint(Outer)  # the class, not an instance


def test_leaves_that_are_not_live_device_arrays_and_layouts_of_another_length_are_refused_naming_them():
    x = jnp.arange(4.0)
    with pytest.raises(TypeError, match=r"Every leaf of `tree` must be a jax.Array on the devices, but tree\['b'\] is"):
        digest.state_digests({"a": x, "b": np.arange(4.0)})
    gone = jnp.arange(4.0)
    gone.delete()
    with pytest.raises(ValueError, match=r"`tree` was donated .*\(tree\['b'\] is deleted\)"):
        digest.state_digests({"a": x, "b": gone})
    with pytest.raises(ValueError, match=r"`tree` holds no arrays"):
        digest.state_digests(None)
    with pytest.raises(ValueError, match=r"`layouts` must have one entry per leaf of `tree` \(2\), got 1"):
        digest.state_digests({"a": x, "b": x}, [None])
    with pytest.raises(TypeError, match=r"`layouts` must be a list of jddp.runtime.layout.LeafLayout or None"):
        digest.state_digests({"a": x}, "cpu")  # pyright: ignore[reportArgumentType]
