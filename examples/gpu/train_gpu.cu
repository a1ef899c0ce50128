/* train_gpu: data-parallel training on GPUs with ddp.h's nccl backend, the GPU twin of examples/train_demo.c
   (PyTorch: DistributedDataParallel over NCCL, with nn.SyncBatchNorm, DistributedSampler and a rank-0
   checkpoint). The same calls as on the CPU, given device memory:

     ddp_init (backend "nccl")   init_process_group("nccl"): each rank takes the GPU of its local rank
     ddp_set_stream              the stream every collective and SyncBN kernel of the group is queued on
     ddp_syncbn                  nn.SyncBatchNorm: its forward and backward take device pointers and queue
                                 the statistics kernels and the two collectives on the group's stream
     ddp_reducer                 DistributedDataParallel: its buckets are device memory on this backend
     ddp_sampler + set_epoch     DistributedSampler: a shard of the dataset per rank, reshuffled per epoch
     ddp_checkpoint_*            torch.save on rank 0 after every epoch; a restart resumes from it

   The model is small on purpose: z = x W^T (Linear, IN -> C, no bias), y = SyncBatchNorm(z) over the
   whole global batch, loss = mean((y - target)^2), plain SGD. Every tensor is its own cudaMalloc: kernels
   never rely on two arrays being adjacent.

   Build and run (one GPU per rank):
       make GPU=1 build/ddprun build/train_gpu
       build/ddprun --nproc-per-node 2 build/train_gpu
   Run it again to see it resume from train_gpu.safetensors (delete the file to start over). */
#define DDP_CUDA /* the nccl backend and ddp_cuda.cu's entry points */
#define DDP_IMPLEMENTATION
#include "ddp.h"

#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { IN = 16, C = 8, DATASET = 4096, BATCH = 64 /* per rank */, EPOCHS = 3 };
static const char *CHECKPOINT = "train_gpu.safetensors";

#define CUDA_OK(call)                                                                              \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)
#define DDP_OK(call, g)                                                                            \
    do {                                                                                           \
        ddp_result r_ = (call);                                                                    \
        if (r_ != DDP_SUCCESS) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, ddp_last_error(g));      \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* ---- data: a synthetic regression task ------------------------------------------------------------ */

/* Sample `index`: x uniform in [-1, 1], target = a fixed mix of x. */
static void sample(int64_t index, float *x, float *t) {
    unsigned s = (unsigned)index * 2654435761u + 1;
    for (int i = 0; i < IN; i++) x[i] = (float)((s = s * 1664525u + 1013904223u) >> 8) / 8388608.0f - 1.0f;
    for (int c = 0; c < C; c++) t[c] = x[c] - 0.5f * x[(c + 3) % IN] + 0.25f * x[(c * 5 + 1) % IN];
}

/* ---- the kernels of the Linear layer, the loss and SGD ------------------------------------------- */

/* z[n][c] = sum_i x[n][i] W[c][i] */
__global__ void linear_forward(const float *x, const float *W, float *z, int batch) {
    int k = blockIdx.x * blockDim.x + threadIdx.x, n = k / C, c = k % C;
    float s = 0;
    if (k >= batch * C) return;
    for (int i = 0; i < IN; i++) s += x[n * IN + i] * W[c * IN + i];
    z[k] = s;
}

/* dW[c][i] = sum_n dz[n][c] x[n][i] (this rank's batch; the reducer averages over ranks) */
__global__ void linear_backward(const float *x, const float *dz, float *dW, int batch) {
    int k = blockIdx.x * blockDim.x + threadIdx.x, c = k / IN, i = k % IN;
    float s = 0;
    if (k >= C * IN) return;
    for (int n = 0; n < batch; n++) s += dz[n * C + c] * x[n * IN + i];
    dW[k] = s;
}

/* dy = d loss / dy = 2 (y - t) * scale, scale = 1 / (global batch * C) */
__global__ void mse_grad(const float *y, const float *t, float *dy, int count, float scale) {
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k < count) dy[k] = 2.0f * (y[k] - t[k]) * scale;
}

__global__ void sgd(float *p, const float *g, int count, float lr) {
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k < count) p[k] -= lr * g[k];
}

static unsigned blocks(int count) { return (unsigned)((count + 255) / 256); }

/* ---- the model: parameters, gradients, buffers and activations, each its own allocation ---------- */

typedef struct tensor {
    const char *name; /* torch's state_dict name */
    int count;
    float *data, *grad; /* device; grad NULL for buffers (running stats) */
} tensor;

enum { LIN_W, BN_W, BN_B, BN_RM, BN_RV, NTENSORS }; /* parameters in forward order, then the buffers */

typedef struct net {
    tensor t[NTENSORS];
    ddp_syncbn *bn;
    float *x, *target, *z, *y, *dy, *dz; /* activations of one batch (BATCH rows) */
    int idx[BN_RM];                     /* the reducer's index of each parameter */
} net;

