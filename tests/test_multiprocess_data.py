"""Two real processes on 127.0.0.1: each reads only its slice of every global batch."""

import json
from pathlib import Path

import pytest

from tests import multiprocess

pytestmark = pytest.mark.multiprocess


def test_two_processes_read_disjoint_slices_and_assemble_the_same_batches():
    script = str(Path(__file__).parent / "workers" / "loader_slices.py")
    outputs = multiprocess.run(script, nprocs=2, devices_per_process=2)
    results = [json.loads(line[7:]) for out in outputs for line in out.splitlines() if line.startswith("RESULT ")]
    assert sorted(r["process"] for r in results) == [0, 1]
    reads = [r["reads"] for r in sorted(results, key=lambda r: r["process"])]
    assert all(r["batches"] == 5 for r in results)  # ceil(70 / 16)
    assert all(r["direct"] for r in results)  # each process put its rows through the direct transfer
    # 5 batches x 8 rows per process. The last global batch has 6 real rows, all
    # in process 0's slice; its padding (2 rows there, 8 on process 1) re-reads valid rows.
    assert len(reads[0]) == len(reads[1]) == 40
    real0, real1 = reads[0][:38], reads[1][:32]
    assert len(set(real0)) == 38 and len(set(real1)) == 32
    assert not set(real0) & set(real1)
    assert set(real0) | set(real1) == set(range(70))


@pytest.mark.parametrize(
    ("what", "names"),
    [
        ("seed", "seed: 0 on process 0, 1 on process 1"),
        ("batch", "global_batch_size: 16 on process 0, 32 on process 1"),
        ("size", "dataset size: 64 on process 0, 72 on process 1"),
        ("position", "position: 0 on process 0, 2 on process 1"),
    ],
)
def test_processes_whose_loaders_differ_are_refused_at_the_first_batch(what, names):
    """``DataLoader(seed=jax.process_index())`` would duplicate and drop examples without an error."""
    script = str(Path(__file__).parent / "workers" / "loader_disagree.py")
    outputs = multiprocess.run(script, 2, 1, what)
    lines = [line for out in outputs for line in out.splitlines() if line.startswith("RESULT ")]
    expected = f"RESULT refused The DataLoaders of this run's processes differ in {names}"
    assert lines == [expected, expected], outputs


def test_a_skip_on_some_processes_only_is_refused_naming_them():
    """``loader.skip`` is agreed across processes: different counts are refused on both, a skip that one process
    does not make times out on the other naming it; nothing is skipped either way."""
    script = str(Path(__file__).parent / "workers" / "loader_disagree.py")
    outputs = multiprocess.run(script, 2, 1, "skip")
    lines = [line for out in outputs for line in out.splitlines() if line.startswith("RESULT ")]
    expected = (
        "RESULT refused DataLoader.skip: the processes differ "
        "(process 0: position 1, skip 1, process 1: position 1, skip 2)"
    )
    assert lines == [expected, expected], outputs
    outputs = multiprocess.run(script, 2, 1, "skip_one")
    results = [[line for line in out.splitlines() if line.startswith("RESULT ")] for out in outputs]
    assert results[0] == ["RESULT accepted"], outputs
    assert len(results[1]) == 1 and "did not call" in results[1][0] and "[0]" in results[1][0], outputs
