/* The serial optimizer references of the reducer tests (test_reducer_zero, test_reducer_zero_ckpt,
   test_reducer_join): written here from torch.optim's documented update rules, independent of the library
   (which has no optimizer: a program runs its own on the parameters, or on the shards ZeRO gives it).
   Include after testlib.h. (tests/interop/reducer_peer.c keeps its own AdamW, in the order of torch 1.13's
   arithmetic, as it is compared with torch itself.) */
#ifndef DDP_TEST_REF_OPTIM_H
#define DDP_TEST_REF_OPTIM_H

/* torch.optim.AdamW(lr = REF_ADAMW_LR, betas = (0.9, 0.999), eps = 1e-8, weight_decay = REF_ADAMW_WD) on n
   elements: decoupled weight decay, the moments m and v, bias correction; t counts this tensor's steps from
   1. In f32, in a fixed order, so that two runs on the same values agree bit for bit. */
#define REF_ADAMW_LR 1e-2f
#define REF_ADAMW_WD 1e-2f
TL_FN void ref_adamw(float *p, const float *g, float *m, float *v, size_t n, int t) {
    const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
    float c1 = 1.0f - powf(b1, (float)t), c2 = 1.0f - powf(b2, (float)t);
    size_t i;
    for (i = 0; i < n; i++) {
        p[i] -= REF_ADAMW_LR * REF_ADAMW_WD * p[i];
        m[i] = b1 * m[i] + (1.0f - b1) * g[i];
        v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
        p[i] -= REF_ADAMW_LR * (m[i] / c1) / (sqrtf(v[i] / c2) + eps);
    }
}

#endif
