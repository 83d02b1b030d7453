#!/usr/bin/env bash
# Fault, bad-input and security checks beyond `cargo test` (the fault_*.rs and stress.rs
# integration tests already run in .ci/run's workspace test step). See RELIABILITY.md.
#   1. cargo-fuzz: a short run of every target (FUZZ_SECONDS, default 10 s each), seeded from
#      fuzz/corpus/<target>/ (copied to a scratch directory: the committed corpus stays small).
#      Skipped with a message if nightly or cargo-fuzz cannot be installed.
#   2. TCP across network namespaces with nftables loss / black hole / resets
#      (tests/faults/netns.sh; skips itself without root, netns or nft).
# Each part prints a `test result:` line that .ci/run counts.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
FUZZ_SECONDS=${FUZZ_SECONDS:-10}
status=0

echo "== fuzzing (${FUZZ_SECONDS} s per target)"
have_fuzz=1
if ! rustup toolchain list 2>/dev/null | grep -q nightly; then
    rustup toolchain install nightly --profile minimal >/dev/null 2>&1 || have_fuzz=0
fi
if [ $have_fuzz = 1 ] && ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked >/dev/null 2>&1 || have_fuzz=0
fi
if [ $have_fuzz = 0 ]; then
    echo "fuzz: SKIPPED: nightly or cargo-fuzz could not be installed"
else
    pass=0 fail=0
    (cd fuzz && cargo +nightly fuzz build -O >/dev/null 2>&1) || { echo "fuzz: build failed"; fail=1; }
    if [ $fail = 0 ]; then
        for t in $(cd fuzz && cargo +nightly fuzz list); do
            scratch=$(mktemp -d)
            cp fuzz/corpus/"$t"/* "$scratch"/ 2>/dev/null
            log=$(mktemp)
            if (cd fuzz && cargo +nightly fuzz run -O "$t" "$scratch" -- \
                    -max_total_time="$FUZZ_SECONDS" -rss_limit_mb=2048 >"$log" 2>&1); then
                pass=$((pass + 1))
                echo "fuzz: $t: ok ($(grep -o 'Done [0-9]* runs in [0-9]* second(s)' "$log" | tail -1))"
            else
                fail=$((fail + 1))
                echo "fuzz: $t: FAILED (crash input kept under fuzz/artifacts/$t/)"
                tail -40 "$log"
            fi
            rm -rf "$scratch" "$log"
        done
    fi
    echo "test result: $([ $fail = 0 ] && echo ok || echo FAILED). $pass passed; $fail failed; 0 ignored (cargo fuzz)"
    [ $fail = 0 ] || status=1
fi

echo "== tcp across network namespaces"
bash tests/faults/netns.sh || status=1

exit $status
