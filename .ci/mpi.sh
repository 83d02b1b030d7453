#!/usr/bin/env bash
# MPI checks for mad-mpi: install MPICH and Open MPI (Debian 12, idempotent), then build and run
# the MPI job test (own checks + the core conformance kit over an MPI channel) under both MPIs
# with 2 and 4 ranks, the kit through the datatype, blocking-progress and serialised paths, a
# mixed job (TCP + shm + MPI channels over the MPI bootstrap), and the wrong-launcher check. Each MPI has its own target directory
# because the `mpi` crate's build script does not rebuild when MPICC changes.
#
# Usage: .ci/mpi.sh            (from the repository root)
#        MPI_CI_SKIP_INSTALL=1 .ci/mpi.sh                 (never call apt-get)
#        MPI_CI_TARGET_PREFIX=/tmp/t- .ci/mpi.sh          (target dirs /tmp/t-mpich, /tmp/t-openmpi)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

need_install=0
for b in mpicc.mpich mpiexec.mpich mpicc.openmpi mpirun.openmpi; do
    command -v "$b" >/dev/null 2>&1 || need_install=1
done
dpkg -s libclang-dev >/dev/null 2>&1 || need_install=1
if [ "$need_install" = 1 ] && [ "${MPI_CI_SKIP_INSTALL:-0}" != 1 ]; then
    export DEBIAN_FRONTEND=noninteractive
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo"
    if ! $SUDO apt-get install -y libmpich-dev mpich libopenmpi-dev openmpi-bin libclang-dev; then
        $SUDO apt-get update
        $SUDO apt-get install -y libmpich-dev mpich libopenmpi-dev openmpi-bin libclang-dev
    fi
fi

# Open MPI as root needs these; --oversubscribe lets 4 ranks run on 2 cores.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OMPI_RUN=(mpirun.openmpi --allow-run-as-root --oversubscribe)
MPICH_RUN=(mpiexec.mpich)

CI_PREFIX="${MPI_CI_TARGET_PREFIX:-$ROOT/target-}"

build() { # $1 = mpich|openmpi
    export CARGO_TARGET_DIR="${CI_PREFIX}$1" MPICC="mpicc.$1"
    cargo build -p mad-mpi --tests --examples >&2
    cargo test -p mad-mpi >&2   # unit tests, doc tests, and the "not under a launcher" path
    # The newest mpi_job test binary of this target directory.
    ls -t "$CARGO_TARGET_DIR"/debug/deps/mpi_job-* | grep -v '\.d$' | head -1
}

run() { # $1 = label, rest = command
    local label=$1; shift
    echo "== $label"
    if ! timeout 300 "$@"; then
        echo "FAILED: $label" >&2
        exit 1
    fi
}

MPICH_BIN=$(build mpich)
OMPI_BIN=$(build openmpi)

for n in 2 4; do
    run "MPICH, $n ranks" "${MPICH_RUN[@]}" -n "$n" "$MPICH_BIN"
    run "Open MPI, $n ranks" "${OMPI_RUN[@]}" -n "$n" "$OMPI_BIN"
done

# The kit again through the other paths: every gather group as one hindexed-datatype message,
# and blocking progress (every wait goes through the driver's poll-then-sleep `wait`).
for spec in "mpi,gather=datatype" "mpi,progress=block"; do
    run "MPICH, 2 ranks, $spec" env MAD_MPI_KIT_SPEC="$spec" "${MPICH_RUN[@]}" -n 2 "$MPICH_BIN"
    run "Open MPI, 4 ranks, $spec" env MAD_MPI_KIT_SPEC="$spec" "${OMPI_RUN[@]}" -n 4 "$OMPI_BIN"
done
# The path of an MPI that grants less than THREAD_MULTIPLE: every MPI call behind one lock.
run "MPICH, 2 ranks, serialised" env MAD_MPI_SERIALISE=1 "${MPICH_RUN[@]}" -n 2 "$MPICH_BIN"
run "Open MPI, 2 ranks, serialised" env MAD_MPI_SERIALISE=1 "${OMPI_RUN[@]}" -n 2 "$OMPI_BIN"

# One MPI job, three drivers: TCP, shm and MPI channels over the MPI bootstrap (the kit each).
run "MPICH, 2 ranks, mixed tcp+shm+mpi" "${MPICH_RUN[@]}" -n 2 "${CI_PREFIX}mpich/debug/examples/mixed_job"
run "Open MPI, 4 ranks, mixed tcp+shm+mpi" "${OMPI_RUN[@]}" -n 4 "${CI_PREFIX}openmpi/debug/examples/mixed_job"

# A binary started by the other MPI's launcher must refuse to run (BadConfig), not run as
# separate one-process jobs.
echo "== wrong launcher (MPICH build under Open MPI's mpirun) must fail"
if out=$(timeout 120 "${OMPI_RUN[@]}" -n 2 "$MPICH_BIN" 2>&1 | tr -d '\000'); then
    echo "FAILED: the MPICH build ran under mpirun.openmpi" >&2
    exit 1
fi
echo "$out" | grep -q "different MPI than the launcher" || { echo "$out" >&2; echo "FAILED: wrong-launcher message" >&2; exit 1; }
echo "== wrong launcher (Open MPI build under MPICH's mpiexec) must fail"
if out=$(timeout 120 "${MPICH_RUN[@]}" -n 2 "$OMPI_BIN" 2>&1 | tr -d '\000'); then
    echo "FAILED: the Open MPI build ran under mpiexec.mpich" >&2
    exit 1
fi
echo "$out" | grep -q "different MPI than the launcher" || { echo "$out" >&2; echo "FAILED: wrong-launcher message" >&2; exit 1; }
echo "mpi.sh: all MPI checks passed"
