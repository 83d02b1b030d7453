#!/usr/bin/env bash
# Miri and AddressSanitizer runs (issue: sanitizers on the core, the ring index logic and the
# drivers where they run; RELIABILITY.md section 8 has the findings and the longer runs).
#   Miri: mad-core's library (inline lists, wire and launch decoders, config, progress, the
#         hostmem ring indices), the engine's end-to-end tests over the in-process `mem`
#         driver (every BMM path, LATER's byte view, hold mode, re-entry, observability), and
#         mad-shm's ring.
#   ASan: mad-shm (library and driver tests: rings in shared memory, CMA) and mad-via's soft
#         NIC (registered regions, RDMA-write key and bounds checks, hostile frames).
# Needs the nightly toolchain with miri and rust-src (installed here if missing); skips with a
# message if they cannot be installed. Each part prints `test result:` lines for .ci/run.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
status=0

if ! rustup toolchain list 2>/dev/null | grep -q nightly; then
    rustup toolchain install nightly --profile minimal >/dev/null 2>&1
fi
if ! rustup +nightly component list --installed 2>/dev/null | grep -q '^miri'; then
    rustup +nightly component add miri rust-src >/dev/null 2>&1
fi
if ! rustup +nightly component list --installed 2>/dev/null | grep -q '^miri' ||
   ! rustup +nightly component list --installed 2>/dev/null | grep -q '^rust-src'; then
    echo "sanitizers: SKIPPED: nightly with miri and rust-src could not be installed"
    exit 0
fi

run() { # label, command...
    local label=$1; shift
    echo "== $label"
    local log; log=$(mktemp)
    if "$@" >"$log" 2>&1; then
        grep -a -E '^test result:' "$log"
    else
        status=1
        echo "FAILED: $label"
        tail -60 "$log"
        grep -a -E '^test result:' "$log" || echo "test result: FAILED. 0 passed; 1 failed; 0 ignored ($label)"
    fi
    rm -f "$log"
}

export MIRIFLAGS="-Zmiri-disable-isolation" # Secret::random reads the OS's random source
MIRI=(env CARGO_TARGET_DIR="$ROOT/target-miri" cargo +nightly miri test -q)
run "miri: mad-core library (with hostmem)" "${MIRI[@]}" -p mad-core --lib --features hostmem
run "miri: engine over mem (tests engine, reentry, observability, polled)" \
    "${MIRI[@]}" -p mad-core --test engine --test reentry --test observability --test polled
run "miri: mad-shm ring" "${MIRI[@]}" -p mad-shm --lib ring

ASAN=(env RUSTFLAGS="-Zsanitizer=address" CARGO_TARGET_DIR="$ROOT/target-asan"
      cargo +nightly test -q -Zbuild-std --target x86_64-unknown-linux-gnu)
run "asan: mad-shm library and driver tests" "${ASAN[@]}" -p mad-shm --lib --test driver
run "asan: mad-via soft NIC" "${ASAN[@]}" -p mad-via --test soft_links --test hostile_peer

exit $status
