/* CHECK, the tests' assertion, alone: included by testlib.h, and by the tests that do not include testlib.h
   because they must not compile the library's implementation (test_cuda_kernels.cpp). */
#ifndef DDP_TEST_CHECK_H
#define DDP_TEST_CHECK_H
#include <stdio.h>
#include <stdlib.h>

/* CHECK(cond, "format", ...): on failure print where and why, and exit 1. */
#define CHECK(cond, ...)                                                                      \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond);          \
            fprintf(stderr, __VA_ARGS__);                                                     \
            fprintf(stderr, "\n");                                                            \
            fflush(stderr);                                                                   \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

#endif
