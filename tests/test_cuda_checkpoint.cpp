/* tests/test_cuda_checkpoint.cpp: checkpoints of device tensors (src/checkpoint.c, "device tensors"),
   without a GPU. Built by tests/test_cuda_checkpoint.sh with a host C++17 compiler against the CUDA
   harness (tests/cuda_harness), whose "device" memory is PROT_NONE to the host (a host read or write that
   bypasses staging is a SIGSEGV) and whose async copies run only when something synchronises (a save_async
   that returned before its snapshot was copied would write the values overwritten after the call).

   1, 2 and 3 ranks, tensors f32 / bf16 / f16 on the device and an f32 one in host memory, stream set by
   ddp_set_stream:
     save        of the device tensors = byte for byte the file saved from host copies of the same values
     save_async  the same, while the program overwrites its device tensors right after the call returns
     load        into device tensors (every rank reads; rank 0 reads and broadcasts) gives the values back
     shards      save_shard / load_shard of per-rank device tensors; save_slices of device slices
     faults      a device copy that CUDA refuses (a tensor longer than its allocation) fails the save and the
                 async save on every rank, naming the copy on rank 0; no file, no .tmp left
   Every staging copy goes through pinned host memory (the harness counts pageable async copies). */
#define DDP_CUDA
#include "testlib.h"

#include <cuda_runtime.h>
#include <string>
#include <deque>
#include <vector>

#include "nccl_absent.h" /* the NCCL glue, never reached here */
#include "device_ranks.h" /* device_rank_begin / device_rank_end */

/* ---- tensors ---- */

#define NT 4
static const ddp_dtype dtypes[NT] = {DDP_F32, DDP_BF16, DDP_F16, DDP_F32};
static const int64_t counts[NT] = {1000, 300, 77, 50};
static const char *const names[NT] = {"layer.weight", "layer.bias", "emb.half", "host.step"};
static const int on_device[NT] = {1, 1, 1, 0}; /* the last one stays in host memory */

static cudaStream_t stream;
static std::string dir;

static size_t nbytes(int i) { return (size_t)counts[i] * ddp_dtype_size(dtypes[i]); }

/* Element j of tensor i, labelled salt: small integers, exact in bf16 and f16. */
static void fill_host(void *h, int i, int salt) {
    for (int64_t j = 0; j < counts[i]; j++) {
        float v = (float)((j * 7 + i * 3 + salt) % 61) - 30.0f;
        if (dtypes[i] == DDP_F32) ((float *)h)[j] = v;
        else if (dtypes[i] == DDP_BF16) ((uint16_t *)h)[j] = ddp_f32_to_bf16(v);
        else ((uint16_t *)h)[j] = ddp_f32_to_f16(v);
    }
}

/* Tensors holding salt's values: host memory for all (host = 1) or as on_device says. */
static void make(ddp_tensor *t, int salt, int host, int rank_in_name = -1) {
    static std::deque<std::string> keep; /* push_back keeps the earlier names where they are */
    for (int i = 0; i < NT; i++) {
        void *h = malloc(nbytes(i)), *p = h;
        fill_host(h, i, salt);
        if (!host && on_device[i]) {
            CHECK(cudaMalloc(&p, nbytes(i)) == cudaSuccess, "cudaMalloc");
            CHECK(cudaMemcpy(p, h, nbytes(i), cudaMemcpyHostToDevice) == cudaSuccess, "cudaMemcpy");
            free(h);
        }
        memset(&t[i], 0, sizeof t[i]);
        if (rank_in_name >= 0) {
            keep.push_back(std::string(names[i]) + ".r" + std::to_string(rank_in_name));
            t[i].name = keep.back().c_str();
        } else t[i].name = names[i];
        t[i].dtype = dtypes[i];
        t[i].ndim = 1;
        t[i].shape[0] = counts[i];
        t[i].data = p;
    }
}

static void release(ddp_tensor *t) {
    for (int i = 0; i < NT; i++) {
        if (ddp__cuda_is_device_pointer(t[i].data)) cudaFree(t[i].data);
        else free(t[i].data);
    }
}

/* Overwrite every tensor with salt's values, as a training step would (the device ones by a copy). */
static void overwrite(ddp_tensor *t, int salt) {
    for (int i = 0; i < NT; i++) {
        void *h = malloc(nbytes(i));
        fill_host(h, i, salt);
        if (on_device[i]) CHECK(cudaMemcpy(t[i].data, h, nbytes(i), cudaMemcpyHostToDevice) == cudaSuccess, "cudaMemcpy");
        else memcpy(t[i].data, h, nbytes(i));
        free(h);
    }
}

