/* The share of a parallel loop one OpenMP thread takes (every native kernel splits its work so). */
#ifndef DSV41_SPAN_H
#define DSV41_SPAN_H

#include <stdint.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

typedef struct {
    int64_t begin, end;  /* this thread's items, begin … end − 1, of the loop's total */
    int index;           /* the thread's number in its team (0 outside a parallel region) */
} Span;

static inline Span thread_span(int64_t total) {
    int t = 0, nt = 1;
#if defined(_OPENMP)
    t = omp_get_thread_num();
    nt = omp_get_num_threads();
#endif
    const Span span = {total * t / nt, total * (t + 1) / nt, t};
    return span;
}

#endif
