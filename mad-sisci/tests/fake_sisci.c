/*
 * A stand-in for Dolphin's libsisci.so, for mad-sisci's tests only (tests/dolphin_fake.rs
 * builds it with the system C compiler). It is NOT Dolphin's library and proves nothing about
 * it: it implements the subset of the SISCI API that mad-sisci's `dolphin` backend calls, as
 * this project reads Dolphin's public API reference, inside one process ("one node"):
 * segments are heap blocks, a remote mapping is the same memory, DMA is memcpy, a store
 * barrier is a full fence. What it buys: the backend's whole call sequence (open, id probing,
 * connect, map, barriers, DMA, PIO fallback, close in reverse order) runs, with strict
 * checks of the order of releases, alignment, bounds and leaks.
 *
 * Build variants (macros): FAKE_ST exports the _SISCI_PUBLIC_FUNC_ST_ names (default _MT_),
 * FAKE_BARE the bare names, FAKE_NO_DMA leaves the DMA calls out.
 *
 * Environment: FAKE_SISCI_NODE (node id, default 8), FAKE_SISCI_TAKEN (comma-separated
 * segment ids already "in use on this node", read at the first SCIInitialize),
 * FAKE_SISCI_DMA_FAIL (if set, SCIStartDmaTransfer fails with SCI_ERR_ILLEGAL_OPERATION),
 * FAKE_SISCI_LOST_FILE (a file of hexadecimal segment ids whose connections report
 * SCI_CB_LOST from then on: a peer dead without closing),
 * FAKE_SISCI_REPORT (a file the library appends "clean <dma transfers> <store barriers>
 * <taken-id collisions>" to each time it is unloaded with nothing left; it aborts the process
 * instead if anything leaked or SCIInitialize/SCITerminate do not pair).
 */

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(FAKE_BARE)
#define F(n) n
#elif defined(FAKE_ST)
#define F(n) _SISCI_PUBLIC_FUNC_ST_##n
#else
#define F(n) _SISCI_PUBLIC_FUNC_MT_##n
#endif

typedef unsigned int sci_error_t;
#define M 0x40000000u
#define OK 0u
#define E_BUSY (0x900u | M)
#define E_NO_SUCH_ADAPTERNO (0x909u | M)
#define E_OUT_OF_RANGE (0x90Bu | M)
#define E_NO_SUCH_SEGMENT (0x90Cu | M)
#define E_SIZE_ALIGNMENT (0x910u | M)
#define E_OFFSET_ALIGNMENT (0x911u | M)
#define E_ILLEGAL_PARAMETER (0x912u | M)
#define E_NOT_PREPARED (0x914u | M)
#define E_ILLEGAL_OPERATION (0x916u | M)
#define E_TIMEOUT (0x90Au | M)
#define E_SEGMENTID_USED (0x918u | M)
#define E_NOT_INITIALIZED (0x920u | M)
#define E_NO_SUCH_NODEID (0xA00u | M)

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int inits, taken_read;
static long live, dma_transfers, barriers, collisions;

struct seg {
    struct seg *next;
    unsigned id;
    size_t size;
    unsigned char *mem;
    int phantom, prepared, available, maps, connections;
};
static struct seg *segs;

struct sci_desc { int objects; };
struct sci_local_segment { struct sci_desc *d; struct seg *s; };
struct sci_remote_segment { struct sci_desc *d; struct seg *s; int maps; };
struct sci_map { struct seg *s; struct sci_remote_segment *r; int seqs; };
struct sci_sequence { struct sci_map *m; };
struct sci_dma_queue { struct sci_desc *d; unsigned state; };

static void die(const char *what)
{
    fprintf(stderr, "fake_sisci: misuse: %s\n", what);
    abort();
}

static unsigned node(void)
{
    const char *e = getenv("FAKE_SISCI_NODE");
    return e ? (unsigned)strtoul(e, NULL, 0) : 8;
}

static struct seg *find(unsigned id)
{
    for (struct seg *s = segs; s; s = s->next)
        if (s->id == id)
            return s;
    return NULL;
}

static struct seg *add(unsigned id, size_t size, int phantom)
{
    struct seg *s = calloc(1, sizeof *s);
    if (!s)
        die("out of memory");
    s->id = id;
    s->size = size;
    s->phantom = phantom;
    if (!phantom) {
        size_t rounded = (size + 4095) & ~(size_t)4095;
        s->mem = aligned_alloc(4096, rounded ? rounded : 4096);
        if (!s->mem)
            die("out of memory");
        memset(s->mem, 0xA5, rounded); /* not zeroed: the user must initialize it */
    }
    s->next = segs;
    segs = s;
    return s;
}

