#!/usr/bin/env bash
# Build and run the MPI channel benchmark under MPICH and Open MPI (2 ranks, bound to cores).
# Usage: mad-mpi/bench.sh [all|lat|drv|rpc|sweep|cmp|cpu|phases]   (from the repository root;
# the modes are described at the top of mad-mpi/examples/mpi_bench.rs; `calls` runs the
# mpi_calls example instead: the raw MPI receive patterns)
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
for m in mpich openmpi; do
    CARGO_TARGET_DIR="$PWD/target-$m" MPICC="mpicc.$m" cargo build -q --release -p mad-mpi --example mpi_bench --example mpi_calls
done
ex=mpi_bench
args=("$what")
if [ "$what" = calls ]; then ex=mpi_calls; args=(16); fi
echo "== MPICH ($(uptime | sed 's/.*load/load/'))"
mpiexec.mpich -bind-to core -n 2 "target-mpich/release/examples/$ex" "${args[@]}"
echo "== Open MPI ($(uptime | sed 's/.*load/load/'))"
# -x passes the benchmark's environment variables (mpiexec.mpich passes them all).
xs=()
for v in $(env | grep -o '^MPI_BENCH_[A-Z_]*\|^MPI_CALLS_[A-Z_]*\|^MAD_[A-Z_]*'); do xs+=(-x "$v"); done
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    mpirun.openmpi --allow-run-as-root --bind-to core "${xs[@]}" -n 2 "target-openmpi/release/examples/$ex" "${args[@]}" | tr -d '\000'
