/* RPC in C: rank 0 serves, every other rank calls. A request is an EXPRESS header (operation,
 * call id, body length) and a CHEAPER body, received straight into a buffer the server sizes
 * from the header; the reply is an EXPRESS result and a CHEAPER body. The server is an event
 * loop: non-blocking tries, then arm the channel's readiness descriptor and poll(2) on it.
 *   madrun -n 3 ./rpc [--calls N]          (MAD_CHANNEL_DEFAULT=tcp or shm) */
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "madeleine.h"

#define CHECK(call)                                                                 \
    do {                                                                            \
        int rc_ = (call);                                                           \
        if (rc_ != MAD_OK) {                                                        \
            fprintf(stderr, "rpc: %s: %s (%s)\n", #call, mad_status_name(rc_),      \
                    mad_last_error());                                              \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

enum { OP_SUM = 1, OP_REVERSE = 2, OP_BYE = 3 };
typedef struct { uint32_t op, id; uint64_t len; } Request;
typedef struct { uint32_t id, status; uint64_t value, len; } Reply;

static void serve(MadChannel *ch, size_t clients) {
    int fd = mad_channel_readiness_fd(ch);
    size_t served = 0, sleeps = 0;
    uint8_t *body = NULL;
    size_t cap = 0;
    while (clients > 0) {
        MadUnpacker *u;
        int rc = mad_try_begin_unpacking(ch, &u);
        if (rc == MAD_AGAIN) {
            if (fd < 0) continue; /* no descriptor (MPI): poll the channel */
            if (mad_channel_arm(ch) == MAD_AGAIN) continue;
            struct pollfd p = {.fd = fd, .events = POLLIN};
            int n = poll(&p, 1, 10000);
            mad_channel_disarm(ch);
            if (n == 0) { fprintf(stderr, "rpc: server idle for 10 s\n"); exit(1); }
            sleeps++;
            continue;
        }
        CHECK(rc);
        size_t from = mad_unpacker_remote(u);
        Request q;
        CHECK(mad_unpack(u, &q, sizeof q, MAD_SEND_SAFER, MAD_RECV_EXPRESS));
        if (q.len > (1u << 26)) { fprintf(stderr, "rpc: request of %llu bytes refused\n", (unsigned long long)q.len); exit(1); }
        if (q.len > cap) { cap = q.len; body = realloc(body, cap); }
        CHECK(mad_unpack(u, body, q.len, MAD_SEND_CHEAPER, MAD_RECV_CHEAPER));
        CHECK(mad_end_unpacking(u));
        if (q.op == OP_BYE) { clients--; continue; }
        Reply r = {.id = q.id, .status = 0, .value = 0, .len = 0};
        if (q.op == OP_SUM) {
            for (uint64_t i = 0; i < q.len; i++) r.value += body[i];
        } else if (q.op == OP_REVERSE) {
            for (uint64_t i = 0; i < q.len / 2; i++) {
                uint8_t t = body[i]; body[i] = body[q.len - 1 - i]; body[q.len - 1 - i] = t;
            }
            r.len = q.len;
        } else {
            r.status = 1;
        }
        MadPacker *p;
        CHECK(mad_begin_packing(ch, from, &p));
        CHECK(mad_pack(p, &r, sizeof r, MAD_SEND_SAFER, MAD_RECV_EXPRESS));
        CHECK(mad_pack(p, body, r.len, MAD_SEND_CHEAPER, MAD_RECV_CHEAPER));
        CHECK(mad_end_packing(p));
        served++;
    }
    printf("rank 0 (server): %zu calls served, slept %zu times on the readiness descriptor\n", served, sleeps);
    free(body);
}

static void call(MadChannel *ch, size_t me, size_t calls) {
    for (uint32_t id = 0; id < calls; id++) {
        uint64_t len = 1 + (id * 7919u + me * 104729u) % (id % 8 == 0 ? 300000 : 2000);
        uint8_t *body = malloc(len), *back = malloc(len);
        for (uint64_t i = 0; i < len; i++) body[i] = (uint8_t)(i * 31 + id + me);
        Request q = {.op = id % 2 ? OP_SUM : OP_REVERSE, .id = id, .len = len};
        MadPacker *p;
        CHECK(mad_begin_packing(ch, 0, &p));
        CHECK(mad_pack(p, &q, sizeof q, MAD_SEND_SAFER, MAD_RECV_EXPRESS));
        if (id % 3) {
            /* CHEAPER: untouched until mad_end_packing returns. */
            CHECK(mad_pack(p, body, len, MAD_SEND_CHEAPER, MAD_RECV_CHEAPER));
        } else {
            /* LATER: read at mad_end_packing, so the byte written after mad_pack goes out. */
            uint8_t last = body[len - 1];
            body[len - 1] = 0;
            CHECK(mad_pack(p, body, len, MAD_SEND_LATER, MAD_RECV_CHEAPER));
            body[len - 1] = last;
        }
        CHECK(mad_end_packing(p));
        MadUnpacker *u;
        Reply r;
        CHECK(mad_begin_unpacking_from(ch, 0, &u));
        CHECK(mad_unpack(u, &r, sizeof r, MAD_SEND_SAFER, MAD_RECV_EXPRESS));
        if (r.len > len) { fprintf(stderr, "rpc: reply of %llu bytes\n", (unsigned long long)r.len); exit(1); }
        CHECK(mad_unpack(u, back, r.len, MAD_SEND_CHEAPER, MAD_RECV_CHEAPER));
        CHECK(mad_end_unpacking(u));
        int ok = r.id == id && r.status == 0;
        if (q.op == OP_SUM) {
            uint64_t sum = 0;
            for (uint64_t i = 0; i < len; i++) sum += body[i];
            ok = ok && r.value == sum;
        } else {
            for (uint64_t i = 0; i < len && ok; i++) ok = back[i] == body[len - 1 - i];
        }
        if (!ok) { fprintf(stderr, "rank %zu: call %u (op %u, %llu bytes): wrong reply\n", me, id, q.op, (unsigned long long)len); exit(1); }
        free(body);
        free(back);
    }
    Request bye = {.op = OP_BYE, .id = 0, .len = 0};
    MadPacker *p;
    CHECK(mad_begin_packing(ch, 0, &p));
    CHECK(mad_pack(p, &bye, sizeof bye, MAD_SEND_SAFER, MAD_RECV_EXPRESS));
    CHECK(mad_pack(p, NULL, 0, MAD_SEND_CHEAPER, MAD_RECV_CHEAPER));
    CHECK(mad_end_packing(p));
    printf("rank %zu: %zu calls, every reply right\n", me, calls);
}

int main(int argc, char **argv) {
    size_t calls = 200;
    int i0 = argc > 1 && !strcmp(argv[1], "--") ? 2 : 1; /* madrun passes its `--` on */
    if (argc == i0 + 2 && !strcmp(argv[i0], "--calls")) calls = strtoull(argv[i0 + 1], NULL, 10);
    MadSession *s;
    MadChannel *ch;
    CHECK(mad_session_init(&s));
    CHECK(mad_channel_open(s, "default", &ch));
    size_t me = mad_session_rank(s), size = mad_session_size(s);
    if (size < 2) { fprintf(stderr, "rpc needs two processes or more\n"); return 2; }
    if (me == 0) serve(ch, size - 1); else call(ch, me, calls);
    mad_channel_free(ch);
    mad_session_free(s);
    return 0;
}
