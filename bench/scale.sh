#!/usr/bin/env bash
# How opening a channel scales with the ranks on one host (issue 16's scale report): for shm
# and sisci:local with 2, 8, 32 and 64 ranks, the open time (max and median over the ranks) and
# the shared memory per process (created in /dev/shm, and mapped: its own segment and its
# peers'). Usage: bash bench/scale.sh [RANKS...]   (prints CSV; needs a release build)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet --example open_scale --bin madrun
RANKS=("${@:-2 8 32 64}")
# shellcheck disable=SC2206
RANKS=(${RANKS[*]})
echo "spec,ranks,open_ms_max,open_ms_median,created_kib,mapped_kib"
for n in "${RANKS[@]}"; do
    for spec in shm sisci:local; do
        timeout 300 ./target/release/madrun --no-prefix -n "$n" ./target/release/examples/open_scale "$spec" \
            || echo "$spec,$n,failed,,,"
    done
done