static float *device_floats(int count, float value) {
    float *d, *h = (float *)malloc(sizeof(float) * (size_t)count);
    for (int k = 0; k < count; k++) h[k] = value;
    CUDA_OK(cudaMalloc(&d, sizeof(float) * (size_t)count));
    CUDA_OK(cudaMemcpy(d, h, sizeof(float) * (size_t)count, cudaMemcpyHostToDevice));
    free(h);
    return d;
}

/* torch's initial values: W a fixed pattern in [-0.25, 0.25], weight 1, bias 0, running mean 0, var 1. */
static void net_create(net *m, ddp_group *g) {
    static const char *names[NTENSORS] = {"linear.weight", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"};
    static const float init[NTENSORS] = {0, 1, 0, 0, 1};
    ddp_syncbn_desc d;
    memset(m, 0, sizeof *m);
    for (int k = 0; k < NTENSORS; k++) {
        m->t[k].name = names[k];
        m->t[k].count = k == LIN_W ? C * IN : C;
        m->t[k].data = device_floats(m->t[k].count, init[k]);
        m->t[k].grad = k < BN_RM ? device_floats(m->t[k].count, 0) : NULL;
    }
    float hW[C * IN];
    for (int k = 0; k < C * IN; k++) hW[k] = (float)((k * 37 % 101) - 50) / 200.0f;
    CUDA_OK(cudaMemcpy(m->t[LIN_W].data, hW, sizeof hW, cudaMemcpyHostToDevice));
    m->x = device_floats(BATCH * IN, 0), m->target = device_floats(BATCH * C, 0);
    m->z = device_floats(BATCH * C, 0), m->y = device_floats(BATCH * C, 0);
    m->dy = device_floats(BATCH * C, 0), m->dz = device_floats(BATCH * C, 0);
    /* SyncBatchNorm over g, its weight, bias and running stats in device memory */
    memset(&d, 0, sizeof d);
    d.num_features = C, d.channels_last = 1; /* (N, C) input: either layout, spatial 1 */
    d.weight = m->t[BN_W].data, d.bias = m->t[BN_B].data;
    d.running_mean = m->t[BN_RM].data, d.running_var = m->t[BN_RV].data;
    DDP_OK(ddp_syncbn_create(g, &d, &m->bn), g);
}

static void net_free(net *m) {
    ddp_syncbn_destroy(m->bn); /* before the group: it waits for its last collectives */
    for (int k = 0; k < NTENSORS; k++) cudaFree(m->t[k].data), cudaFree(m->t[k].grad);
    cudaFree(m->x), cudaFree(m->target), cudaFree(m->z), cudaFree(m->y), cudaFree(m->dy), cudaFree(m->dz);
}

/* One training step on the batch in m->x / m->target: forward, backward with the reducer's hooks as
   each gradient is written (in reverse order of use), SGD on the averaged gradients. */
static void train_step(net *m, ddp_group *g, ddp_reducer *red, cudaStream_t stream, float lr) {
    const int world = ddp_world_size(g);
    for (int k = 0; k < BN_RM; k++) /* zero_grad: ddp_syncbn_backward adds to grad_weight and grad_bias */
        CUDA_OK(cudaMemsetAsync(m->t[k].grad, 0, sizeof(float) * (size_t)m->t[k].count, stream));
    linear_forward<<<blocks(BATCH * C), 256, 0, stream>>>(m->x, m->t[LIN_W].data, m->z, BATCH);
    DDP_OK(ddp_syncbn_forward(m->bn, m->z, m->y, BATCH, 1, 1), g);
    DDP_OK(ddp_reducer_begin_backward(red), g);
    mse_grad<<<blocks(BATCH * C), 256, 0, stream>>>(m->y, m->target, m->dy, BATCH * C, 1.0f / (float)(BATCH * world * C));
    DDP_OK(ddp_syncbn_backward(m->bn, m->z, m->dy, m->dz, m->t[BN_W].grad, m->t[BN_B].grad, BATCH, 1), g);
    DDP_OK(ddp_reducer_grad_ready(red, m->idx[BN_B]), g);
    DDP_OK(ddp_reducer_grad_ready(red, m->idx[BN_W]), g);
    linear_backward<<<blocks(C * IN), 256, 0, stream>>>(m->x, m->dz, m->t[LIN_W].grad, BATCH);
    DDP_OK(ddp_reducer_grad_ready(red, m->idx[LIN_W]), g);
    DDP_OK(ddp_reducer_end_backward(red), g); /* the gradients are now the average over all ranks */
    for (int k = 0; k < BN_RM; k++)
        sgd<<<blocks(m->t[k].count), 256, 0, stream>>>(m->t[k].data, m->t[k].grad, m->t[k].count, lr);
}

/* ---- checkpoints: the state_dict through host memory -------------------------------------------- */

static void checkpoint(ddp_group *g, net *m, int save, int64_t *epoch) {
    float host[NTENSORS][C * IN];
    ddp_tensor ts[NTENSORS];
    ddp_meta meta;
    memset(ts, 0, sizeof ts);
    memset(&meta, 0, sizeof meta);
    for (int k = 0; k < NTENSORS; k++) {
        ts[k].name = m->t[k].name, ts[k].dtype = DDP_F32, ts[k].data = host[k];
        ts[k].ndim = k == LIN_W ? 2 : 1, ts[k].shape[0] = C, ts[k].shape[1] = k == LIN_W ? IN : 0;
        if (save) CUDA_OK(cudaMemcpy(host[k], m->t[k].data, sizeof(float) * (size_t)m->t[k].count, cudaMemcpyDeviceToHost));
    }
    if (save) {
        DDP_OK(ddp_meta_set_int(&meta, "epoch", *epoch), g);
        DDP_OK(ddp_checkpoint_save(g, CHECKPOINT, ts, NTENSORS, &meta), g);
    } else {
        DDP_OK(ddp_checkpoint_load(g, CHECKPOINT, ts, NTENSORS, &meta), g);
        DDP_OK(ddp_meta_get_int(&meta, "epoch", epoch), g);
        for (int k = 0; k < NTENSORS; k++)
            CUDA_OK(cudaMemcpy(m->t[k].data, host[k], sizeof(float) * (size_t)m->t[k].count, cudaMemcpyHostToDevice));
    }
    ddp_meta_free(&meta);
}

/* ---- the program ---------------------------------------------------------------------------------- */

int main(void) {
    ddp_init_desc init;
    ddp_group *g;
    ddp_reducer *red;
    ddp_sampler sampler;
    ddp_sampler_desc sd;
    cudaStream_t stream;
    net m;
    int64_t epoch0 = 0, indices[BATCH];
    float hx[BATCH * IN], ht[BATCH * C], hy[BATCH * C];
    FILE *f;

    memset(&init, 0, sizeof init);
    init.backend = "nccl"; /* cudaSetDevice(local_rank) */
    DDP_OK(ddp_init(&init, &g), NULL);
    const int world = ddp_world_size(g), rank = ddp_rank(g);
    CUDA_OK(cudaStreamCreate(&stream));
    DDP_OK(ddp_set_stream(g, stream), g);

    net_create(&m, g);
    if ((f = fopen(CHECKPOINT, "rb")) != NULL) { /* resume: every rank loads rank 0's last checkpoint */
        fclose(f);
        checkpoint(g, &m, 0, &epoch0);
        if (rank == 0) printf("resuming after epoch %lld\n", (long long)epoch0);
    }

    /* the reducer: parameters in forward order, buffers broadcast from rank 0 by finalize */
    DDP_OK(ddp_reducer_create(g, NULL, &red), g);
    for (int k = 0; k < BN_RM; k++)
        DDP_OK(ddp_reducer_add_param(red, m.t[k].name, m.t[k].data, m.t[k].grad, m.t[k].count, DDP_F32, &m.idx[k]), g);
    for (int k = BN_RM; k < NTENSORS; k++) DDP_OK(ddp_reducer_add_buffer(red, m.t[k].name, m.t[k].data, m.t[k].count, DDP_F32), g);
    DDP_OK(ddp_reducer_finalize(red), g);

    memset(&sd, 0, sizeof sd);
    sd.dataset_size = DATASET, sd.num_replicas = world, sd.rank = rank, sd.drop_last = 1;
    DDP_OK(ddp_sampler_init(&sampler, &sd), g);

    for (int64_t epoch = epoch0; epoch < EPOCHS; epoch++) {
        size_t got = 0;
        double loss_sum = 0;
        int steps = 0;
        ddp_sampler_set_epoch(&sampler, (uint64_t)epoch);
        while (ddp_sampler_next_batch(&sampler, BATCH, indices, &got) == DDP_SUCCESS && got == BATCH) {
            for (int n = 0; n < BATCH; n++) sample(indices[n], hx + n * IN, ht + n * C);
            CUDA_OK(cudaMemcpyAsync(m.x, hx, sizeof hx, cudaMemcpyHostToDevice, stream));
            CUDA_OK(cudaMemcpyAsync(m.target, ht, sizeof ht, cudaMemcpyHostToDevice, stream));
            train_step(&m, g, red, stream, 0.5f);
            CUDA_OK(cudaMemcpyAsync(hy, m.y, sizeof hy, cudaMemcpyDeviceToHost, stream)); /* for the log */
            CUDA_OK(cudaStreamSynchronize(stream));
            double loss = 0;
            for (int k = 0; k < BATCH * C; k++) loss += (double)(hy[k] - ht[k]) * (hy[k] - ht[k]);
            loss_sum += loss / (BATCH * C);
            steps++;
        }
        int64_t done = epoch + 1;
        checkpoint(g, &m, 1, &done); /* rank 0 writes the epoch's weights and its number */
        if (rank == 0)
            printf("epoch %lld: mean loss %.5f over %d steps (rank 0's batches)\n", (long long)epoch,
                   loss_sum / (steps ? steps : 1), steps);
    }
    ddp_sampler_free(&sampler);
    ddp_reducer_destroy(red);
    net_free(&m);
    DDP_OK(ddp_destroy(g), NULL);
    CUDA_OK(cudaStreamDestroy(stream));
    return 0;
}