/* Tensor i holds salt's values (read as a program would: a copy on the stream, then wait). */
static void expect_values(const char *what, const ddp_tensor *t, int salt) {
    for (int i = 0; i < NT; i++) {
        void *want = malloc(nbytes(i)), *got = malloc(nbytes(i)), *pinned = NULL;
        fill_host(want, i, salt);
        if (ddp__cuda_is_device_pointer(t[i].data)) {
            CHECK(cudaMallocHost(&pinned, nbytes(i)) == cudaSuccess, "cudaMallocHost");
            CHECK(cudaMemcpyAsync(pinned, t[i].data, nbytes(i), cudaMemcpyDeviceToHost, stream) == cudaSuccess, "copy");
            CHECK(cudaStreamSynchronize(stream) == cudaSuccess, "sync");
            memcpy(got, pinned, nbytes(i));
            cudaFreeHost(pinned);
        } else memcpy(got, t[i].data, nbytes(i));
        CHECK(memcmp(want, got, nbytes(i)) == 0, "%s: tensor %s does not hold the saved values", what, t[i].name);
        free(want);
        free(got);
    }
}

static std::string slurp(const std::string &path) {
    FILE *f = fopen(path.c_str(), "rb");
    std::string s;
    char buf[65536];
    size_t n;
    CHECK(f != NULL, "cannot open %s", path.c_str());
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
    fclose(f);
    return s;
}

static int exists(const std::string &path) { return access(path.c_str(), F_OK) == 0; }

/* ---- the cases ---- */

static void t_save_load(ddp_group *g, int rank, int n) {
    std::string tag = std::to_string(n), ref = dir + "/ref" + tag + ".safetensors", sync = dir + "/dev" + tag + ".safetensors",
                as = dir + "/async" + tag + ".safetensors";
    ddp_tensor host[NT], devt[NT], back[NT];
    ddp_work *w = NULL;
    make(host, 11, 1);
    make(devt, 11, 0);
    CHECK_OK(ddp_checkpoint_save(g, ref.c_str(), host, NT, NULL), g);
    CHECK_OK(ddp_checkpoint_save(g, sync.c_str(), devt, NT, NULL), g);
    if (rank == 0) CHECK(slurp(sync) == slurp(ref), "save of device tensors: the file differs from the one saved from host memory");

    CHECK_OK(ddp_checkpoint_save_async(g, as.c_str(), devt, NT, NULL, &w), g);
    overwrite(devt, 12); /* right after the call: the snapshot must already be taken */
    CHECK_OK(ddp_wait(w), g);
    if (rank == 0) CHECK(slurp(as) == slurp(ref), "save_async of device tensors: the file differs from the one saved from host memory");
    expect_values("after save_async and the overwrite", devt, 12);

    /* a second async save reuses the pinned staging memory */
    CHECK_OK(ddp_checkpoint_save_async(g, as.c_str(), devt, NT, NULL, &w), g);
    overwrite(devt, 13);
    CHECK_OK(ddp_wait(w), g);
    make(back, 99, 0);
    CHECK_OK(ddp_checkpoint_load(g, as.c_str(), back, NT, NULL), g);
    expect_values("load of the second async save", back, 12);

    CHECK_OK(ddp_checkpoint_load(g, ref.c_str(), back, NT, NULL), g);
    expect_values("load into device tensors", back, 11);
    {
        ddp_checkpoint_load_desc d;
        memset(&d, 0, sizeof d);
        d.broadcast = 1;
        overwrite(back, 98);
        CHECK_OK(ddp_checkpoint_load_ex(g, sync.c_str(), back, NT, NULL, &d), g);
        expect_values("load (rank 0 reads and broadcasts) into device tensors", back, 11);
    }
    release(host);
    release(devt);
    release(back);
}

static void t_shards(ddp_group *g, int rank, int n) {
    std::string path = dir + "/shard" + std::to_string(n) + ".safetensors";
    ddp_tensor devt[NT], back[NT];
    make(devt, 20 + rank, 0, rank);
    CHECK_OK(ddp_checkpoint_save_shard(g, path.c_str(), devt, NT, NULL, NULL), g);
    make(back, 97, 0, rank);
    CHECK_OK(ddp_checkpoint_load_shard(g, path.c_str(), back, NT, NULL, NULL), g);
    expect_values("load_shard into device tensors", back, 20 + rank);
    release(devt);
    release(back);
}

/* save_slices (a shard save) of device slices of one global f32 tensor; load_slices into host memory
   (its reads are host memcpys: device slices are not taken there yet) gives the whole tensor back. */
