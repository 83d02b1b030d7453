/* PMPI shim: counts the point-to-point MPI calls of a process and prints them at MPI_Finalize
 * (stderr, one line per rank). Built and preloaded by `mad-mpi/bench.sh count`:
 *     mpicc.mpich -O2 -shared -fPIC -o libmpicount.so mad-mpi/tools/mpicount.c
 *     mpiexec.mpich -n 2 -env LD_PRELOAD $PWD/libmpicount.so target-mpich/release/mad-bench ...
 * Single counters without atomics: exact for the benchmarks' one thread per rank. */
#include <mpi.h>
#include <stdio.h>

static unsigned long n_send, n_isend, n_recv, n_irecv, n_test, n_testsome, n_getcount, n_iprobe,
    n_improbe, n_mrecv, n_start;

int MPI_Send(const void *b, int c, MPI_Datatype d, int dst, int t, MPI_Comm cm) {
    n_send++;
    return PMPI_Send(b, c, d, dst, t, cm);
}
int MPI_Isend(const void *b, int c, MPI_Datatype d, int dst, int t, MPI_Comm cm, MPI_Request *r) {
    n_isend++;
    return PMPI_Isend(b, c, d, dst, t, cm, r);
}
int MPI_Recv(void *b, int c, MPI_Datatype d, int s, int t, MPI_Comm cm, MPI_Status *st) {
    n_recv++;
    return PMPI_Recv(b, c, d, s, t, cm, st);
}
int MPI_Irecv(void *b, int c, MPI_Datatype d, int s, int t, MPI_Comm cm, MPI_Request *r) {
    n_irecv++;
    return PMPI_Irecv(b, c, d, s, t, cm, r);
}
int MPI_Test(MPI_Request *r, int *f, MPI_Status *st) {
    n_test++;
    return PMPI_Test(r, f, st);
}
int MPI_Testsome(int n, MPI_Request *r, int *o, int *i, MPI_Status *st) {
    n_testsome++;
    return PMPI_Testsome(n, r, o, i, st);
}
int MPI_Get_count(const MPI_Status *st, MPI_Datatype d, int *c) {
    n_getcount++;
    return PMPI_Get_count(st, d, c);
}
int MPI_Iprobe(int s, int t, MPI_Comm cm, int *f, MPI_Status *st) {
    n_iprobe++;
    return PMPI_Iprobe(s, t, cm, f, st);
}
int MPI_Improbe(int s, int t, MPI_Comm cm, int *f, MPI_Message *m, MPI_Status *st) {
    n_improbe++;
    return PMPI_Improbe(s, t, cm, f, m, st);
}
int MPI_Mrecv(void *b, int c, MPI_Datatype d, MPI_Message *m, MPI_Status *st) {
    n_mrecv++;
    return PMPI_Mrecv(b, c, d, m, st);
}
int MPI_Start(MPI_Request *r) {
    n_start++;
    return PMPI_Start(r);
}
int MPI_Finalize(void) {
    int me = -1;
    PMPI_Comm_rank(MPI_COMM_WORLD, &me);
    fprintf(stderr,
            "mpicount rank %d: Send %lu Isend %lu Recv %lu Irecv %lu Test %lu Testsome %lu "
            "Get_count %lu Iprobe %lu Improbe %lu Mrecv %lu Start %lu\n",
            me, n_send, n_isend, n_recv, n_irecv, n_test, n_testsome, n_getcount, n_iprobe,
            n_improbe, n_mrecv, n_start);
    return PMPI_Finalize();
}
