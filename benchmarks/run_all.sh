#!/usr/bin/env bash
# Regenerates every figure of BENCHMARKS.md: jddp bench (MLP, CNN), jddp against hand-written JAX and
# PyTorch DDP, all-reduce bandwidth, and jddp's step overhead. Needs the bench extra
# (pip install -e ".[bench]"). Writes tables, JSON and plots to $1 (default runs/benchmarks).
# Usage: benchmarks/run_all.sh [OUTPUT_DIR] [--quick]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/benchmarks}
mkdir -p "$out"
if [[ "${2:-}" == "--quick" ]]; then  # a smoke run of every script, in about 3 minutes
  bench=(--steps 5 --rounds 2 --warmup 1 --repeats 1) peers=(--steps 5 --rounds 2) allreduce=(--rounds 2 --bytes-per-round 8388608)
  overhead=(--rounds 3 --steps 5)
else
  bench=() peers=() allreduce=() overhead=()
fi
python -c "import torch" 2>/dev/null || { echo "PyTorch is missing: pip install -e '.[bench]'" >&2; exit 1; }
{
  date -u
  echo "cores: $(nproc); $(grep -m1 'model name' /proc/cpuinfo); memory: $(free -g | awk '/Mem:/{print $2}') GiB"
  python -c 'import sys, jax, torch; print("python", sys.version.split()[0], "jax", jax.__version__, "torch", torch.__version__)'
  echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$out/machine.txt"
for model in mlp cnn; do
  jddp bench --model "$model" --devices 1,2,4,8 --processes 1,2 --repeats 2 --output "$out/bench_$model" "${bench[@]}" \
    | tee "$out/bench_$model.txt"
done
python -m benchmarks.peers --processes 1,2 --models mlp,cnn --json "$out/peers.json" "${peers[@]}" | tee "$out/peers.txt"
python -m benchmarks.allreduce --json "$out/allreduce.json" "${allreduce[@]}" | tee "$out/allreduce.txt"
python -m benchmarks.step_overhead --devices 8 "${overhead[@]}" | tee "$out/step_overhead.txt"
python -m benchmarks.first_step $([[ "${2:-}" == "--quick" ]] && echo --repeats 1) | tee "$out/first_step.txt"
if python -c "import mpi4jax" 2>/dev/null; then  # the jddp[mpi] extra: the MPI transport's columns
  python -m benchmarks.peers --processes 2 --models mlp,mlp784 --transport mpi --json "$out/peers_mpi.json" \
    "${peers[@]}" | tee "$out/peers_mpi.txt"
  python -m benchmarks.allreduce --transport mpi --malloc tuned --json "$out/allreduce_mpi.json" "${allreduce[@]}" \
    | tee "$out/allreduce_mpi.txt"
else
  echo "mpi4jax is missing: the MPI transport's benchmarks are skipped (docs/guides/launch.md, MPI transport)"
fi
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/machine.txt"
