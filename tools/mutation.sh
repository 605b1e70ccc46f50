#!/usr/bin/env bash
# Mutation testing of the code where a wrong line gives a wrong answer (mutmut 3.8, configured in
# pyproject.toml [tool.mutmut]).
#
#   tools/mutation.sh                      # the scoped run below, from scratch
#   tools/mutation.sh +step +restore       # ... plus the device step and the checkpoint restore path
#   tools/mutation.sh 'jddp.config.*' ...  # only these mutants (mutmut names, fnmatch globs)
#
# Mutates (mutmut names are module.x_function or module.xǁClassǁmethod, then __mutmut_N):
#   jddp/engine/reduce.py, metrics.py, fused.py    every function
#   jddp/data/sampler.py                           every function
#   jddp/data/loader.py                            order and seeds: _ReadBatch, _FirstPosition, read,
#                                                  DataLoader.__iter__, _next_local, local_batches,
#                                                  set_epoch, set_state
#   jddp/checkpoint/digest.py, jddp/runtime/checksum.py, jddp/config/   every function
#   jddp/cli/reports.py                            every function (the launchers' reports)
# Only with +step: jddp/engine/step.py, varying.split_varying and DataParallel.step (about 400
# mutants whose every survivor runs about 90 s of engine tests: an hour more). Only with +restore:
# Checkpointer.restore_or_init and jddp/checkpoint/restore.py (about 280
# mutants at about 7 s: half an hour more). Other files are never mutated (only_mutate).
#
# Tests: tests/test_{engine,sampler,loader,checkpoint,checkpoint_access,config,errors,digest,
# boundary,reduce,bad_inputs}.py without the `multiprocess` and `slow` marks and without the four
# tests that start processes (see pyproject.toml); each mutant runs only the tests that called its
# function, up to the first failure.
#
# How: mutmut copies jddp/, tests/ and conftest.py into mutants/ and forks each mutant's pytest
# from a fork server that has collected the tests but never started JAX's backend (mutmut's
# default forks from the process that ran the tests and deadlocks in XLA's threads), so no test
# module may touch a JAX array at import time, or every mutant times out; tools/mutmut_plugin.py
# gives those processes Python's signal handlers back (the server's break the SIGTERM tests, and
# make every mutant that reaches them look killed). Compiled XLA programs
# are cached on disk in .mutmut-cache/jax (keyed by the program, so a mutant that changes a
# program compiles it afresh; 2.5x faster tests). mutants/ is deleted first: mutmut would keep
# stale copies of unmutated files from an earlier run. Mutants that end without a verdict
# (timeout, crash) are run once more.
#
# Expected duration: about an hour with 2 workers on 2 cores (MUTMUT_MAX_CHILDREN, default 2),
# more when the machine is shared; see the end of the output for this run's.
#
# Results: a summary at the end, and every survivor with its diff in mutants/survivors.txt (then
# the mutants no test reaches). Then, as usual with mutmut:
#   mutmut results          # survivors, timeouts, ...; "not checked" = outside the run's scope
#   mutmut show NAME        # one mutant's diff
#   mutmut run NAME         # test one mutant again, e.g. after adding a test
#   mutmut browse           # interactive
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
if ! command -v mutmut >/dev/null && [ -f .venv/bin/activate ]; then
  . .venv/bin/activate
fi
command -v mutmut >/dev/null || { echo "mutmut not found: pip install 'mutmut==3.8.1'" >&2; exit 2; }

