#!/usr/bin/env bash
# madrun's rank program for netns.sh: rank 1 moves into the second namespace, rank 0 stays in
# madrun's (the first). The MAD_* environment passes through `ip netns exec`.
if [ "${MAD_RANK:-}" = 1 ]; then
    exec ip netns exec "$MADF_NS_B" "$@"
fi
exec "$@"
