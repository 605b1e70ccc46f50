"""jddp.checkpoint.digest, for mutation testing: a sharded leaf is digested whole, and the config fingerprint reads
OmegaConf interpolations resolved and mappings inside dataclasses."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from omegaconf import OmegaConf

import jddp
from jddp import config as config_lib
from jddp.checkpoint import digest
from tests.test_digest import reference_digest, sha


def test_a_sharded_leaf_is_digested_as_its_whole_value():
    """A leaf split over the devices has the digest of all its rows, not of the rows of its first device."""
    value = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    sharded = jax.device_put(value, jddp.runtime.batch_sharding(jddp.data_mesh()))
    assert not sharded.is_fully_replicated  # the test needs a leaf that is split
    assert digest.state_digests([sharded]) == [reference_digest(value)]


def test_an_omegaconf_config_is_fingerprinted_with_its_interpolations_resolved():
    """`${...}` is replaced by the value it points to: the same content written out gives the same fingerprint."""
    config = OmegaConf.create({"width": 4, "model": {"hidden": "${width}"}})
    fingerprint, plain = digest.config_fingerprint(config)
    assert plain == {"width": 4, "model": {"hidden": 4}}
    assert fingerprint == sha(plain) == digest.config_fingerprint({"width": 4, "model": {"hidden": 4}})[0]


@dataclasses.dataclass(frozen=True)
class Head:
    size: int = 2
    log_dir: str = config_lib.run_field("runs/h")


@dataclasses.dataclass(frozen=True)
class WithMappings:
    counts: dict = dataclasses.field(default_factory=lambda: {"a": 1, "b": 2})
    heads: dict = dataclasses.field(default_factory=lambda: {"x": Head(), "y": Head(size=3)})


def test_mappings_inside_a_dataclass_keep_their_values_without_run_fields():
    fingerprint, plain = digest.config_fingerprint(WithMappings())
    assert plain == {"counts": {"a": 1, "b": 2}, "heads": {"x": {"size": 2}, "y": {"size": 3}}}
    assert fingerprint == sha(plain)
    assert digest.config_fingerprint(WithMappings(counts={"a": 1, "b": 3}))[0] != fingerprint
