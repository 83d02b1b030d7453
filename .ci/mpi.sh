#!/usr/bin/env bash
# MPI checks for mad-mpi: install MPICH and Open MPI (Debian 12, idempotent), then build and run
# the MPI job test (own checks + the core conformance kit over an MPI channel + `tune=auto`:
# measured at open, the same table on every rank, cached for the next open) under both MPIs
# with 2 and 4 ranks, the embedded test (a program that owns MPI runs a session over its own
# communicator, and keeps its error handlers), the kit through the datatype, blocking-progress and serialised paths, the
# thread levels below MULTIPLE, a mixed job (TCP + shm + MPI channels over the MPI bootstrap),
# mad-bench's raw MPI baselines and the MPI driver without the engine (quick),
# the wrong-launcher checks, and a build without the `mpi` feature under MPICH's mpiexec (runs
# over the PMI bootstrap), Open MPI's mpirun (must refuse) and in a Slurm batch script (must
# start its own ranks). Every run's output is checked for the number of kit cases that
# passed. Each MPI has its own target directory because the `mpi` crate's build script does not
# rebuild when MPICC changes.
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

# The kit's cases an MPI job runs: every case of mad-core's conformance table but `peer_closes`
# (MPI does not report a dead peer). Counted from the table so a new case needs no edit here.
KIT_CASES=$(sed -n '/^const CASES/,/^];/p' mad-core/src/conformance.rs | grep -c '^ *("')
KIT_CASES=$((KIT_CASES - 1))
[ "$KIT_CASES" -ge 1 ] || { echo "FAILED: cannot count the kit's cases in mad-core/src/conformance.rs" >&2; exit 1; }
unset MAD_KIT_CASES   # every case, whatever the caller's environment says

OUT=""
run() { # $1 = label, rest = command; the output is echoed and kept in $OUT
    local label=$1; shift
    echo "== $label"
    if ! OUT=$(timeout 300 "$@" 2>&1 | tr -d '\000'); then
        echo "$OUT"
        echo "FAILED: $label" >&2
        exit 1
    fi
    echo "$OUT"
}

need() { # $1 = label, $2 = a line the last run must have printed (fixed string)
    if ! grep -qF -- "$2" <<<"$OUT"; then
        echo "FAILED: $1: expected the line: $2" >&2
        exit 1
    fi
}

# An MPI job test run: all checks and the whole kit over `$spec` passed.
run_job() { # $1 = label, $2 = kit spec, rest = command
    local label=$1 spec=$2; shift 2
    run "$label" env MAD_MPI_KIT_SPEC="$spec" "$@"
    need "$label" "mpi_job: conformance kit over \`$spec\`: $KIT_CASES cases passed"
    need "$label" "mpi_job: tune=auto measured, agreed and cached on"
    need "$label" "mpi_job: all checks passed on"
}

MPICH_BIN=$(build mpich)
OMPI_BIN=$(build openmpi)

for n in 2 4; do
    run_job "MPICH, $n ranks" mpi "${MPICH_RUN[@]}" -n "$n" "$MPICH_BIN"
    run_job "Open MPI, $n ranks" mpi "${OMPI_RUN[@]}" -n "$n" "$OMPI_BIN"
done

# The kit again through the other paths: every gather group as one hindexed-datatype message,
# and blocking progress (every wait goes through the driver's poll-then-sleep `wait`).
for spec in "mpi,gather=datatype" "mpi,progress=block"; do
    run_job "MPICH, 2 ranks, $spec" "$spec" "${MPICH_RUN[@]}" -n 2 "$MPICH_BIN"
    run_job "Open MPI, 4 ranks, $spec" "$spec" "${OMPI_RUN[@]}" -n 4 "$OMPI_BIN"
