#!/usr/bin/env bash
# Every publishable crate of the workspace packaged and verified as crates.io would get it:
# `cargo package --workspace` (all members but those with `publish = false`) builds each
# .crate, then builds it unpacked, with the workspace crates it depends on served from a
# temporary local registry (so no crate needs to be on crates.io yet, and no --no-verify is
# needed). Then for each package: its size, and a failure if it is larger than MAX_KIB
# (unpacked) or ships something that is not source, README, changelog or licence (bench
# results, CI scripts, build output, tests, notes).
# Needs the crates.io index (network) and, for mad-mpi, an MPI and libclang (.ci/run installs
# them). Idempotent; on 2 cores about 1 min with its target directory warm, 2.5 min cold.
set -euo pipefail
cd "$(dirname "$0")/.."
# mad-core carries the engine, the launcher and the conformance kit every driver crate runs
# (about 1 MiB of source); the budget leaves it room to grow by a quarter before someone looks.
MAX_KIB=${MAX_KIB:-1280}
# Cargo takes a registry crate as unchanged while its version is: it unpacks the workspace
# crates of the temporary registry into $CARGO_HOME/registry/src/-<hash>/ only if they are not
# there yet, and rebuilds them only if their version changed. So before each run their unpacked
# sources and their build state are removed, or the last run's would be verified against. A
# target directory of its own keeps the other builds' state out of this.
TARGET=${CARGO_TARGET_DIR:-$PWD/target}/package-check
export CARGO_TARGET_DIR=$TARGET

# mad-mpi's verification build links an MPI; use MPICH as .ci/run's other MPI builds do.
if [ -z "${MPICC:-}" ]; then
    if command -v mpicc.mpich >/dev/null 2>&1; then export MPICC=mpicc.mpich
    elif ! command -v mpicc >/dev/null 2>&1; then
        echo "package: mad-mpi needs an MPI (mpicc) and libclang to verify; .ci/run installs them" >&2
        exit 1
    fi
fi

# Members with `publish = false` are left out (cargo package would package them too).
exclude=()
for manifest in $(cargo metadata --no-deps --format-version 1 | grep -o '"manifest_path":"[^"]*"' | cut -d'"' -f4); do
    name=$(sed -n 's/^name *= *"\(.*\)"/\1/p' "$manifest" | head -1)
    rm -rf "$TARGET"/debug/.fingerprint/"$name"-* "${CARGO_HOME:-$HOME/.cargo}"/registry/src/-*/"$name"-[0-9]*
    if grep -q '^publish *= *false' "$manifest"; then
        exclude+=(--exclude "$name")
    fi
done

log=$(mktemp)
trap 'rm -f "$log"' EXIT
# --allow-dirty: CI packages the working tree as it is (uncommitted changes included).
# Targets whose files are deliberately not shipped (tests, benches) are warned about one by one:
# those lines are dropped.
if ! cargo package --workspace "${exclude[@]}" --allow-dirty >"$log" 2>&1; then
    grep -v -E '^warning: ignoring (test|bench|example) ' "$log" | tail -60
    echo "package: cargo package failed"
    exit 1
fi
grep -E '^ *(Packaging|Verifying) ' "$log" || true

# What a package may contain: sources, manifests, README, changelog, licences, the C header.
allowed='^[^/]+/((src|examples|benches)/.*\.(rs|c)|include/[^/]+\.h|Cargo\.(toml|toml\.orig|lock)|\.cargo_vcs_info\.json|README\.md|CHANGELOG\.md|LICENSE-(MIT|APACHE))$'
status=0
printf '%-28s %10s %12s %6s\n' package unpacked compressed files
while read -r name version; do
    crate="$TARGET/package/$name-$version.crate"
    files=$(tar -tzf "$crate")
    unpacked=$(tar -tzvf "$crate" | awk '{s += $3} END {print s + 0}')
    printf '%-28s %7d KiB %8d KiB %6d\n' "$name-$version" $(( (unpacked + 1023) / 1024 )) \
        $(( ($(stat -c %s "$crate") + 1023) / 1024 )) "$(wc -l <<<"$files")"
    if [ "$unpacked" -gt $(( MAX_KIB * 1024 )) ]; then
        echo "  FAIL: larger than $MAX_KIB KiB unpacked"; status=1
    fi
    if stray=$(grep -v -E "$allowed" <<<"$files"); then
        echo "  FAIL: files that should not be published:"; sed 's/^/    /' <<<"$stray"; status=1
    fi
done < <(sed -n 's/^ *Packaging \([^ ]*\) v\([^ ]*\) .*/\1 \2/p' "$log")
[ $status = 0 ] && echo "package: ok" || echo "package: FAILED"
exit $status
