/* The ddp.h side of tests/test_interop_torch_current.sh's GradScaler and clip_grad_norm_ part (driven by
   tests/interop/amp_torch.py, which runs it and compares with current torch).
   amp_peer prints, one line each:
       scaler C K SCALE STEP    ddp_grad_scaler_update over 2000 steps K of found_inf(K) (below), for the
                                configurations C of CONFIGS (init scale, growth, backoff, interval); SCALE
                                after the update (%.17g of the f32 value), STEP its return
       clip NORM COEF           one rank: a reducer with grad_stats over one f32 parameter of 1000 elements,
                                gradient grad_value(i); ddp_reducer_grad_norm and ddp_reducer_clip_coef(1.0) */
#include "testlib.h"

static const double CONFIGS[2][4] = {{65536.0, 2.0, 0.5, 7}, {1000.1, 1.5, 0.7, 3}};

/* The step's inf: the same pattern as amp_torch.py's. */
static int found_inf(int k) { return k % 11 == 3 || k % 17 == 5; }

/* Gradient element i (grad_value(0) = 1, so torch's clipped element 0 is its f32 coefficient). */
static float grad_value(int i) { return i == 0 ? 1.0f : (float)((i * 37) % 101 - 50) / 16.0f; }

int main(void) {
    ddp_group *g;
    ddp_reducer_desc d;
    ddp_reducer *red;
    static float w[1000], gw[1000];
    double norm;
    int c, k, i;
    for (c = 0; c < 2; c++) {
        ddp_grad_scaler s;
        ddp_grad_scaler_init(&s);
        s.scale = CONFIGS[c][0], s.growth_factor = CONFIGS[c][1], s.backoff_factor = CONFIGS[c][2];
        s.growth_interval = (int)CONFIGS[c][3];
        for (k = 0; k < 2000; k++) {
            int step = ddp_grad_scaler_update(&s, found_inf(k));
            printf("scaler %d %d %.17g %d\n", c, k, s.scale, step);
        }
    }
    CHECK_OK(ddp_init(NULL, &g), NULL);
    memset(&d, 0, sizeof d);
    d.grad_stats = 1;
    CHECK_OK(ddp_reducer_create(g, &d, &red), g);
    CHECK_OK(ddp_reducer_add_param(red, "w", w, gw, 1000, DDP_F32, NULL), g);
    CHECK_OK(ddp_reducer_finalize(red), g);
    CHECK_OK(ddp_reducer_begin_backward(red), g);
    for (i = 0; i < 1000; i++) gw[i] = grad_value(i);
    CHECK_OK(ddp_reducer_grad_ready(red, 0), g);
    CHECK_OK(ddp_reducer_end_backward(red), g);
    CHECK_OK(ddp_reducer_grad_norm(red, &norm), g);
    printf("clip %.17g %.17g\n", norm, ddp_reducer_clip_coef(red, 1.0));
    ddp_reducer_destroy(red);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}