static void unlink_seg(struct seg *s)
{
    for (struct seg **p = &segs; *p; p = &(*p)->next)
        if (*p == s) {
            *p = s->next;
            free(s->mem);
            free(s);
            return;
        }
    die("unknown segment");
}

void F(SCIInitialize)(unsigned flags, sci_error_t *err)
{
    (void)flags;
    pthread_mutex_lock(&mu);
    inits++;
    if (!taken_read) {
        taken_read = 1;
        const char *t = getenv("FAKE_SISCI_TAKEN");
        while (t && *t) {
            char *end;
            unsigned long id = strtoul(t, &end, 0);
            if (end == t)
                break;
            add((unsigned)id, 0, 1);
            t = *end == ',' ? end + 1 : end;
        }
    }
    pthread_mutex_unlock(&mu);
    *err = OK;
}

void F(SCITerminate)(void)
{
    pthread_mutex_lock(&mu);
    if (inits <= 0)
        die("SCITerminate without SCIInitialize");
    inits--;
    pthread_mutex_unlock(&mu);
}

void F(SCIOpen)(struct sci_desc **sd, unsigned flags, sci_error_t *err)
{
    (void)flags;
    pthread_mutex_lock(&mu);
    if (!inits) {
        *err = E_NOT_INITIALIZED;
    } else {
        *sd = calloc(1, sizeof **sd);
        live++;
        *err = OK;
    }
    pthread_mutex_unlock(&mu);
}

void F(SCIClose)(struct sci_desc *sd, unsigned flags, sci_error_t *err)
{
    (void)flags;
    pthread_mutex_lock(&mu);
    if (sd->objects) {
        fprintf(stderr, "fake_sisci: %d object(s) of this descriptor left\n", sd->objects);
        die("SCIClose with segments, maps or queues still open");
    }
    free(sd);
    live--;
    pthread_mutex_unlock(&mu);
    *err = OK;
}

void F(SCIGetLocalNodeId)(unsigned adapter, unsigned *id, unsigned flags, sci_error_t *err)
{
    (void)flags;
    if (adapter != 0) {
        *err = E_NO_SUCH_ADAPTERNO;
        return;
    }
    *id = node();
    *err = OK;
}

void F(SCICreateSegment)(struct sci_desc *sd, struct sci_local_segment **seg, unsigned id,
                         size_t size, void *cb, void *arg, unsigned flags, sci_error_t *err)
{
    (void)arg;
    (void)flags;
    if (cb || size == 0) {
        *err = E_ILLEGAL_PARAMETER;
        return;
    }
    pthread_mutex_lock(&mu);
    struct seg *s = find(id);
    if (s) {
        if (s->phantom)
            collisions++;
        *err = E_SEGMENTID_USED;
    } else {
        *seg = calloc(1, sizeof **seg);
        (*seg)->d = sd;
        (*seg)->s = add(id, size, 0);
        sd->objects++;
        live++;
        *err = OK;
    }
    pthread_mutex_unlock(&mu);
}

void F(SCIPrepareSegment)(struct sci_local_segment *seg, unsigned adapter, unsigned flags,
                          sci_error_t *err)
{
    (void)flags;
    if (adapter != 0) {
        *err = E_NO_SUCH_ADAPTERNO;
        return;
    }
    seg->s->prepared = 1;
    *err = OK;
}

void F(SCISetSegmentAvailable)(struct sci_local_segment *seg, unsigned adapter, unsigned flags,
                               sci_error_t *err)
{
    (void)adapter;
    (void)flags;
    pthread_mutex_lock(&mu);
    if (!seg->s->prepared) {
        *err = E_NOT_PREPARED;
    } else {
        seg->s->available = 1;
        *err = OK;
    }
    pthread_mutex_unlock(&mu);
}

void F(SCISetSegmentUnavailable)(struct sci_local_segment *seg, unsigned adapter,
                                 unsigned flags, sci_error_t *err)
{
    (void)adapter;
    (void)flags;
    pthread_mutex_lock(&mu);
    seg->s->available = 0;
    pthread_mutex_unlock(&mu);
    *err = OK;
}

