#!/usr/bin/env bash
# The MPI channel against raw MPI under MPICH and Open MPI (2 ranks bound to cores): mad-bench,
# built with --features bench-mpi against each MPI, run with the arguments given (default: the
# mpi channel, its driver without the engine and the raw MPI baselines, latency, RPC and the
# processor time per message, up to 4 MiB). `calls [BYTES|eager]` runs the mpi_calls example
# instead: the raw MPI receive patterns.
# Usage: mad-mpi/bench.sh [MAD-BENCH OPTIONS...]   or   mad-mpi/bench.sh calls [BYTES|eager]
# (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = calls ]; then
    shift
    build=(-p mad-mpi --example mpi_calls)
    exe=examples/mpi_calls
    args=("${1:-16}")
else
    build=(-p mad-bench --no-default-features --features shm,bench-mpi)
    exe=mad-bench
    args=("$@")
    if [ $# = 0 ]; then
        args=(--channels mpi --modes cheaper --bench latency,rpc,cpu_send,cpu_recv --max 4m
              --baselines raw-mpi,raw-mpi-test,raw-mpi-packed --drivers mpi)
    fi
fi
for m in mpich openmpi; do
    CARGO_TARGET_DIR="$PWD/target-$m" MPICC="mpicc.$m" cargo build -q --release "${build[@]}"
done
echo "== MPICH ($(uptime | sed 's/.*load/load/'))"
mpiexec.mpich -bind-to core -n 2 "target-mpich/release/$exe" "${args[@]}"
echo "== Open MPI ($(uptime | sed 's/.*load/load/'))"
# -x passes the programs' environment variables (mpiexec.mpich passes them all).
xs=()
for v in $(env | grep -o '^MPI_CALLS_[A-Z_]*\|^MAD_[A-Z_]*'); do xs+=(-x "$v"); done
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    mpirun.openmpi --allow-run-as-root --bind-to core "${xs[@]}" -n 2 "target-openmpi/release/$exe" "${args[@]}" | tr -d '\000'
