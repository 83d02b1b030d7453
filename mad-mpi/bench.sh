#!/usr/bin/env bash
# The MPI channel against raw MPI under MPICH and Open MPI (2 ranks bound to cores): mad-bench,
# built with --features bench-mpi against each MPI, run with the arguments given (default: the
# mpi channel, its driver without the engine and the raw MPI baselines, latency, RPC and the
# processor time per message, up to 4 MiB). `calls [BYTES|eager]` runs the mpi_calls example
# instead: the raw MPI receive patterns. `count [MAD-BENCH OPTIONS...]` runs mad-bench (default:
# the mpi channel alone, 0-8 B latency) with a PMPI shim preloaded (tools/mpicount.c) that
# prints every rank's MPI calls by kind, and the calls per MPI_Send.
# Usage: mad-mpi/bench.sh [MAD-BENCH OPTIONS...]   or   mad-mpi/bench.sh calls [BYTES|eager]
#        or   mad-mpi/bench.sh count [MAD-BENCH OPTIONS...]
# (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
count=0
if [ "${1:-}" = count ]; then
    count=1
    shift
    [ $# != 0 ] || set -- --channels mpi --modes cheaper --baselines= --bench latency --max 8 --runs 1
fi
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
pre_mpich=() pre_ompi=()
for m in mpich openmpi; do
    CARGO_TARGET_DIR="$PWD/target-$m" MPICC="mpicc.$m" cargo build -q --release "${build[@]}"
    if [ $count = 1 ]; then
        "mpicc.$m" -O2 -shared -fPIC -o "target-$m/libmpicount.so" mad-mpi/tools/mpicount.c
    fi
done
if [ $count = 1 ]; then
    pre_mpich=(-env LD_PRELOAD "$PWD/target-mpich/libmpicount.so")
    pre_ompi=(-x LD_PRELOAD="$PWD/target-openmpi/libmpicount.so")
fi
# With `count`: the shim's lines, then the calls per MPI_Send of each rank.
per_send() {
    if [ $count = 1 ]; then
        tee /dev/stderr | awk '/^mpicount rank/ { printf "%s %s per MPI_Send:", $2, $3;
            for (i = 4; i < NF; i += 2) if ($(i + 1) > 0) printf " %s %.2f", $i, $(i + 1) / $5;
            print "" }'
    else
        cat
    fi
}
echo "== MPICH ($(uptime | sed 's/.*load/load/'))"
mpiexec.mpich -bind-to core -n 2 "${pre_mpich[@]}" "target-mpich/release/$exe" "${args[@]}" 2>&1 | per_send
echo "== Open MPI ($(uptime | sed 's/.*load/load/'))"
# -x passes the programs' environment variables (mpiexec.mpich passes them all).
xs=()
for v in $(env | grep -o '^MPI_CALLS_[A-Z_]*\|^MAD_[A-Z_]*'); do xs+=(-x "$v"); done
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    mpirun.openmpi --allow-run-as-root --bind-to core "${xs[@]}" "${pre_ompi[@]}" -n 2 \
    "target-openmpi/release/$exe" "${args[@]}" 2>&1 | tr -d '\000' | per_send
