/* train_gpu: data-parallel training on GPUs with ddp.h's nccl backend (PyTorch: DistributedDataParallel
   over NCCL, with nn.SyncBatchNorm, DistributedSampler and a rank-0 checkpoint).

   The model is small on purpose: z = x W^T (Linear, IN -> C, no bias), y = SyncBatchNorm(z) over the
   whole global batch, loss = mean((y - target)^2). Everything lives in device memory:
     - the Linear layer and the loss are the few kernels below;
     - SyncBatchNorm is ddp_cuda.cu's kernels around the group's collectives (all_gather of the per-rank
       statistics, all_reduce of the backward sums), all queued on the group's stream;
     - the gradients are averaged by ddp.h's reducer, whose buckets are device memory on this backend;
     - DistributedSampler deals each rank its share of the dataset every epoch;
     - rank 0 saves a checkpoint after every epoch; a restart resumes from it.

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

#define CUDA_OK(call)                                                                                 \
    do {                                                                                              \
        cudaError_t e_ = (call);                                                                      \
        if (e_ != cudaSuccess) {                                                                      \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));    \
            exit(1);                                                                                  \
        }                                                                                             \
    } while (0)
#define DDP_OK(call, g)                                                                               \
    do {                                                                                              \
        ddp_result r_ = (call);                                                                       \
        if (r_ != DDP_SUCCESS) {                                                                      \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, ddp_last_error(NULL));      \
            exit(1);                                                                                  \
        }                                                                                             \
    } while (0)

/* z[n][c] = sum_i x[n][i] W[c][i] */
__global__ void linear_forward(const float *x, const float *W, float *z, int batch) {
    int k = blockIdx.x * blockDim.x + threadIdx.x, n = k / C, c = k % C;
    float s = 0;
    if (k >= batch * C) return;
    for (int i = 0; i < IN; i++) s += x[n * IN + i] * W[c * IN + i];
    z[k] = s;
}

/* dy = d loss / dy = 2 (y - t) / (global batch * C) */
__global__ void mse_grad(const float *y, const float *t, float *dy, int count, float scale) {
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k < count) dy[k] = 2.0f * (y[k] - t[k]) * scale;
}

/* dW[c][i] = sum_n dz[n][c] x[n][i] (this rank's batch; the reducer averages over ranks) */
__global__ void linear_backward(const float *x, const float *dz, float *dW, int batch) {
    int k = blockIdx.x * blockDim.x + threadIdx.x, c = k / IN, i = k % IN;
    float s = 0;
    if (k >= C * IN) return;
    for (int n = 0; n < batch; n++) s += dz[n * C + c] * x[n * IN + i];
    dW[k] = s;
}

__global__ void sgd(float *p, const float *g, int count, float lr) {
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k < count) p[k] -= lr * g[k];
}

/* Sample `index` of the synthetic dataset: x uniform in [-1, 1], target = a fixed mix of x. */
static void sample(int64_t index, float *x, float *t) {
    unsigned s = (unsigned)index * 2654435761u + 1;
    for (int i = 0; i < IN; i++) x[i] = (float)((s = s * 1664525u + 1013904223u) >> 8) / 8388608.0f - 1.0f;
    for (int c = 0; c < C; c++) t[c] = x[c] - 0.5f * x[(c + 3) % IN] + 0.25f * x[(c * 5 + 1) % IN];
}

