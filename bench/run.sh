#!/usr/bin/env bash
# Run every benchmark that runs on this host and regenerate the results section of BENCHMARKS.md.
#
#   bench/run.sh            full run (15 minutes on 2 cores; run it on a quiet machine)
#   bench/run.sh --quick    smoke run: tiny iteration counts, every path once, debug builds for
#                           the MPI and UCX jobs; results in target-bench/quick-results (or
#                           $CARGO_TARGET_DIR/quick-results), BENCHMARKS.md untouched (what CI runs)
#   NO_MPI=1 bench/run.sh   skip the MPI builds and jobs even when an MPI is installed
#   NO_UCX=1 bench/run.sh   skip the UCX build and job even when libucx-dev is installed
#
# Steps: the pair suite (madrun -n 2), the message-rate suite (madrun -n 4), two MPI jobs per
# installed MPI (MPICH: mpiexec.mpich, Open MPI: mpirun.openmpi; each its own build of package
# mad-bench with --no-default-features --features shm,bench-mpi in target-bench-<mpi>/): the pair patterns
# with 2 ranks, the message rate with 4), the UCX job (madrun -n 2 of a --features bench-ucx
# build in target-bench-ucx/, or $UCX_TARGET_DIR: shm, sisci:local and tcp beside raw-ucx-shm,
# raw-ucx-tcp, the raw ring and raw TCP, interleaved), Figure 4 of the paper
# on via:soft (mad-via/benches/figure4.rs), tune=auto per driver (benches/tune.rs), the RPC example over tcp and shm, rpc-bench (mad-am
# against gRPC, head-of-line; its own crate mad-rpc-bench), the criterion engine benches; then
# `mad-bench report` computes the targets table and the comparisons.
#
# Extra arguments go to every mad-bench run (e.g. --runs 5). Results in bench/results/:
# pair.csv mr.csv mpich.csv openmpi.csv mpich-mr.csv openmpi-mr.csv ucx.csv (mad-bench rows),
# figure4.csv, tune.txt, rpc_example.txt, rpc.csv rpc.md (rpc-bench's rows and tables),
# engine.txt, the raw stdout of each step (*.txt), status.tsv (what ran, what did not and why),
# *.svg, results.md (the full report: every table and plot), section.md (the short section spliced
# into BENCHMARKS.md: the run, the targets table, links to the key plots, results.md and rpc.md).
#
# A step that cannot run here (no MPI or no libucx-dev installed, NO_MPI, NO_UCX) is reported "not run" with the reason;
# a step that fails is reported "failed", the others still run and the script exits with 1.
set -uo pipefail
cd "$(dirname "$0")/.."

QUICK=()
CRIT=()
if [[ "${1:-}" == "--quick" ]]; then
    QUICK=(--quick)
    CRIT=(--quick --warm-up-time 0.2 --measurement-time 0.5)
    shift
