#!/usr/bin/env bash
# Jobs under a real Slurm on this host: installs Debian's slurm-wlm and munge (idempotent),
# starts munged, slurmctld and slurmd with a private configuration (one node, this host, its
# own ports and state directory), then runs with `srun`:
#   - without MPI, over the PMI bootstrap (srun --mpi=pmi2): hello on 4 ranks, the conformance
#     kit over tcp and shm on 4 ranks (collectives through rank 0's server, and over PMI), a channel open that fails on one rank (its error reaches
#     the others), and the refusals (srun without an MPI plugin, srun --mpi=pmix);
#   - with MPI: the mad-mpi job test (its checks and the whole kit over an MPI channel) with
#     MPICH under srun --mpi=pmi2 and Open MPI under srun --mpi=pmix, 4 ranks each;
#   - job start under srun -n 4 and madrun -n 4 (main to first message, and the whole job):
#     reported.
# Stops the daemons and removes their state when it ends. Needs root (the daemons).
#
# Usage: .ci/slurm.sh   (after .ci/mpi.sh has built target-mpich and target-openmpi, or it
#                        builds them)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

need_install=0
for b in slurmctld slurmd srun munged; do
    command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || need_install=1
done
if [ "$need_install" = 1 ]; then
    export DEBIAN_FRONTEND=noninteractive
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get install -y -q slurm-wlm munge || { $SUDO apt-get update -q; $SUDO apt-get install -y -q slurm-wlm munge; }
fi
export PATH="$PATH:/usr/sbin"

# munge: the key the package made (or a new one), the daemon if it is not answering.
mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chmod 400 /etc/munge/munge.key
fi
chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    runuser -u munge -- munged
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi
munge -n | unmunge >/dev/null || { echo "FAILED: munged does not answer" >&2; exit 1; }

# A private Slurm: its own configuration, state and ports, one node (this host, 8 CPUs declared
# so that 4-rank jobs fit on a 2-core machine).
D=$(mktemp -d /tmp/mad-slurm-XXXXXX)
H=$(hostname -s)
cat >"$D/slurm.conf" <<EOF
ClusterName=madci
SlurmctldHost=$H(127.0.0.1)
SlurmctldPort=${MAD_SLURM_PORT:-16817}
SlurmdPort=$(( ${MAD_SLURM_PORT:-16817} + 1 ))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.pid
SlurmctldLogFile=$D/slurmctld.log
SlurmdLogFile=$D/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
NodeName=$H NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=madci Nodes=ALL Default=YES MaxTime=30 State=UP OverSubscribe=YES
EOF
mkdir -p "$D/state" "$D/spool"
export SLURM_CONF="$D/slurm.conf"
cleanup() {
    for p in slurmd slurmctld; do
        [ -s "$D/$p.pid" ] && kill "$(cat "$D/$p.pid")" 2>/dev/null || true
    done
    sleep 0.5
    rm -rf "$D"
}
trap cleanup EXIT
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 100); do
    sinfo -h -o %t 2>/dev/null | grep -qx idle && break
    sleep 0.2
done
if ! sinfo -h -o %t | grep -qx idle; then
    sinfo || true; tail -20 "$D/slurmctld.log" "$D/slurmd.log" || true
    echo "FAILED: the Slurm node did not come up" >&2; exit 1
fi
echo "slurm: $(sinfo --version), node $H idle; MPI plugins: $(srun --mpi=list 2>&1 | tr -s '\n\t ' ' ')"

OUT=""
run() { # $1 = label, rest = command; the output is echoed and kept in $OUT
    local label=$1; shift
    echo "== $label"
    if ! OUT=$(timeout 300 "$@" 2>&1 | tr -d '\000'); then
        echo "$OUT"; echo "FAILED: $label" >&2; exit 1
    fi
    echo "$OUT"
}
need() { # $1 = label, $2 = a line the last run must have printed (fixed string)
    grep -qF -- "$2" <<<"$OUT" || { echo "FAILED: $1: expected the line: $2" >&2; exit 1; }
}
refused() { # $1 = label, $2 = an extended regex the refusal must match, rest = command
    local label=$1 re=$2; shift 2
    echo "== $label (must refuse)"
    local out
    if out=$(timeout 120 "$@" 2>&1 | tr -d '\000'); then
        echo "$out"; echo "FAILED: $label ran" >&2; exit 1
    fi
    grep -qE -- "$re" <<<"$out" || { echo "$out"; echo "FAILED: $label: the message" >&2; exit 1; }
    echo "refused as expected: $(grep -oE -- "$re" <<<"$out" | head -1)"
}

# Without MPI: the default build (the examples and madrun in release, as .ci/run builds them; the
# test binaries in debug, as its test step builds them).
cargo build --release --example hello --example startup --bin madrun 2>&1 | tail -1
cargo build --test kit_processes --test open_failure 2>&1 | tail -1
HELLO=$ROOT/target/release/examples/hello
newest() { ls -t "$ROOT"/target/debug/deps/"$1"-* | grep -v '\.d$' | head -1; }
KIT=$(newest kit_processes)
OPENF=$(newest open_failure)
SRUN=(srun --mpi=pmi2 -n 4)

