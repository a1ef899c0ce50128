/* The NCCL half of ddp_cuda.cu's glue, which the CUDA harness build leaves out (it has no NCCL): every
   call fails with DDP_ERR_UNSUPPORTED. For the harness tests of the cpu backend's device paths
   (test_cuda_devbuf, test_cuda_checkpoint), which never reach the nccl backend. Include once, after ddp.h.
   Built with the fake NCCL (-DDDP_HARNESS_NCCL: tests/cuda_harness/nccl.h, run_test.sh's NCCL=1),
   ddp_cuda.cu defines the real glue and this file defines nothing. */
#ifndef DDP_TEST_NCCL_ABSENT_H
#define DDP_TEST_NCCL_ABSENT_H
#ifndef DDP_HARNESS_NCCL
static ddp_result nccl_absent(char *err, size_t err_size) {
    if (err && err_size) snprintf(err, err_size, "no NCCL in the CUDA harness");
    return DDP_ERR_UNSUPPORTED;
}
ddp_result ddp__cuda_nccl_device(int, int *, char *err, size_t err_size) { return nccl_absent(err, err_size); }
ddp_result ddp__cuda_nccl_unique_id(unsigned char *, char *err, size_t err_size) { return nccl_absent(err, err_size); }
ddp_result ddp__cuda_nccl_create(const unsigned char *, int, int, int, int, double, ddp__cuda_nccl **, char *err,
                                 size_t err_size) {
    return nccl_absent(err, err_size);
}
int ddp__cuda_nccl_can_shrink(const ddp__cuda_nccl *) { return 0; }
ddp_result ddp__cuda_nccl_shrink(ddp__cuda_nccl *, const int *, int, ddp__cuda_nccl **, char *err, size_t err_size) {
    return nccl_absent(err, err_size);
}
void ddp__cuda_nccl_destroy(ddp__cuda_nccl *, int) {}
void ddp__cuda_nccl_set_stream(ddp__cuda_nccl *, void *) {}
void *ddp__cuda_nccl_stream(const ddp__cuda_nccl *) { return NULL; }
int ddp__cuda_nccl_device_of(const ddp__cuda_nccl *) { return -1; }
ddp_result ddp__cuda_nccl_enqueue(ddp__cuda_nccl *, ddp__cuda_coll, const void *, void *, size_t, ddp_dtype, ddp_op, int,
                                  void **, char *err, size_t err_size) {
    return nccl_absent(err, err_size);
}
ddp_result ddp__cuda_nccl_enqueue_v(ddp__cuda_nccl *, ddp__cuda_coll, const void *, const size_t *, void *, const size_t *,
                                    ddp_dtype, void **, char *err, size_t err_size) {
    return nccl_absent(err, err_size);
}
ddp_result ddp__cuda_nccl_copy(ddp__cuda_nccl *, void *, const void *, size_t, void **, char *err, size_t err_size) {
    return nccl_absent(err, err_size);
}
ddp_result ddp__cuda_nccl_alloc(ddp__cuda_nccl *, size_t, void **, char *err, size_t err_size) { return nccl_absent(err, err_size); }
ddp_result ddp__cuda_nccl_zero(ddp__cuda_nccl *, void *, size_t, char *err, size_t err_size) { return nccl_absent(err, err_size); }
void ddp__cuda_nccl_free(ddp__cuda_nccl *, void *) {}
ddp_result ddp__cuda_nccl_wait(ddp__cuda_nccl *, void *, double, const char *, ddp_result (*)(void *), void *, char *err,
                               size_t err_size) {
    return nccl_absent(err, err_size);
}
int ddp__cuda_nccl_test(ddp__cuda_nccl *, void *) { return 1; }
#endif /* !DDP_HARNESS_NCCL */
#endif