fi
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target-bench}"
# A smoke run only shows that everything runs: its figures go to a scratch directory and never
# into BENCHMARKS.md or bench/results (which hold the last full run).
if [[ ${#QUICK[@]} -gt 0 ]]; then OUT="$CARGO_TARGET_DIR/quick-results"; else OUT=bench/results; fi
BIN="$CARGO_TARGET_DIR/release"
mkdir -p "$OUT"
rm -f "$OUT"/*.csv "$OUT"/*.svg "$OUT"/*.txt "$OUT"/*.md "$OUT"/*.tsv "$OUT"/*.log
ABSOUT=$(cd "$OUT" && pwd)
LOAD=$(cut -d' ' -f1-3 /proc/loadavg)
STATUS="$OUT/status.tsv"
: > "$STATUS"
FAILED=()
START=$(date +%s)

# status STEP STATE SECONDS DETAIL
status() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$STATUS"; }

# step NAME DETAIL COMMAND...: run COMMAND, record it as ran or failed.
step() {
    local name=$1 detail=$2 t0 rc
    shift 2
    echo
    echo "== $name: $detail"
    t0=$(date +%s)
    "$@"
    rc=$?
    if [[ $rc -eq 0 ]]; then
        status "$name" ran $(( $(date +%s) - t0 )) "$detail"
    else
        status "$name" failed $(( $(date +%s) - t0 )) "$detail: exit status $rc (see $OUT/$name.txt)"
        FAILED+=("$name")
        echo "== $name FAILED (exit status $rc)" >&2
    fi
    return 0
}

# One package selection for every release build of this script (and .ci/run's), so that cargo
# resolves the same features each time and a later build reuses the earlier one.
BUILD=(cargo build --release -p mad-bench -p madeleine-rs -p mad-rpc-bench --bin mad-bench --bin madrun
       --example rpc)
# The MPI and UCX jobs need builds of their own. Quick: debug builds in the target directories
# of .ci/mpi.sh (target-mpich, target-openmpi) and in $CARGO_TARGET_DIR, which CI has built
# already (its figures only show that the path runs); full: release builds in target-bench-*.
if [[ ${#QUICK[@]} -gt 0 ]]; then
    SIDE_PROFILE=(); SIDE_DIR=debug; MPI_PREFIX="$PWD/target-"; UCX_DEFAULT="$CARGO_TARGET_DIR"
else
    SIDE_PROFILE=(--release); SIDE_DIR=release; MPI_PREFIX="$PWD/target-bench-"; UCX_DEFAULT="$PWD/target-bench-ucx"
fi

echo "== build (release): mad-bench, madrun, examples/rpc"
if ! "${BUILD[@]}"; then
    echo "bench/run.sh: the build failed" >&2
    exit 1
fi
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
# The run's own outputs (removed above, rewritten below) do not count as local changes.
if [[ -n "$(git status --porcelain --untracked-files=no -- . ':!bench/results' ':!BENCHMARKS.md' 2>/dev/null)" ]]; then
    COMMIT="$COMMIT (with local changes)"
fi

# --- the pair and message-rate suites -------------------------------------------------------
# Quick: up to 4 MiB all the same, the size of the bandwidth targets.
if [[ ${#QUICK[@]} -gt 0 ]]; then PAIRQ=(--quick --max 4m); else PAIRQ=(); fi
pair() {
    "$BIN/madrun" -n 2 --no-prefix --timeout 1800 -- "$BIN/mad-bench" "${PAIRQ[@]}" \
        --csv "$OUT/pair.csv" "$@" 2>&1 | tee "$OUT/pair.txt"
}
step pair "\`madrun -n 2 mad-bench\`: every channel and baseline, latency bw bibw latency_mt rpc" pair "$@"

mr() {
    "$BIN/madrun" -n 4 --no-prefix --timeout 900 -- "$BIN/mad-bench" "${QUICK[@]}" \
        --csv "$OUT/mr.csv" "$@" 2>&1 | tee "$OUT/mr.txt"
}
step mr "\`madrun -n 4 mad-bench\`: message rate" mr "$@"

# --- UCX: shm, sisci:local and tcp beside UCX on the same transports (issue 16) -------------
# Its own build: --features bench-ucx links libucp and libucs (Debian: libucx-dev). Sizes up to
# 16 MiB (the issue's sweep); quick: up to 4 MiB. The UCX baselines busy-poll (UCX's default).
if [[ ${#QUICK[@]} -gt 0 ]]; then UCXMAX=4m; else UCXMAX=16m; fi
UCXARGS=(--channels 'shm;sisci:local;tcp' --modes cheaper --bench latency,bw --max "$UCXMAX"
         --baselines raw-ucx-shm,raw-ucx-tcp,raw-shm,raw-tcp-poll)

has_libucx() {
    local d
    for d in /usr/include /usr/local/include; do
        [[ -f "$d/ucp/api/ucp.h" ]] && return 0
    done
    return 1
}

ucx_job() {
    local target="${UCX_TARGET_DIR:-$UCX_DEFAULT}" t0 rc
    if [[ -n "${NO_UCX:-}" ]]; then
        status ucx not-run 0 "NO_UCX is set"
        return
    fi
    if ! has_libucx; then
        status ucx not-run 0 "libucx-dev (UCX's headers, libucp and libucs) is not installed"
        return
    fi
    echo
    echo "== ucx: build with --features tcp,shm,sisci,bench-ucx in $target"
    t0=$(date +%s)
    if ! CARGO_TARGET_DIR="$target" cargo build "${SIDE_PROFILE[@]}" -p mad-bench --no-default-features \
            --features tcp,shm,sisci,bench-ucx 2>&1 | tee "$OUT/ucx-build.log"; then
        status ucx failed $(( $(date +%s) - t0 )) "the build with --features bench-ucx failed (see $OUT/ucx-build.log)"
        FAILED+=(ucx)
        return
    fi
    echo "== ucx: madrun -n 2 mad-bench ${UCXARGS[*]}"
    "$BIN/madrun" -n 2 --no-prefix --timeout 1800 -- "$target/$SIDE_DIR/mad-bench" "${QUICK[@]}" \
        "${UCXARGS[@]}" --csv "$OUT/ucx.csv" "$@" 2>&1 | tee "$OUT/ucx.txt"
    rc=${PIPESTATUS[0]}
    if [[ $rc -ne 0 ]]; then
        status ucx failed $(( $(date +%s) - t0 )) "\`madrun -n 2 mad-bench\` (bench-ucx) exited with $rc (see $OUT/ucx.txt)"
        FAILED+=(ucx)
        rm -f "$OUT/ucx.csv"
        return
    fi
    # mad-bench goes on without a UCX baseline that could not start: say so in the status.
    local out
    out=$(grep -o 'baseline raw-ucx-[a-z]* left out: .*' "$OUT/ucx.txt" | tr '\n' ' ')
    status ucx ran $(( $(date +%s) - t0 )) "\`madrun -n 2 mad-bench ${UCXARGS[*]}\` (build included)${out:+; $out}"
}
ucx_job "$@"

# --- the MPI jobs: shm, the MPI channel, raw MPI (two RPC idioms), the raw ring, memcpy ------
# Sizes up to 16 MiB (the shm issue's sweep); quick: up to 4 MiB (the targets' sizes).
if [[ ${#QUICK[@]} -gt 0 ]]; then MPIMAX=4m; else MPIMAX=16m; fi
MPIARGS=(--channels 'shm;mpi' --modes cheaper --bench latency,bw,bibw,latency_mt,rpc --max "$MPIMAX"
         --baselines raw-mpi,raw-mpi-packed,raw-shm,memcpy)
# The message rate of the same channels and baselines, 4 ranks (2 pairs) in a second job.
MRARGS=(--channels 'shm;mpi' --modes cheaper --bench mbw_mr --baselines raw-mpi,raw-shm)

has_libclang() {
    [[ -n "${LIBCLANG_PATH:-}" ]] && return 0
    compgen -G '/usr/lib/llvm-*/lib/libclang*.so*' >/dev/null && return 0
    compgen -G '/usr/lib/*/libclang*.so*' >/dev/null && return 0
    "$(command -v ldconfig || echo /sbin/ldconfig)" -p 2>/dev/null | grep -q 'libclang'
}

# mpi_job NAME LAUNCHER...: build mad-bench against mpicc.NAME in target-bench-NAME, run it.
mpi_job() {
    local name=$1 t0 rc
    shift
    local launcher=("$@")
    local target="$MPI_PREFIX$name"
    if [[ -n "${NO_MPI:-}" ]]; then
        status "$name" not-run 0 "NO_MPI is set"
        return
    fi
    if ! command -v "mpicc.$name" >/dev/null || ! command -v "${launcher[0]}" >/dev/null; then
        status "$name" not-run 0 "mpicc.$name or ${launcher[0]} is not installed"
        return
    fi
    # The mpi crate's bindings are generated by bindgen, which needs libclang.
    if ! has_libclang; then
        status "$name" not-run 0 "libclang (libclang-dev) is not installed: the mpi crate's bindgen needs it"
        return
    fi
    echo
    echo "== $name: build with --features shm,bench-mpi in $target"
    t0=$(date +%s)
    # Only the drivers the job uses (shm; mpi comes with bench-mpi): half the build time.
    if ! MPICC="mpicc.$name" CARGO_TARGET_DIR="$target" cargo build "${SIDE_PROFILE[@]}" -p mad-bench \
            --no-default-features --features shm,bench-mpi 2>&1 | tee "$OUT/$name-build.log"; then
        status "$name" failed $(( $(date +%s) - t0 )) "the build with --features shm,bench-mpi failed (needs libclang-dev; see $OUT/$name-build.log)"
        FAILED+=("$name")
        return
    fi
    echo "== $name: ${launcher[*]} -n 2 mad-bench ${MPIARGS[*]}"
    timeout 1800 "${launcher[@]}" -n 2 "$target/$SIDE_DIR/mad-bench" "${QUICK[@]}" "${MPIARGS[@]}" \
        --csv "$OUT/$name.csv" "${EXTRA[@]}" 2>&1 | tr -d '\000' | tee "$OUT/$name.txt"
    rc=${PIPESTATUS[0]}
    if [[ $rc -eq 0 ]]; then
        status "$name" ran $(( $(date +%s) - t0 )) "\`${launcher[*]} -n 2 mad-bench ${MPIARGS[*]}\` (build included)"
    else
        status "$name" failed $(( $(date +%s) - t0 )) "\`${launcher[0]} -n 2 mad-bench\` exited with $rc (see $OUT/$name.txt)"
        FAILED+=("$name")
        rm -f "$OUT/$name.csv"
    fi
    t0=$(date +%s)
    echo "== $name-mr: ${launcher[*]} -n 4 mad-bench ${MRARGS[*]}"
    timeout 1800 "${launcher[@]}" -n 4 "$target/$SIDE_DIR/mad-bench" "${QUICK[@]}" "${MRARGS[@]}" \
        --csv "$OUT/$name-mr.csv" "${EXTRA[@]}" 2>&1 | tr -d '\000' | tee "$OUT/$name-mr.txt"
    rc=${PIPESTATUS[0]}
    if [[ $rc -eq 0 ]]; then
        status "$name-mr" ran $(( $(date +%s) - t0 )) "\`${launcher[*]} -n 4 mad-bench ${MRARGS[*]}\`"
    else
        status "$name-mr" failed $(( $(date +%s) - t0 )) "\`${launcher[0]} -n 4 mad-bench\` exited with $rc (see $OUT/$name-mr.txt)"
        FAILED+=("$name-mr")
        rm -f "$OUT/$name-mr.csv"
    fi
}
EXTRA=("$@")
mpi_job mpich mpiexec.mpich
# Open MPI: root needs the two variables; --bind-to none leaves pinning to mad-bench, as under
# MPICH and madrun.
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    mpi_job openmpi mpirun.openmpi --oversubscribe --bind-to none

# --- Figure 4 of the paper on via:soft ------------------------------------------------------
if [[ ${#QUICK[@]} -gt 0 ]]; then FIG4=(FIG4_REPS=1 FIG4_BUDGET_MS=2); else FIG4=(FIG4_REPS=15 FIG4_BUDGET_MS=20); fi
# (cargo runs a bench in its package's directory: the CSV path must be absolute.)
figure4() {
    env "${FIG4[@]}" FIG4_CSV="$ABSOUT/figure4.csv" cargo bench -p mad-via --bench figure4 2>&1 \
        | tee "$OUT/figure4.txt"
}
step figure4 "\`${FIG4[*]} cargo bench -p mad-via --bench figure4\`" figure4

# --- tune=auto per driver (issue 21): each TM forced vs built-in vs tuned; open costs ---------
if [[ ${#QUICK[@]} -gt 0 ]]; then TUNE=(TUNE_REPS=1 TUNE_BUDGET_MS=2 TUNE_OPENS=2); else TUNE=(TUNE_REPS=15 TUNE_BUDGET_MS=15 TUNE_OPENS=10); fi
tune_bench() {
    env "${TUNE[@]}" cargo bench --bench tune 2>&1 | tee "$OUT/tune.txt"
}
step tune "\`${TUNE[*]} cargo bench --bench tune\`" tune_bench

# --- the RPC example over tcp and shm -------------------------------------------------------
if [[ ${#QUICK[@]} -gt 0 ]]; then RPCRUNS=1; RPCARGS=(--quick); else RPCRUNS=3; RPCARGS=(); fi
rpc_example() {
    (
        for ch in tcp shm; do
            for r in $(seq 1 "$RPCRUNS"); do
                echo "== rpc channel=$ch run=$r"
                # The server's stderr lists the malformed requests the example sends on purpose.
                timeout 300 "$BIN/madrun" -n 2 --no-prefix -- "$BIN/examples/rpc" --channel "$ch" \
                    "${RPCARGS[@]}" 2>>"$OUT/rpc_example.log" || exit 1
            done
        done
    ) | tee "$OUT/rpc_example.txt"
}
step rpc-example "\`madrun -n 2 examples/rpc --channel tcp|shm ${RPCARGS[*]}\`, $RPCRUNS run(s) each" rpc_example

# --- RPC: mad-am against gRPC (tonic), and head-of-line (issue 17) ---------------------------
# Its own crate (tonic, prost and their tokio stay out of the library crates), built here; a
# build that fails (no crates.io, ...) skips the step with a status line. Quick: 0.1 s points,
# ~20 s; full: 1 s points, ~2 min.
rpc_bench() {
    local t0 rc
    t0=$(date +%s)
    echo
    echo "== rpc-bench: build (release) -p mad-rpc-bench"
    if ! "${BUILD[@]}" --bin rpc-bench > "$OUT/rpc-bench-build.log" 2>&1; then
        tail -20 "$OUT/rpc-bench-build.log"
        status rpc-bench not-run $(( $(date +%s) - t0 )) "the build of mad-rpc-bench (tonic) failed (see $OUT/rpc-bench-build.log)"
        echo "== rpc-bench not run: the build failed"
        return
    fi
    echo "== rpc-bench: madrun -n 2 rpc-bench ${QUICK[*]}"
    # The tables on stdout (rpc.md); one line per point, and any error, on stderr (rpc.txt).
    timeout 900 "$BIN/madrun" -n 2 --no-prefix -- "$BIN/rpc-bench" "${QUICK[@]}" \
        --csv "$OUT/rpc.csv" > "$OUT/rpc.md" 2> "$OUT/rpc.txt"
    rc=$?
    cat "$OUT/rpc.txt" "$OUT/rpc.md"
    if [[ $rc -eq 0 ]]; then
        status rpc-bench ran $(( $(date +%s) - t0 )) "\`madrun -n 2 rpc-bench ${QUICK[*]}\`: mad-am over shm and tcp against tonic over TCP and UDS, head-of-line (build included)"
    else
        status rpc-bench failed $(( $(date +%s) - t0 )) "\`madrun -n 2 rpc-bench\` exited with $rc (see $OUT/rpc.txt)"
        FAILED+=(rpc-bench)
        rm -f "$OUT/rpc.md" "$OUT/rpc.csv"
    fi
}
rpc_bench

# --- criterion --------------------------------------------------------------------------------
engine() { cargo bench --bench engine -- "${CRIT[@]}" 2>&1 | tee "$OUT/engine.txt"; }
step engine "\`cargo bench --bench engine -- ${CRIT[*]}\`" engine

# --- the report ---------------------------------------------------------------------------------
CSVS=()
for s in pair mr mpich openmpi mpich-mr openmpi-mr ucx; do [[ -s "$OUT/$s.csv" ]] && CSVS+=("$OUT/$s.csv"); done
if ! "$BIN/mad-bench" report --out "$OUT" --status "$STATUS" --engine "$OUT/engine.txt" \
        --fig4 "$OUT/figure4.csv" --rpc-example "$OUT/rpc_example.txt" "${CSVS[@]}"; then
    echo "bench/run.sh: mad-bench report failed" >&2
    exit 1
fi
# mad-bench names the plots $OUT/x.svg; results.md lives in $OUT, so it links them as x.svg.
sed -i "s|](${OUT}/|](|g" "$OUT/results.md"

END=$(date +%s)
CPU=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')
# The key plots, linked from the section when this run drew them: FILE|what it shows.
KEY_PLOTS=(
    "pair-latency.svg|pair suite: one-way latency, every channel and baseline"
    "pair-bw.svg|pair suite: bandwidth"
    "shm-mpi-latency.svg|shm and the MPI channel against MPICH and Open MPI: one-way latency"
    "shm-mpi-bw.svg|shm and the MPI channel against MPICH and Open MPI: bandwidth"
    "ucx-latency.svg|shm, sisci:local and tcp against UCX: one-way latency"
    "ucx-bw.svg|shm, sisci:local and tcp against UCX: bandwidth"
    "figure4.svg|Figure 4 on via:soft: adaptive against each fixed method"
)
# The section spliced into BENCHMARKS.md: the run, the targets table (verbatim from results.md)
# and links; the full tables stay in $OUT/results.md and $OUT/rpc.md.
{
    echo "<!-- results:begin (generated by bench/run.sh; do not edit by hand) -->"
    echo
    echo "### Run"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC'), commit \`$COMMIT\`, took $(( (END - START) / 60 )) min $(( (END - START) % 60 )) s"
    echo "- machine: $(nproc) CPUs ($CPU), $(free -g | awk '/Mem:/ {print $2}') GiB, $(uname -sr), load average before the run: $LOAD"
    echo "- command: \`bench/run.sh ${QUICK[*]} $*\`"
    if [[ ${#QUICK[@]} -gt 0 ]]; then
        echo
        echo "**Smoke run (\`--quick\`): iteration counts divided by 100, one run. These numbers only show that"
        echo "everything runs; do not quote them, and do not read the verdicts.**"
    fi
    echo
    # From results.md's "### Targets" to its next heading of the same level, trailing blank lines
    # dropped.
    awk '/^### / { on = ($0 == "### Targets") }
         on && $0 == "" { blank++; next }
         on { while (blank > 0) { print ""; blank-- } print }' "$OUT/results.md"
    echo
    echo "### Key plots and the full tables"
    echo
    for p in "${KEY_PLOTS[@]}"; do
        [[ -f "$OUT/${p%%|*}" ]] && echo "- [${p#*|}]($OUT/${p%%|*})"
    done
    echo "- [\`$OUT/results.md\`]($OUT/results.md): what each step ran (or why not), every table and plot of this run"
    if [[ -s "$OUT/rpc.md" ]]; then
        echo "- [\`$OUT/rpc.md\`]($OUT/rpc.md): \`rpc-bench\`, mad-am against gRPC (tonic): calls/s, p99, the issue 17 targets, head-of-line"
    fi
    echo
    echo "<!-- results:end -->"
} > "$OUT/section.md"

if [[ ${#QUICK[@]} -gt 0 ]]; then
    echo "smoke run: results in $OUT (BENCHMARKS.md unchanged) ($(( END - START )) s)"
else
    # Splice the section between the markers of BENCHMARKS.md (the methodology above stays).
    awk -v sec="$OUT/section.md" '
        /<!-- results:begin/ { while ((getline l < sec) > 0) print l; skip = 1; next }
        /<!-- results:end -->/ { skip = 0; next }
        !skip { print }
    ' BENCHMARKS.md > BENCHMARKS.md.new && mv BENCHMARKS.md.new BENCHMARKS.md
    echo "BENCHMARKS.md updated ($(( END - START )) s)"
fi
if [[ ${#FAILED[@]} -gt 0 ]]; then
    echo "bench/run.sh: failed steps: ${FAILED[*]} (see $STATUS)" >&2
    exit 1
fi