int main(void) {
    ddp_init_desc init;
    ddp_group *g;
    ddp_reducer *red;
    ddp_sampler sampler;
    ddp_sampler_desc sd;
    ddp_cuda_bn_args bn;
    cudaStream_t stream;
    int idx_W, idx_gamma, idx_beta, world, rank;
    int64_t epoch0 = 0, indices[BATCH];
    float hW[C * IN], hgamma[C], hbeta[C], hrm[C], hrv[C], hx[BATCH * IN], ht[BATCH * C];
    float *W, *gamma, *beta, *dW, *dgamma, *dbeta, *rmean, *rvar, *x, *t, *z, *y, *dy, *dz, *mean, *invstd, *work;
    double *records, *record, *sums, *count;
    ddp_tensor ckpt[5];
    ddp_meta meta;
    FILE *f;

    memset(&meta, 0, sizeof meta);

    memset(&init, 0, sizeof init);
    init.backend = "nccl"; /* picks cudaSetDevice(local_rank) */
    DDP_OK(ddp_init(&init, &g), NULL);
    world = ddp_world_size(g), rank = ddp_rank(g);
    CUDA_OK(cudaStreamCreate(&stream));
    DDP_OK(ddp_set_stream(g, stream), g);

    /* parameters (torch's init: W uniform, gamma 1, beta 0), running stats, activations, scratch */
    for (int k = 0; k < C * IN; k++) hW[k] = (float)((k * 37 % 101) - 50) / 200.0f;
    for (int c = 0; c < C; c++) hgamma[c] = 1, hbeta[c] = 0, hrm[c] = 0, hrv[c] = 1;
    CUDA_OK(cudaMalloc(&W, sizeof hW));
    CUDA_OK(cudaMalloc(&dW, sizeof hW));
    CUDA_OK(cudaMalloc(&gamma, 4 * C * sizeof(float) * 2));
    beta = gamma + C, dgamma = gamma + 2 * C, dbeta = gamma + 3 * C, rmean = gamma + 4 * C, rvar = gamma + 5 * C;
    mean = gamma + 6 * C, invstd = gamma + 7 * C;
    CUDA_OK(cudaMalloc(&x, sizeof hx));
    CUDA_OK(cudaMalloc(&t, sizeof ht));
    CUDA_OK(cudaMalloc(&z, 4 * sizeof ht));
    y = z + BATCH * C, dy = z + 2 * BATCH * C, dz = z + 3 * BATCH * C;
    CUDA_OK(cudaMalloc(&work, DDP_CUDA_BN_WORK_FLOATS(C) * sizeof(float)));
    CUDA_OK(cudaMalloc(&records, ((size_t)world + 1) * (2 * C + 1) * sizeof(double) + (2 * C + 1) * sizeof(double)));
    record = records + (size_t)world * (2 * C + 1), sums = record + 2 * C + 1, count = sums + 2 * C;

    /* resume: every rank loads rank 0's last checkpoint, if there is one */
    ckpt[0].name = "linear.weight", ckpt[0].dtype = DDP_F32, ckpt[0].ndim = 2, ckpt[0].shape[0] = C, ckpt[0].shape[1] = IN, ckpt[0].data = hW;
    ckpt[1].name = "bn.weight", ckpt[1].dtype = DDP_F32, ckpt[1].ndim = 1, ckpt[1].shape[0] = C, ckpt[1].data = hgamma;
    ckpt[2].name = "bn.bias", ckpt[2].dtype = DDP_F32, ckpt[2].ndim = 1, ckpt[2].shape[0] = C, ckpt[2].data = hbeta;
    ckpt[3].name = "bn.running_mean", ckpt[3].dtype = DDP_F32, ckpt[3].ndim = 1, ckpt[3].shape[0] = C, ckpt[3].data = hrm;
    ckpt[4].name = "bn.running_var", ckpt[4].dtype = DDP_F32, ckpt[4].ndim = 1, ckpt[4].shape[0] = C, ckpt[4].data = hrv;
    if ((f = fopen(CHECKPOINT, "rb")) != NULL) {
        fclose(f);
        DDP_OK(ddp_checkpoint_load(g, CHECKPOINT, ckpt, 5, &meta), g);
        DDP_OK(ddp_meta_get_int(&meta, "epoch", &epoch0), g);
        if (rank == 0) printf("resuming after epoch %lld\n", (long long)epoch0);
    }
    CUDA_OK(cudaMemcpy(W, hW, sizeof hW, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(gamma, hgamma, sizeof hgamma, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(beta, hbeta, sizeof hbeta, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(rmean, hrm, sizeof hrm, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(rvar, hrv, sizeof hrv, cudaMemcpyHostToDevice));

    /* the reducer: parameters in forward order; finalize broadcasts rank 0's values (device memory) */
    DDP_OK(ddp_reducer_create(g, NULL, &red), g);
    DDP_OK(ddp_reducer_add_param(red, "linear.weight", W, dW, C * IN, DDP_F32, &idx_W), g);
    DDP_OK(ddp_reducer_add_param(red, "bn.weight", gamma, dgamma, C, DDP_F32, &idx_gamma), g);
    DDP_OK(ddp_reducer_add_param(red, "bn.bias", beta, dbeta, C, DDP_F32, &idx_beta), g);
    DDP_OK(ddp_reducer_add_buffer(red, "bn.running_mean", rmean, C, DDP_F32), g);
    DDP_OK(ddp_reducer_add_buffer(red, "bn.running_var", rvar, C, DDP_F32), g);
    DDP_OK(ddp_reducer_finalize(red), g);

    memset(&sd, 0, sizeof sd);
    sd.dataset_size = DATASET, sd.num_replicas = world, sd.rank = rank, sd.drop_last = 1;
    DDP_OK(ddp_sampler_init(&sampler, &sd), g);
    memset(&bn, 0, sizeof bn);
    bn.dtype = DDP_F32, bn.batch = BATCH, bn.spatial = 1, bn.channels = C, bn.channels_last = 1, bn.stream = stream;

    for (int64_t epoch = epoch0; epoch < EPOCHS; epoch++) {
        size_t got = 0;
        double loss_sum = 0;
        int steps = 0;
        ddp_sampler_set_epoch(&sampler, (uint64_t)epoch);
        while (ddp_sampler_next_batch(&sampler, BATCH, indices, &got) == DDP_SUCCESS && got == BATCH) {
            float hy[BATCH * C], loss = 0;
            for (int n = 0; n < BATCH; n++) sample(indices[n], hx + n * IN, ht + n * C);
            CUDA_OK(cudaMemcpyAsync(x, hx, sizeof hx, cudaMemcpyHostToDevice, stream));
            CUDA_OK(cudaMemcpyAsync(t, ht, sizeof ht, cudaMemcpyHostToDevice, stream));
            /* forward: Linear, then SyncBatchNorm over every rank's batch */
            linear_forward<<<(BATCH * C + 255) / 256, 256, 0, stream>>>(x, W, z, BATCH);
            DDP_OK(ddp_cuda_bn_stats(&bn, z, work, record), g);
            DDP_OK(ddp_all_gather(g, record, records, 2 * C + 1, DDP_F64), g);
            DDP_OK(ddp_cuda_bn_gather_stats(&bn, records, world, 1e-5, 0.1, rmean, rvar, mean, invstd, count), g);
            DDP_OK(ddp_cuda_bn_elemt(&bn, z, y, gamma, beta, mean, invstd), g);
            /* backward, with the reducer's hooks in reverse order of use */
            DDP_OK(ddp_reducer_begin_backward(red), g);
            mse_grad<<<(BATCH * C + 255) / 256, 256, 0, stream>>>(y, t, dy, BATCH * C, 1.0f / (float)(BATCH * world * C));
            CUDA_OK(cudaMemsetAsync(dgamma, 0, 2 * C * sizeof(float), stream));
            DDP_OK(ddp_cuda_bn_backward_reduce(&bn, dy, z, mean, invstd, work, sums, dgamma, dbeta), g);
            DDP_OK(ddp_reducer_grad_ready(red, idx_beta), g);
            DDP_OK(ddp_reducer_grad_ready(red, idx_gamma), g);
            DDP_OK(ddp_all_reduce(g, sums, 2 * C, DDP_F64, DDP_SUM), g);
            DDP_OK(ddp_cuda_bn_backward_elemt(&bn, dy, z, dz, gamma, mean, invstd, sums, count, work), g);
            linear_backward<<<(C * IN + 255) / 256, 256, 0, stream>>>(x, dz, dW, BATCH);
            DDP_OK(ddp_reducer_grad_ready(red, idx_W), g);
            DDP_OK(ddp_reducer_end_backward(red), g); /* gradients are now the average over all ranks */
            sgd<<<(C * IN + 255) / 256, 256, 0, stream>>>(W, dW, C * IN, 0.5f);
            sgd<<<1, 2 * C, 0, stream>>>(gamma, dgamma, 2 * C, 0.5f); /* gamma and beta are adjacent */
            CUDA_OK(cudaMemcpyAsync(hy, y, sizeof hy, cudaMemcpyDeviceToHost, stream));
            CUDA_OK(cudaStreamSynchronize(stream));
            for (int k = 0; k < BATCH * C; k++) loss += (hy[k] - ht[k]) * (hy[k] - ht[k]);
            loss_sum += loss / (BATCH * C);
            steps++;
        }
        /* rank 0 saves the epoch's weights (from device memory) and its number */
        CUDA_OK(cudaMemcpy(hW, W, sizeof hW, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(hgamma, gamma, sizeof hgamma, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(hbeta, beta, sizeof hbeta, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(hrm, rmean, sizeof hrm, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(hrv, rvar, sizeof hrv, cudaMemcpyDeviceToHost));
        DDP_OK(ddp_meta_set_int(&meta, "epoch", epoch + 1), g);
        DDP_OK(ddp_checkpoint_save(g, CHECKPOINT, ckpt, 5, &meta), g);
        if (rank == 0) printf("epoch %lld: mean loss %.5f over %d steps (rank 0's batches)\n", (long long)epoch,
                              loss_sum / (steps ? steps : 1), steps);
    }
    ddp_meta_free(&meta);
    ddp_sampler_free(&sampler);
    ddp_reducer_destroy(red);
    DDP_OK(ddp_destroy(g), NULL);
    CUDA_OK(cudaStreamDestroy(stream));
    cudaFree(W), cudaFree(dW), cudaFree(gamma), cudaFree(x), cudaFree(t), cudaFree(z), cudaFree(work), cudaFree(records);
    return 0;
}
