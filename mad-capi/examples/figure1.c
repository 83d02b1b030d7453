/* The paper's Figure 1 in C: rank 0 sends each other rank an EXPRESS size followed by a
 * CHEAPER array of that size; each receiver allocates the array from what it just read.
 *   madrun -n 4 ./figure1        (MAD_CHANNEL_DEFAULT=tcp or shm picks the network) */
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include "madeleine.h"

#define CHECK(call)                                                                 \
    do {                                                                            \
        int rc_ = (call);                                                           \
        if (rc_ != MAD_OK) {                                                        \
            fprintf(stderr, "figure1: %s: %s (%s)\n", #call, mad_status_name(rc_),  \
                    mad_last_error());                                              \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

int main(void) {
    MadSession *s;
    MadChannel *ch;
    CHECK(mad_session_init(&s));
    CHECK(mad_channel_open(s, "default", &ch));
    size_t rank = mad_session_rank(s), size = mad_session_size(s);
    if (rank == 0) {
        for (size_t peer = 1; peer < size; peer++) {
            uint64_t n = 1000 * peer + 100000 * (peer == 1); /* one beyond the small buffers */
            uint8_t *array = malloc(n);
            for (uint64_t i = 0; i < n; i++) array[i] = (uint8_t)(i % 251);
            MadPacker *p;
            CHECK(mad_begin_packing(ch, peer, &p));
            CHECK(mad_pack(p, &n, sizeof n, MAD_SEND_SAFER, MAD_RECV_EXPRESS));
            CHECK(mad_pack(p, array, n, MAD_SEND_CHEAPER, MAD_RECV_CHEAPER));
            CHECK(mad_end_packing(p));
            free(array);
        }
        printf("rank 0: sent %zu arrays\n", size - 1);
    } else {
        MadUnpacker *u;
        uint64_t n;
        CHECK(mad_begin_unpacking(ch, &u));
        size_t from = mad_unpacker_remote(u);
        CHECK(mad_unpack(u, &n, sizeof n, MAD_SEND_SAFER, MAD_RECV_EXPRESS));
        uint8_t *array = malloc(n ? n : 1); /* allocated from what was just received */
        CHECK(mad_unpack(u, array, n, MAD_SEND_CHEAPER, MAD_RECV_CHEAPER));
        CHECK(mad_end_unpacking(u));
        for (uint64_t i = 0; i < n; i++) {
            if (array[i] != (uint8_t)(i % 251)) {
                fprintf(stderr, "rank %zu: byte %llu corrupt\n", rank, (unsigned long long)i);
                return 1;
            }
        }
        printf("rank %zu: received %llu bytes from rank %zu, intact\n", rank,
               (unsigned long long)n, from);
        free(array);
    }
    MadStats st;
    CHECK(mad_channel_stats(ch, &st));
    if (st.messages_sent + st.messages_received != (rank == 0 ? size - 1 : 1)) {
        fprintf(stderr, "rank %zu: stats count %llu messages\n", rank,
                (unsigned long long)(st.messages_sent + st.messages_received));
        return 1;
    }
    mad_channel_free(ch);
    mad_session_free(s);
    return 0;
}