static void t_slices(ddp_group *g, int rank, int n) {
    std::string path = dir + "/slices" + std::to_string(n) + ".safetensors";
    const size_t per = 37, total = per * (size_t)n;
    std::vector<float> mine(per), all(total, -1.0f);
    ddp_slice s;
    void *d = NULL;
    for (size_t j = 0; j < per; j++) mine[j] = (float)(rank * 1000 + (int)j);
    CHECK(cudaMalloc(&d, per * sizeof(float)) == cudaSuccess, "cudaMalloc");
    CHECK(cudaMemcpy(d, mine.data(), per * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess, "cudaMemcpy");
    memset(&s, 0, sizeof s);
    s.name = "global.weight", s.dtype = DDP_F32, s.global_count = total, s.offset = per * (size_t)rank, s.count = per, s.data = d;
    CHECK_OK(ddp_checkpoint_save_slices(g, path.c_str(), &s, 1, NULL, NULL), g);
    s.offset = 0, s.count = per, s.data = d; /* a device destination is refused on every rank, not a fault */
    CHECK(ddp_checkpoint_load_slices(g, path.c_str(), &s, 1, NULL) == DDP_ERR_UNSUPPORTED && strstr(ddp_last_error(g), "device memory"),
          "load_slices into device memory: %s", ddp_last_error(g));
    s.offset = 0, s.count = total, s.data = all.data();
    CHECK_OK(ddp_checkpoint_load_slices(g, path.c_str(), &s, 1, NULL), g);
    for (size_t j = 0; j < total; j++)
        CHECK(all[j] == (float)((int)(j / per) * 1000 + (int)(j % per)), "load_slices: element %zu is %g", j, (double)all[j]);
    cudaFree(d);
}

/* Rank 0's tensor 0 claims more elements than its allocation holds: the harness (as cudaMemcpyAsync)
   refuses the copy. The save fails on every rank; no file, no .tmp. */
static void t_fault(ddp_group *g, int rank, int n) {
    std::string path = dir + "/fault" + std::to_string(n) + ".safetensors";
    ddp_tensor devt[NT];
    ddp_work *w = NULL;
    ddp_result r;
    void *full;
    double t0;
    make(devt, 30, 0);
    full = devt[0].data;
    CHECK(cudaMalloc(&devt[0].data, 16) == cudaSuccess, "cudaMalloc");
    for (int async = 0; async < 2; async++) {
        t0 = tl_now();
        if (async) {
            CHECK_OK(ddp_checkpoint_save_async(g, path.c_str(), devt, NT, NULL, &w), g);
            r = ddp_wait(w);
        } else r = ddp_checkpoint_save(g, path.c_str(), devt, NT, NULL);
        CHECK(r == DDP_ERR_SYSTEM, "rank %d: %s with a refused device copy returned %d: %s", rank, async ? "save_async" : "save",
              (int)r, ddp_last_error(g));
        CHECK((n == 1 || strstr(ddp_last_error(g), "rank 0")) && strstr(ddp_last_error(g), "device memory") &&
              strstr(ddp_last_error(g), "layer.weight"), "rank %d: the message does not name the copy: %s", rank, ddp_last_error(g));
        CHECK(tl_now() - t0 < 10, "rank %d took %.1f s to fail", rank, tl_now() - t0);
        if (rank == 0) printf("%d rank(s), %s, refused device copy: fails on every rank after %.2f ms: %s\n", n,
                              async ? "save_async" : "save", (tl_now() - t0) * 1e3, ddp_last_error(g));
        CHECK(!exists(path) && !exists(path + ".tmp"), "a failed save left a file behind");
    }
    CHECK_OK(ddp_barrier(g), g); /* the group is still usable */
    cudaFree(devt[0].data);
    devt[0].data = full;
    release(devt);
}

static int rank_main(int rank, int n, void *arg) {
    ddp_harness::memory_stats_t before;
    ddp_group *g = device_rank_begin(&stream, &before);
    (void)arg;
    t_save_load(g, rank, n);
    t_shards(g, rank, n);
    t_slices(g, rank, n);
    t_fault(g, rank, n);
    device_rank_end(g, stream, before); /* every copy staged through pinned memory on the group's stream */
    return 0;
}

int main(void) {
    char tmpl[] = "/tmp/ddp_cuda_ckpt_XXXXXX";
    CHECK(mkdtemp(tmpl) != NULL, "mkdtemp");
    dir = tmpl;
    for (int n = 1; n <= 3; n++) {
        double t0 = tl_now();
        CHECK(tl_run_ranks(n, rank_main, NULL, 120) == 0, "%d rank(s)", n);
        printf("%d rank(s): save, save_async, load (local and broadcast), shards and slices of device tensors (%.1f s)\n", n, tl_now() - t0);
    }
    CHECK(system(("rm -rf " + dir).c_str()) == 0, "rm");
    printf("ok\n");
    return 0;
}