DEFAULT=(
  'jddp.engine.reduce.*' 'jddp.engine.metrics.*' 'jddp.engine.fused.*'
  'jddp.data.sampler.*'
  'jddp.data.reading.xǁReadBatchǁ*' 'jddp.data.pipeline.xǁ_FirstPositionǁ*' 'jddp.data.reading.x_read__mutmut_*'
  'jddp.data.loader.xǁDataLoaderǁ__iter____mutmut_*' 'jddp.data.pipeline.xǁStreamǁnext__mutmut_*'
  'jddp.data.loader.xǁDataLoaderǁlocal_batches__mutmut_*' 'jddp.data.loader.xǁDataLoaderǁset_epoch__mutmut_*'
  'jddp.data.loader.xǁDataLoaderǁset_state__mutmut_*'
  'jddp.checkpoint.digest.*' 'jddp.runtime.checksum.*' 'jddp.config.*' 'jddp.cli.reports.*'
)
STEP=('jddp.engine.step.*' 'jddp.engine.varying.x_split_varying__mutmut_*'
  'jddp.engine.parallel.xǁDataParallelǁstep__mutmut_*')
RESTORE=("jddp.checkpoint.restoring.xǁRestoringǁrestore_or_init__mutmut_*" "jddp.checkpoint.restore.*")

PATTERNS=()
EXTRA=()
for arg in "$@"; do
  case "$arg" in
    +step) EXTRA+=("${STEP[@]}") ;;
    +restore) EXTRA+=("${RESTORE[@]}") ;;
    *) PATTERNS+=("$arg") ;;
  esac
done
if [ ${#PATTERNS[@]} -eq 0 ]; then PATTERNS=("${DEFAULT[@]}"); fi
PATTERNS+=(${EXTRA[@]+"${EXTRA[@]}"})
CHILDREN=${MUTMUT_MAX_CHILDREN:-2}

rm -rf mutants
mkdir -p .mutmut-cache/jax
export JAX_COMPILATION_CACHE_DIR="$ROOT/.mutmut-cache/jax"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1

start=$(date +%s)
mutmut run --max-children "$CHILDREN" "${PATTERNS[@]}"

# Mutants without a verdict, run once more (on a loaded machine a few come out of a run whose
# tests would have passed or failed).
mapfile -t RETRY < <(python - <<'PY'
from mutmut.mutation.data import SourceFileMutationData
from mutmut.stats import status_by_exit_code
from mutmut.utils.file_utils import walk_mutatable_files

for path in walk_mutatable_files():
    m = SourceFileMutationData(path=path)
    m.load()
    for name, code in m.exit_code_by_key.items():
        if code is not None and status_by_exit_code[code] in ("timeout", "suspicious", "segfault"):
            print(name)
PY
)
if [ ${#RETRY[@]} -gt 0 ]; then
  echo "Running the ${#RETRY[@]} mutants without a verdict once more"
  mutmut run --max-children "$CHILDREN" "${RETRY[@]}"
fi
elapsed=$(($(date +%s) - start))

# Summary and survivors, over the mutants this run tested (the others stay "not checked").
python - "$elapsed" <<'PY'
import collections
import sys

from mutmut.mutation.data import SourceFileMutationData
from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code
from mutmut.utils.file_utils import walk_mutatable_files

by_status = collections.defaultdict(list)
for path in walk_mutatable_files():
    m = SourceFileMutationData(path=path)
    m.load()
    for name, code in m.exit_code_by_key.items():
        if code is not None:
            by_status[status_by_exit_code[code]].append((str(path), name))

with open("mutants/survivors.txt", "w") as out:
    for status in ("survived", "no tests"):
        for path, name in sorted(by_status[status]):
            out.write(f"# {name}: {status} ({path})\n{get_diff_for_mutant(name, path=path)}\n\n")

elapsed = int(sys.argv[1])
tested = sum(len(v) for v in by_status.values())
print(f"\nmutants {tested}: " + ", ".join(f"{k} {len(v)}" for k, v in sorted(by_status.items())))
print(f"wall time {elapsed // 60} min {elapsed % 60} s")
for path, n in sorted(collections.Counter(path for path, _ in by_status["survived"]).items()):
    print(f"  survived in {path}: {n}")
print("every survivor with its diff: mutants/survivors.txt")
PY