done
# An MPI that grants MPI_THREAD_SERIALIZED (asked for with MAD_MPI_THREAD_LEVEL): every MPI call
# behind one lock; and the same lock forced under THREAD_MULTIPLE.
run_job "MPICH, 2 ranks, THREAD_SERIALIZED" mpi env MAD_MPI_THREAD_LEVEL=serialized "${MPICH_RUN[@]}" -n 2 "$MPICH_BIN"
need "MPICH, THREAD_SERIALIZED" "thread level: MPI_THREAD_SERIALIZED granted"
run_job "Open MPI, 4 ranks, THREAD_SERIALIZED" mpi env MAD_MPI_THREAD_LEVEL=serialized "${OMPI_RUN[@]}" -n 4 "$OMPI_BIN"
need "Open MPI, THREAD_SERIALIZED" "thread level: MPI_THREAD_SERIALIZED granted"
run_job "MPICH, 2 ranks, serialised" mpi env MAD_MPI_SERIALISE=1 "${MPICH_RUN[@]}" -n 2 "$MPICH_BIN"
run_job "Open MPI, 2 ranks, serialised" mpi env MAD_MPI_SERIALISE=1 "${OMPI_RUN[@]}" -n 2 "$OMPI_BIN"
# Less than SERIALIZED: only MPI's main thread may call MPI, which no lock ensures: MPI channels
# are refused on every rank, the bootstrap works from the main thread only.
for lvl in funneled single; do
    run "MPICH, 2 ranks, THREAD_${lvl^^}" env MAD_MPI_THREAD_LEVEL=$lvl "${MPICH_RUN[@]}" -n 2 "$MPICH_BIN"
    need "MPICH, THREAD_${lvl^^}" "mpi_job: MPI channel refused as expected on every rank: MPI granted MPI_THREAD_${lvl^^}"
done
run "Open MPI, 4 ranks, THREAD_FUNNELED" env MAD_MPI_THREAD_LEVEL=funneled "${OMPI_RUN[@]}" -n 4 "$OMPI_BIN"
need "Open MPI, THREAD_FUNNELED" "mpi_job: MPI channel refused as expected on every rank: MPI granted MPI_THREAD_FUNNELED"

# An application that owns MPI (MPI_Init_thread, MPI_Finalize, its own split communicator)
# embeds a session over that communicator: MPI_COMM_WORLD keeps MPI_ERRORS_ARE_FATAL.
for mpi in mpich openmpi; do
    EMB_BIN=$(ls -t "${CI_PREFIX}$mpi"/debug/deps/mpi_embedded-* | grep -v '\.d$' | head -1)
    for n in 2 4; do
        if [ $mpi = mpich ]; then launch=("${MPICH_RUN[@]}" -n $n); else launch=("${OMPI_RUN[@]}" -n $n); fi
        run "$mpi, $n ranks, embedded in an MPI application" "${launch[@]}" "$EMB_BIN"
        need "$mpi embedded, $n ranks" "mpi_embedded: all checks passed on $n ranks"
    done
done

# One MPI job, three drivers: TCP, shm and MPI channels over the MPI bootstrap (the kit each).
for mpi in mpich openmpi; do
    if [ $mpi = mpich ]; then launch=("${MPICH_RUN[@]}" -n 2); else launch=("${OMPI_RUN[@]}" -n 4); fi
    run "$mpi, ${launch[-1]} ranks, mixed tcp+shm+mpi" "${launch[@]}" "${CI_PREFIX}$mpi/debug/examples/mixed_job"
    for ch in tcp shm mpi; do
        need "$mpi mixed job" "mixed_job: \`$ch\` over the MPI bootstrap: $KIT_CASES cases passed"
    done
done
# Not under a launcher, the mixed job must fail, not pass vacuously.
echo "== mixed job without a launcher must fail"
if out=$("${CI_PREFIX}mpich/debug/examples/mixed_job" 2>&1); then
    echo "$out" >&2; echo "FAILED: mixed_job exited 0 without an MPI launcher" >&2; exit 1
fi
echo "$out" | grep -q "no MPI launcher detected" || { echo "$out" >&2; echo "FAILED: mixed_job's message without a launcher" >&2; exit 1; }

