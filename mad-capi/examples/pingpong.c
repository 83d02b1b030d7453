/* Ping-pong through the C API, as examples/pingpong.rs does through the Rust API (same loop,
 * same output), so the two compare side by side:
 *   madrun -n 2 ./pingpong [--max SIZE_BYTES] [--iters N] [--one-call | --mixed]
 * Each message is built piece by piece (mad_begin_packing, mad_pack, mad_end_packing and the
 * same on receive), or with --one-call in one call each way (mad_send, mad_recv: same pieces,
 * same modes, same wire; --mixed: rank 0 so, rank 1 piece by piece). One-way latency = round-trip time / 2. No allocation per message on
 * the C side. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
#include "madeleine.h"

#define CHECK(call)                                                                 \
    do {                                                                            \
        int rc_ = (call);                                                           \
        if (rc_ != MAD_OK) {                                                        \
            fprintf(stderr, "pingpong: %s: %s (%s)\n", #call, mad_status_name(rc_), \
                    mad_last_error());                                              \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    size_t max = 4 << 20, iters0 = 10000;
    int one_call = 0;
    int i0 = argc > 1 && !strcmp(argv[1], "--") ? 2 : 1; /* madrun passes its `--` on */
    for (int i = i0; i < argc; i++) {
        if (!strcmp(argv[i], "--one-call")) one_call = 1;
        else if (!strcmp(argv[i], "--mixed")) one_call = 2;
        else if (i + 1 < argc && !strcmp(argv[i], "--max")) max = strtoull(argv[++i], NULL, 10);
        else if (i + 1 < argc && !strcmp(argv[i], "--iters")) iters0 = strtoull(argv[++i], NULL, 10);
        else { fprintf(stderr, "pingpong: unknown option %s\n", argv[i]); return 2; }
    }
    MadSession *s;
    MadChannel *ch;
    CHECK(mad_session_init(&s));
    CHECK(mad_channel_open(s, "default", &ch));
    size_t me = mad_session_rank(s);
    if (mad_session_size(s) < 2) { fprintf(stderr, "pingpong needs two processes\n"); return 2; }
    uint8_t *buf = malloc(max ? max : 1), *rbuf = malloc(max ? max : 1);
    for (size_t i = 0; i < max; i++) buf[i] = (uint8_t)i;
    if (me == 0) printf("%10s %14s %14s %8s\n", "size (B)", "one-way (µs)", "bw (MB/s)", "iters");
    for (size_t n = 0; n <= max; n = n ? n * 2 : 1) {
        size_t iters = n <= 8192 ? iters0 : (iters0 / 10 > 10 ? iters0 / 10 : 10);
        size_t warm = iters / 10 > 2 ? iters / 10 : 2;
        double t0 = now();
        for (size_t it = 0; it < warm + iters; it++) {
            MadPacker *p;
            MadUnpacker *u;
            if (it == warm) t0 = now();
            if ((one_call == 1 && me <= 1) || (one_call == 2 && me == 0)) {
                MadPiece out = {me == 0 ? buf : rbuf, n, MAD_SEND_CHEAPER, MAD_RECV_CHEAPER};
                MadPiece in = {rbuf, n, MAD_SEND_CHEAPER, MAD_RECV_CHEAPER};
                if (me == 0) {
                    CHECK(mad_send(ch, 1, &out, 1));
                    CHECK(mad_recv(ch, 1, &in, 1, NULL));
                } else {
                    CHECK(mad_recv(ch, 0, &in, 1, NULL));
                    CHECK(mad_send(ch, 0, &out, 1));
                }
            } else if (me == 0) {
                CHECK(mad_begin_packing(ch, 1, &p));
                CHECK(mad_pack(p, buf, n, MAD_SEND_CHEAPER, MAD_RECV_CHEAPER));
                CHECK(mad_end_packing(p));
                CHECK(mad_begin_unpacking_from(ch, 1, &u));
                CHECK(mad_unpack(u, rbuf, n, MAD_SEND_CHEAPER, MAD_RECV_CHEAPER));
                CHECK(mad_end_unpacking(u));
            } else if (me == 1) {
                CHECK(mad_begin_unpacking_from(ch, 0, &u));
                CHECK(mad_unpack(u, rbuf, n, MAD_SEND_CHEAPER, MAD_RECV_CHEAPER));
                CHECK(mad_end_unpacking(u));
                CHECK(mad_begin_packing(ch, 0, &p));
                CHECK(mad_pack(p, rbuf, n, MAD_SEND_CHEAPER, MAD_RECV_CHEAPER));
                CHECK(mad_end_packing(p));
            }
        }
        if (me == 0) {
            double one_way = (now() - t0) / iters / 2;
            if (memcmp(rbuf, buf, n)) { fprintf(stderr, "echoed %zu-byte message differs\n", n); return 1; }
            printf("%10zu %14.3f %14.1f %8zu\n", n, one_way * 1e6, n ? n / one_way / 1e6 : 0.0, iters);
        }
        if (n == max) break;
    }
    free(buf);
    free(rbuf);
    mad_channel_free(ch);
    mad_session_free(s);
    return 0;
}