run "hello, srun --mpi=pmi2 -n 4 (PMI bootstrap)" "${SRUN[@]}" "$HELLO"
need "hello under srun" "rank 3: received 3000 bytes from rank 0, intact"
# The PMI bootstrap's collectives through rank 0's server (the default), and over PMI itself.
for run_ in "tcp server" "shm server" "tcp pmi"; do
    set -- $run_
    run "kit over $1, srun --mpi=pmi2 -n 4, collectives: $2" env MAD_KIT_SPEC=$1 MAD_PMI_COLLECTIVES=$2 \
        "${SRUN[@]}" "$KIT" --ignored --exact kit_child --nocapture --test-threads=1
    for r in 0 1 2 3; do need "kit over $1 ($2)" "kit: rank $r of 4 (pmi) ran"; done
done
for coll in server pmi; do
    run "a channel open that fails on rank 1, srun --mpi=pmi2 -n 3, collectives: $coll" \
        env OPEN_FAILURE_CHILD=emfile:tcp MAD_PMI_COLLECTIVES=$coll \
        srun --mpi=pmi2 -n 3 "$OPENF" child_role --exact --nocapture --test-threads=1
    [ "$(grep -c REMOTE-FAILURE-OK <<<"$OUT")" = 2 ] || { echo "FAILED: ranks 0 and 2 did not both see rank 1's failure" >&2; exit 1; }
    need "open failure under srun ($coll)" "OWN-FAILURE"
done
refused "hello, srun -n 2 without an MPI plugin" "Slurm's srun as rank [01] of 2, but the session has no bootstrap" \
    srun -n 2 "$HELLO"
refused "hello, srun --mpi=pmix -n 2 without the mpi feature" "Slurm's srun as rank [01] of 2.*--features mpi" \
    srun --mpi=pmix -n 2 "$HELLO"

# With MPI: the mad-mpi job test, built by .ci/mpi.sh (or here).
KIT_CASES=$(sed -n '/^const CASES/,/^];/p' mad-core/src/conformance.rs | grep -c '^ *("')
KIT_CASES=$((KIT_CASES - 1))   # every case but peer_closes
unset MAD_KIT_CASES
for mpi in mpich openmpi; do
    (export CARGO_TARGET_DIR="$ROOT/target-$mpi" MPICC=mpicc.$mpi; cargo build -p mad-mpi --tests 2>&1 | tail -1)
    BIN=$(ls -t "$ROOT/target-$mpi"/debug/deps/mpi_job-* | grep -v '\.d$' | head -1)
    if [ $mpi = mpich ]; then plugin=pmi2; else plugin=pmix; fi
    run "$mpi, srun --mpi=$plugin -n 4, MPI channel" env MAD_MPI_KIT_SPEC=mpi srun --mpi=$plugin -n 4 "$BIN"
    need "$mpi under srun" "mpi_job: conformance kit over \`mpi\`: $KIT_CASES cases passed"
    need "$mpi under srun" "mpi_job: all checks passed on"
done

# Job start, 4 ranks: from each rank's main to the first message from rank 0 (session,
# default channel's open, one message), the slowest rank, median of 5 jobs under each launcher;
# and the whole job as the user waits for it (launcher start to exit), which adds Slurm's
# allocation of the job step.
slowest() { grep -oE 'first message [0-9.]+' | awk '{ if ($3 > m) m = $3 } END { print m }'; }
median() { tr ' ' '\n' | grep . | sort -n | sed -n 3p; }
ms() { local t0 t1; t0=$(date +%s%N); "$@" >/dev/null 2>&1; t1=$(date +%s%N); echo $(( (t1 - t0) / 1000000 )); }
STARTUP=$ROOT/target/release/examples/startup
s_in=""; m_in=""; s_job=""; m_job=""
for _ in 1 2 3 4 5; do
    run "startup, srun" "${SRUN[@]}" "$STARTUP"; s_in="$s_in $(slowest <<<"$OUT")"
    run "startup, madrun" "$ROOT/target/release/madrun" -n 4 "$STARTUP"; m_in="$m_in $(slowest <<<"$OUT")"
    s_job="$s_job $(ms "${SRUN[@]}" "$STARTUP")"
    m_job="$m_job $(ms "$ROOT/target/release/madrun" -n 4 "$STARTUP")"
done
ratio() { awk -v s="$1" -v m="$2" 'BEGIN { printf "%.2f", s / m }'; }
s_med=$(echo $s_in | median); m_med=$(echo $m_in | median)
echo "job start, 4 ranks, main to first message (slowest rank, ms): srun --mpi=pmi2:$s_in (median $s_med); madrun:$m_in (median $m_med); ratio $(ratio "$s_med" "$m_med")"
s_med=$(echo $s_job | median); m_med=$(echo $m_job | median)
echo "whole job, 4 ranks (launcher start to exit, ms): srun --mpi=pmi2:$s_job (median $s_med); madrun:$m_job (median $m_med); ratio $(ratio "$s_med" "$m_med")"

echo "slurm.sh: all Slurm checks passed"