# The examples' command line (mad_core::cli, read before MPI starts): --help and --version exit 0,
# an unknown option exits 2 (tests/cli.rs checks every other example).
echo "== mad-mpi examples: --help, --version, an unknown option"
for e in mixed_job mpi_calls; do
    exe="${CI_PREFIX}mpich/debug/examples/$e"
    out=$("$exe" --help) && grep -q -- "--version" <<<"$out" || { echo "FAILED: $e --help" >&2; exit 1; }
    out=$("$exe" --version) && [[ "$out" == "$e "[0-9]* ]] || { echo "FAILED: $e --version: $out" >&2; exit 1; }
    rc=0; "$exe" --no-such-option 2>/dev/null || rc=$?
    [ "$rc" = 2 ] || { echo "FAILED: $e --no-such-option exited $rc, not 2" >&2; exit 1; }
done

# mad-bench's MPI side (--features bench-mpi): the raw MPI baselines, the MPI driver without the
# engine (--drivers) and the processor-time benchmarks, quick, under each MPI.
for mpi in mpich openmpi; do
    CARGO_TARGET_DIR="${CI_PREFIX}$mpi" MPICC="mpicc.$mpi" \
        cargo build -p mad-bench --no-default-features --features shm,bench-mpi >&2
    if [ $mpi = mpich ]; then launch=("${MPICH_RUN[@]}" -n 2); else launch=("${OMPI_RUN[@]}" -n 2); fi
    run "$mpi, 2 ranks, mad-bench quick over mpi" "${launch[@]}" "${CI_PREFIX}$mpi/debug/mad-bench" \
        --quick --div 1000 --no-pin --channels mpi --modes cheaper --max 4k \
        --bench latency,rpc,cpu_send,cpu_recv,poll --baselines raw-mpi,raw-mpi-test,raw-mpi-packed --drivers mpi
    for t in "latency: raw-mpi-test [-]" "latency: driver:mpi [-]" "rpc: raw-mpi-packed [-]" "cpu_recv: mpi [cheaper/cheaper]" "poll: raw-mpi [-]"; do
        need "$mpi mad-bench" "# $t"
    done
done

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
# A build of the root package WITHOUT the `mpi` feature: under MPICH's mpiexec (a PMI-1 process
# manager) it runs over the PMI bootstrap; under Open MPI's mpirun (PMIx only) it must refuse to
# run (BadConfig naming the launcher and the feature), not run N one-process sessions; the same
# build run bare inside a Slurm batch script (SLURM_PROCID, no job step) starts its own ranks.
NOMPI_TARGET="${CI_PREFIX}nompi"
CARGO_TARGET_DIR="$NOMPI_TARGET" cargo build --no-default-features --features tcp,shm --example hello >&2
HELLO="$NOMPI_TARGET/debug/examples/hello"
run "build without the mpi feature under mpiexec.mpich -n 3 (PMI bootstrap)" "${MPICH_RUN[@]}" -n 3 "$HELLO"
need "hello under mpiexec.mpich" "rank 2: received 2000 bytes from rank 0, intact"
echo "== build without the mpi feature under mpirun.openmpi -n 2 must fail"
if out=$(timeout 120 "${OMPI_RUN[@]}" -n 2 "$HELLO" 2>&1 | tr -d '\000'); then
    echo "$out" >&2; echo "FAILED: a build without the mpi feature ran under mpirun.openmpi" >&2; exit 1
fi
echo "$out" | grep -q "as rank [01] of 2, but the session has no bootstrap for it.*--features mpi" \
    || { echo "$out" >&2; echo "FAILED: the no-mpi-feature message under mpirun.openmpi" >&2; exit 1; }
run "build without the mpi feature, bare in a Slurm batch script" env SLURM_PROCID=0 SLURM_NTASKS=4 "$HELLO"
need "hello under a bare SLURM_PROCID" "rank 1: received 1000 bytes from rank 0, intact"

echo "mpi.sh: all MPI checks passed"