void F(SCIRemoveSegment)(struct sci_local_segment *seg, unsigned flags, sci_error_t *err)
{
    (void)flags;
    pthread_mutex_lock(&mu);
    if (seg->s->maps || seg->s->connections) {
        if (getenv("FAKE_SISCI_TRACE"))
            fprintf(stderr, "fake_sisci: remove segment %x busy: %d map(s), %d connection(s)\n",
                    seg->s->id, seg->s->maps, seg->s->connections);
        *err = E_BUSY;
    } else {
        seg->d->objects--;
        unlink_seg(seg->s);
        free(seg);
        live--;
        *err = OK;
    }
    pthread_mutex_unlock(&mu);
}

static void *map(struct seg *s, struct sci_remote_segment *r, struct sci_map **m, size_t off,
                 size_t size, void *addr, unsigned flags, sci_error_t *err)
{
    if (addr || flags) {
        *err = E_ILLEGAL_PARAMETER;
        return NULL;
    }
    if (off > s->size || size > s->size - off) {
        *err = E_OUT_OF_RANGE;
        return NULL;
    }
    pthread_mutex_lock(&mu);
    *m = calloc(1, sizeof **m);
    (*m)->s = s;
    (*m)->r = r;
    if (r)
        r->maps++;
    else
        s->maps++;
    live++;
    pthread_mutex_unlock(&mu);
    *err = OK;
    return s->mem + off;
}

void *F(SCIMapLocalSegment)(struct sci_local_segment *seg, struct sci_map **m, size_t off,
                            size_t size, void *addr, unsigned flags, sci_error_t *err)
{
    return map(seg->s, NULL, m, off, size, addr, flags, err);
}

void *F(SCIMapRemoteSegment)(struct sci_remote_segment *seg, struct sci_map **m, size_t off,
                             size_t size, void *addr, unsigned flags, sci_error_t *err)
{
    return map(seg->s, seg, m, off, size, addr, flags, err);
}

void F(SCIUnmapSegment)(struct sci_map *m, unsigned flags, sci_error_t *err)
{
    (void)flags;
    pthread_mutex_lock(&mu);
    if (m->seqs)
        die("SCIUnmapSegment with a live sequence");
    if (m->r)
        m->r->maps--;
    else
        m->s->maps--;
    free(m);
    live--;
    pthread_mutex_unlock(&mu);
    *err = OK;
}

