#!/usr/bin/env bash
# The C API: build libmadeleine_c (shared and static) in release, install it with its header
# into a prefix, compile the C examples with cc against the installed files (once against the
# shared library, once statically), and run them under madrun over tcp and shm.
# Usage: .ci/capi.sh [PREFIX]      (default target/c-prefix)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PREFIX=${1:-$ROOT/target/c-prefix}
CC=${CC:-cc}
cargo build --release -p mad-capi
cargo build --release --bin madrun
TD=${CARGO_TARGET_DIR:-$ROOT/target}
mkdir -p "$PREFIX/include" "$PREFIX/lib" "$PREFIX/bin"
install -m 644 mad-capi/include/madeleine.h "$PREFIX/include/"
install -m 755 "$TD/release/libmadeleine_c.so" "$PREFIX/lib/"
install -m 644 "$TD/release/libmadeleine_c.a" "$PREFIX/lib/"
for ex in figure1 rpc pingpong; do
    $CC -std=c11 -D_POSIX_C_SOURCE=200809L -O2 -Wall -Wextra -Werror -I"$PREFIX/include" \
        "mad-capi/examples/$ex.c" -L"$PREFIX/lib" -lmadeleine_c -Wl,-rpath,"$PREFIX/lib" \
        -o "$PREFIX/bin/$ex"
done
# Static: the archive and the system libraries Rust's standard library needs.
$CC -std=c11 -D_POSIX_C_SOURCE=200809L -O2 -Wall -Wextra -Werror -I"$PREFIX/include" \
    mad-capi/examples/figure1.c "$PREFIX/lib/libmadeleine_c.a" -lpthread -ldl -lm -lgcc_s \
    -o "$PREFIX/bin/figure1-static"
MADRUN="$TD/release/madrun"
for net in tcp shm; do
    echo "== C examples over $net"
    MAD_CHANNEL_DEFAULT=$net timeout 120 "$MADRUN" -n 4 "$PREFIX/bin/figure1"
    MAD_CHANNEL_DEFAULT=$net timeout 120 "$MADRUN" -n 2 "$PREFIX/bin/figure1-static"
    MAD_CHANNEL_DEFAULT=$net timeout 300 "$MADRUN" -n 3 "$PREFIX/bin/rpc" -- --calls 100
    MAD_CHANNEL_DEFAULT=$net timeout 300 "$MADRUN" -n 2 "$PREFIX/bin/pingpong" -- --max 1048576 --iters 200
    # One call per message each way (mad_send, mad_recv), and against the piece-by-piece calls.
    MAD_CHANNEL_DEFAULT=$net timeout 300 "$MADRUN" -n 2 "$PREFIX/bin/pingpong" -- --max 1048576 --iters 200 --one-call
    MAD_CHANNEL_DEFAULT=$net timeout 300 "$MADRUN" -n 2 "$PREFIX/bin/pingpong" -- --max 1048576 --iters 200 --mixed
done
echo "capi: ok"
