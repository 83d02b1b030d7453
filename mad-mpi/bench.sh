#!/usr/bin/env bash
# Build and run the MPI channel benchmark under MPICH and Open MPI (2 ranks, bound to cores).
# Usage: mad-mpi/bench.sh [all|lat|drv|rpc|sweep]   (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
for m in mpich openmpi; do
    CARGO_TARGET_DIR="$PWD/target-$m" MPICC="mpicc.$m" cargo build -q --release -p mad-mpi --example mpi_bench
done
echo "== MPICH ($(uptime | sed 's/.*load/load/'))"
mpiexec.mpich -bind-to core -n 2 target-mpich/release/examples/mpi_bench "$what"
echo "== Open MPI ($(uptime | sed 's/.*load/load/'))"
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    mpirun.openmpi --allow-run-as-root --bind-to core -n 2 target-openmpi/release/examples/mpi_bench "$what"