void F(SCIConnectSegment)(struct sci_desc *sd, struct sci_remote_segment **seg, unsigned nodeid,
                          unsigned id, unsigned adapter, void *cb, void *arg, unsigned timeout,
                          unsigned flags, sci_error_t *err)
{
    (void)arg;
    (void)flags;
    if (cb || adapter != 0) {
        *err = cb ? E_ILLEGAL_PARAMETER : E_NO_SUCH_ADAPTERNO;
        return;
    }
    if (nodeid != node()) {
        *err = E_NO_SUCH_NODEID;
        return;
    }
    for (unsigned waited = 0;; waited++) {
        pthread_mutex_lock(&mu);
        struct seg *s = find(id);
        if (s && !s->phantom && s->available) {
            *seg = calloc(1, sizeof **seg);
            (*seg)->d = sd;
            (*seg)->s = s;
            s->connections++;
            sd->objects++;
            live++;
            pthread_mutex_unlock(&mu);
            *err = OK;
            return;
        }
        pthread_mutex_unlock(&mu);
        if (waited >= timeout) {
            *err = E_NO_SUCH_SEGMENT;
            return;
        }
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
}

void F(SCIDisconnectSegment)(struct sci_remote_segment *seg, unsigned flags, sci_error_t *err)
{
    (void)flags;
    pthread_mutex_lock(&mu);
    if (seg->maps) {
        *err = E_BUSY;
    } else {
        seg->s->connections--;
        seg->d->objects--;
        free(seg);
        live--;
        *err = OK;
    }
    pthread_mutex_unlock(&mu);
}

unsigned F(SCIWaitForRemoteSegmentEvent)(struct sci_remote_segment *seg, sci_error_t *status,
                                         unsigned timeout, unsigned flags, sci_error_t *err)
{
    (void)flags;
    if (timeout != 0)
        die("blocking SCIWaitForRemoteSegmentEvent");
    pthread_mutex_lock(&mu);
    int gone = !seg->s->available;
    unsigned id = seg->s->id;
    pthread_mutex_unlock(&mu);
    *status = OK;
    if (gone) {
        *err = OK;
        return 2; /* SCI_CB_DISCONNECT */
    }
    const char *lost = getenv("FAKE_SISCI_LOST_FILE");
    FILE *f = lost ? fopen(lost, "r") : NULL;
    if (f) {
        unsigned l;
        while (fscanf(f, "%x", &l) == 1)
            if (l == id)
                gone = 1;
        fclose(f);
        if (gone) {
            *err = OK;
            return 5; /* SCI_CB_LOST */
        }
    }
    *err = E_TIMEOUT;
    return 0;
}

void F(SCICreateMapSequence)(struct sci_map *m, struct sci_sequence **seq, unsigned flags,
                             sci_error_t *err)
{
    (void)flags;
    pthread_mutex_lock(&mu);
    *seq = calloc(1, sizeof **seq);
    (*seq)->m = m;
    m->seqs++;
    live++;
    pthread_mutex_unlock(&mu);
    *err = OK;
}

void F(SCIRemoveSequence)(struct sci_sequence *seq, unsigned flags, sci_error_t *err)
{
    (void)flags;
    pthread_mutex_lock(&mu);
    seq->m->seqs--;
    free(seq);
    live--;
    pthread_mutex_unlock(&mu);
    *err = OK;
}

void F(SCIStoreBarrier)(struct sci_sequence *seq, unsigned flags)
{
    (void)flags;
    if (!seq)
        die("SCIStoreBarrier without a sequence");
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    __atomic_fetch_add(&barriers, 1, __ATOMIC_RELAXED);
}

#ifndef FAKE_NO_DMA
void F(SCICreateDMAQueue)(struct sci_desc *sd, struct sci_dma_queue **dq, unsigned adapter,
                          unsigned entries, unsigned flags, sci_error_t *err)
{
    (void)flags;
    if (adapter != 0 || entries < 1) {
        *err = adapter ? E_NO_SUCH_ADAPTERNO : E_ILLEGAL_PARAMETER;
        return;
    }
    pthread_mutex_lock(&mu);
    *dq = calloc(1, sizeof **dq);
    (*dq)->d = sd;
    sd->objects++;
    live++;
    pthread_mutex_unlock(&mu);
    *err = OK;
}

void F(SCIRemoveDMAQueue)(struct sci_dma_queue *dq, unsigned flags, sci_error_t *err)
{
    (void)flags;
    pthread_mutex_lock(&mu);
    dq->d->objects--;
    free(dq);
    live--;
    pthread_mutex_unlock(&mu);
    *err = OK;
}

void F(SCIStartDmaTransfer)(struct sci_dma_queue *dq, struct sci_local_segment *l,
                            struct sci_remote_segment *r, size_t loff, size_t size, size_t roff,
                            void *cb, void *arg, unsigned flags, sci_error_t *err)
{
    (void)arg;
    (void)flags;
    if (cb) {
        *err = E_ILLEGAL_PARAMETER;
    } else if (getenv("FAKE_SISCI_DMA_FAIL")) {
        *err = E_ILLEGAL_OPERATION; /* e.g. no DMA engine for this path */
    } else if (loff % 8 || roff % 8) {
        *err = E_OFFSET_ALIGNMENT;
    } else if (size == 0 || size % 8) {
        *err = E_SIZE_ALIGNMENT;
    } else if (loff > l->s->size || size > l->s->size - loff || roff > r->s->size ||
               size > r->s->size - roff) {
        *err = E_OUT_OF_RANGE;
    } else if (!l->s->prepared) {
        *err = E_NOT_PREPARED;
    } else {
        memcpy(r->s->mem + roff, l->s->mem + loff, size);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        dq->state = 3; /* SCI_DMAQUEUE_DONE */
        __atomic_fetch_add(&dma_transfers, 1, __ATOMIC_RELAXED);
        *err = OK;
        return;
    }
    dq->state = 5; /* SCI_DMAQUEUE_ERROR */
}

unsigned F(SCIWaitForDMAQueue)(struct sci_dma_queue *dq, unsigned timeout, unsigned flags,
                               sci_error_t *err)
{
    (void)timeout;
    (void)flags;
    *err = OK;
    return dq->state;
}
#endif

__attribute__((destructor)) static void report(void)
{
    long leaked = live;
    int unpaired = inits;
    if (leaked || unpaired) {
        fprintf(stderr, "fake_sisci: unloaded with %ld live object(s), %d unpaired SCIInitialize\n",
                leaked, unpaired);
        abort();
    }
    const char *path = getenv("FAKE_SISCI_REPORT");
    if (path) {
        FILE *f = fopen(path, "a");
        if (f) {
            fprintf(f, "clean %ld %ld %ld\n", dma_transfers, barriers, collisions);
            fclose(f);
        }
    }
}
