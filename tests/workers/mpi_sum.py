"""Worker: ``jddp.engine.mpi.mpi_psum`` of a mixed tree against NumPy, under ``jddp launch --transport mpi``.

Leaves of three dtypes, small (packed) and over the packing threshold (summed where they lie), a scalar and an
empty leaf; each rank holds values of its own. Prints ``SUMS OK`` on every rank when each sum equals NumPy's.
"""

import jddp

jddp.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jddp.engine import mpi  # noqa: E402

rank, n = jax.process_index(), jax.process_count()
big = mpi.PACK_BELOW_BYTES // 4 + 3  # float32 elements: over the threshold


def leaves(r: int) -> dict:
    rng = np.random.default_rng(r)
    return {
        "big": rng.normal(size=(big,)).astype(np.float32),
        "small": rng.normal(size=(7, 5)).astype(np.float32),
        "count": np.array([r + 1, 10 * r], np.int32),
        "scalar": np.array(r + 0.5, np.float32),
        "big_int": rng.integers(-5, 5, size=(2, big)).astype(np.int32),
        "half": rng.normal(size=(3,)).astype(np.float16),
        "bf16": rng.normal(size=(4,)).astype(jnp.bfloat16),
        "empty": np.zeros((0, 4), np.float32),
    }


mesh = jddp.data_mesh()
mine = leaves(rank)
sharding = jddp.batch_sharding(mesh)
tree = {k: jax.make_array_from_process_local_data(sharding, v[None], (n, *v.shape)) for k, v in mine.items()}
summed = jax.jit(
    jax.shard_map(
        lambda t: mpi.mpi_psum(jax.tree.map(lambda x: x[0], t), jddp.DATA_AXIS),
        mesh=mesh,
        in_specs=P(jddp.DATA_AXIS),
        out_specs=P(),
    )
)(tree)
every = [leaves(r) for r in range(n)]
for k in mine:
    expected = np.sum([e[k].astype(np.float32) if k in ("half", "bf16") else e[k] for e in every], axis=0)
    expected = expected.astype(mine[k].dtype)  # bfloat16 and float16 are summed in float32, then cast back
    got = np.asarray(summed[k])
    assert got.dtype == expected.dtype and got.shape == expected.shape, (k, got.dtype, got.shape)
    np.testing.assert_allclose(got, expected, rtol=1e-6 if k not in ("half", "bf16") else 1e-2, err_msg=k)
print(f"SUMS OK {rank}")
