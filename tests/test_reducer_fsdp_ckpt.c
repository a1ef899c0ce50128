/* FSDP checkpoints (zero_stage 3), on tests/fsdp_model.h's model with AdamW on the master shards:
   - 2 ranks train S1 steps, save their master shards and AdamW moments as slices (ddp_checkpoint_save_slices,
     one slice per shard and state) and the whole model with ddp_fsdp_save_full (root: the last rank), train
     S2 more steps and save the whole model again: the reference;
   - fresh processes on 2 ranks load the slices and train the same S2 steps: the model equals the reference
     BIT FOR BIT;
   - on 1, 3 and 4 ranks (another split of every unit): one run loads everything from the slices, another
     loads the parameters from the whole file (ddp_checkpoint_load_slices on an ordinary safetensors file:
     each rank reads only its slices) and the moments from the slices: the two equal each other bit for
     bit, and a serial reference (2 ranks' gradients for S1 steps, then N ranks') within 1e-5;
   - the AdamW moments consolidated on one rank (ddp_reducer_consolidate_state) equal the serial model's,
     and ddp_reducer_shard_state gives every rank its own back;
   - the whole file: an ordinary safetensors file (read here with ddp_checkpoint_list / ddp_checkpoint_load,
     no group), "l1.w" 40 x 25 as ddp_reducer_param_shape said, the others 1-D, every tensor equal to the
     serial model after S1 steps within 1e-6; tests/interop/safetensors_io.py (a reader written from the
     format description, checksums verified) reads it too; errors: stage 2, a bad root, during a pass; a directory that does not
     exist is DDP_ERR_IO on every rank, and nothing is left behind. */
#include "testlib.h"
#include "ref_optim.h"
#include "fsdp_model.h"

#define S1 3
#define S2 3
static char dir[256];
static const mode M = {"prefetch 1", 1, 1, 0, DDP_DTYPE_DEFAULT, DDP_DTYPE_DEFAULT, 1e-6, 1, 0, 0, -1, 0};

/* One step at zero_stage 3: forward with one unit prefetched, backward, AdamW on the shards (step *t + 1). */
static void s3_step(side *s, int rank, int step, int *t) {
    int u, i;
    size_t e;
    CHECK_OK(ddp_fsdp_wait(s->r, 0), NULL);
    for (u = 0; u < NU; u++) {
        if (u + 1 < NU) CHECK_OK(ddp_fsdp_gather(s->r, u + 1), NULL);
        CHECK_OK(ddp_fsdp_wait(s->r, u), NULL);
        if (u + 1 < NU) CHECK_OK(ddp_fsdp_release(s->r, u), NULL);
    }
    CHECK_OK(ddp_reducer_begin_backward(s->r), NULL);
    for (u = NU - 1; u >= 0; u--) {
        CHECK_OK(ddp_fsdp_wait(s->r, u), NULL);
        if (u > 1) CHECK_OK(ddp_fsdp_gather(s->r, u - 1), NULL);
        for (i = 0; i < NP; i++) {
            const float *w = (const float *)ddp_fsdp_param(s->r, i);
            float *gr;
            if (UNIT_OF[i] != u) continue;
            gr = (float *)ddp_fsdp_grad(s->r, i);
            CHECK(w && gr, "unit %d", u);
            for (e = 0; e < COUNT[i]; e++) gr[e] += grad_of(w[e], rank, step, 0, i, e);
        }
        CHECK_OK(ddp_fsdp_grads_ready(s->r, u), NULL);
        CHECK_OK(ddp_fsdp_release(s->r, u), NULL);
    }
    CHECK_OK(ddp_reducer_end_backward(s->r), NULL);
    adamw_shards(s, ++*t);
    CHECK_OK(ddp_reducer_zero_grad(s->r), NULL);
}

/* The slices of this rank's state: per shard its parameter values, exp_avg and exp_avg_sq (names kept in
   `names`, 3 * nsh of 32 bytes). which: 1 parameters only, 2 moments only, 3 all. Returns how many. */
static int state_slices(side *s, ddp_slice *out, char (*names)[32], int which) {
    int j, k, n = 0;
    static const char *suffix[3] = {"", ".exp_avg", ".exp_avg_sq"};
    for (j = 0; j < s->nsh; j++)
        for (k = 0; k < 3; k++) {
            void *data = k == 0 ? s->sh[j].param_data : k == 1 ? (void *)s->m[j] : (void *)s->v[j];
            if (!((k == 0 ? 1 : 2) & which)) continue;
            param_name(s->sh[j].param, names[n], 32);
            strcat(names[n], suffix[k]);
            out[n].name = names[n], out[n].dtype = DDP_F32, out[n].global_count = COUNT[s->sh[j].param];
            out[n].offset = s->sh[j].offset, out[n].count = s->sh[j].count, out[n].data = data;
            n++;
        }
    return n;
}

static void path_of(char *out, size_t cap, const char *what) { snprintf(out, cap, "%s/%s", dir, what); }

/* The AdamW moments consolidated on the last rank (ddp_reducer_consolidate_state, torch's
   consolidate_state_dict) equal the serial model's after S1 steps (1e-5), and split back
   (ddp_reducer_shard_state) they are this rank's own, bit for bit. */
static void consolidated(ddp_group *g, side *s) {
    size_t total = 0, mine = 0, off, e;
    float *full[2], *shard[2], *back[2];
    serial ref;
    int i, j, k, t = 0, step, root = ddp_world_size(g) - 1;
    for (i = 0; i < NP; i++) total += COUNT[i];
    for (j = 0; j < s->nsh; j++) mine += s->sh[j].count;
    for (k = 0; k < 2; k++) {
        full[k] = (float *)calloc(total, sizeof(float)), shard[k] = (float *)calloc(mine + 1, sizeof(float));
        back[k] = (float *)calloc(mine + 1, sizeof(float));
        for (j = 0, off = 0; j < s->nsh; off += s->sh[j].count, j++)
            memcpy(shard[k] + off, k ? s->v[j] : s->m[j], s->sh[j].count * sizeof(float));
    }
    CHECK_OK(ddp_reducer_consolidate_state(s->r, DDP_F32, 2, (const void *const *)shard, mine, (void *const *)full, total, root), g);
    if (ddp_rank(g) == root) {
        serial_init(&ref);
        for (step = 0; step < S1; step++) serial_step(&ref, &M, 2, step, ++t);
        for (i = 0, off = 0; i < NP; off += COUNT[i], i++)
            for (e = 0; e < COUNT[i]; e++)
                CHECK(fsdp_close(full[0][off + e], ref.m[i][e], 1e-5) && fsdp_close(full[1][off + e], ref.v[i][e], 1e-5),
                      "consolidated moments of parameter %d [%zu]: %g %g, serial %g %g", i, e, full[0][off + e], full[1][off + e],
                      ref.m[i][e], ref.v[i][e]);
        serial_free(&ref);
        CHECK_OK(ddp_reducer_shard_state(s->r, DDP_F32, 2, (const void *const *)full, total, (void *const *)back, mine), g);
        CHECK(!memcmp(back[0], shard[0], mine * 4) && !memcmp(back[1], shard[1], mine * 4), "shard_state of the consolidation");
    }
    for (k = 0; k < 2; k++) free(full[k]), free(shard[k]), free(back[k]);
}

/* arg: NULL saves (2 ranks); else "slices" or "whole": where the parameters come from. */
static int run_main(int rank, int n, void *arg) {
    ddp_group *g = tl_init(60, DDP_LOG_DEFAULT, NULL);
    const char *from = (const char *)arg;
    side s;
    ddp_slice *sl;
    char (*names)[32], path[400], out[64];
    int t = 0, step, k;
    side_init(&s, g, &M, 3);
    sl = (ddp_slice *)calloc((size_t)s.nsh * 3 + 1, sizeof *sl);
    names = (char (*)[32])calloc((size_t)s.nsh * 3 + 1, 32);
    if (!from) {
        for (step = 0; step < S1; step++) s3_step(&s, rank, step, &t);
        path_of(path, sizeof path, "ck");
        CHECK_OK(ddp_checkpoint_save_slices(g, path, sl, state_slices(&s, sl, names, 3), NULL, NULL), NULL);
        path_of(path, sizeof path, "whole.safetensors");
        CHECK_OK(ddp_fsdp_save_full(s.r, path, n - 1, NULL), NULL);
        consolidated(g, &s);
        snprintf(out, sizeof out, "final_%d.safetensors", n);
    } else {
        path_of(path, sizeof path, "ck");
        k = state_slices(&s, sl, names, strcmp(from, "whole") ? 3 : 2);
        CHECK_OK(ddp_checkpoint_load_slices(g, path, sl, k, NULL), NULL);
        if (!strcmp(from, "whole")) {
            path_of(path, sizeof path, "whole.safetensors");
            CHECK_OK(ddp_checkpoint_load_slices(g, path, sl, state_slices(&s, sl, names, 1), NULL), NULL);
        }
        t = S1;
        snprintf(out, sizeof out, "resumed_%d_%s.safetensors", n, from);
    }
    for (step = S1; step < S1 + S2; step++) s3_step(&s, rank, step, &t);
    path_of(path, sizeof path, out);
    CHECK_OK(ddp_fsdp_save_full(s.r, path, 0, NULL), NULL);
    free(sl), free(names);
    side_free(&s);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* The errors of ddp_fsdp_save_full, on every rank alike. */
static int errors_main(int rank, int n, void *arg) {
    ddp_group *g = tl_init(60, DDP_LOG_DEFAULT, NULL);
    side s2, s3;
    char path[400];
    ddp_result res;
    (void)rank, (void)n, (void)arg;
    side_init(&s2, g, &M, 2);
    side_init(&s3, g, &M, 3);
    path_of(path, sizeof path, "never.safetensors");
    res = ddp_fsdp_save_full(s2.r, path, 0, NULL);
    CHECK(res == DDP_ERR_STATE && strstr(ddp_last_error(g), "ddp_checkpoint_save"), "stage 2: %s", ddp_last_error(g));
    res = ddp_fsdp_save_full(s3.r, path, n, NULL);
    CHECK(res == DDP_ERR_INVALID_ARGUMENT && strstr(ddp_last_error(g), "is not a rank"), "bad root: %s", ddp_last_error(g));
    CHECK_OK(ddp_reducer_begin_backward(s3.r), NULL);
    res = ddp_fsdp_save_full(s3.r, path, 0, NULL);
    CHECK(res == DDP_ERR_STATE && strstr(ddp_last_error(g), "during a backward pass"), "in a pass: %s", ddp_last_error(g));
    for (res = 0; res < NU; res++) CHECK_OK(ddp_fsdp_grads_ready(s3.r, (int)res), NULL);
    CHECK_OK(ddp_reducer_end_backward(s3.r), NULL);
    snprintf(path, sizeof path, "%s/no/such/dir/x.safetensors", dir);
    res = ddp_fsdp_save_full(s3.r, path, n - 1, NULL); /* root cannot create it: every rank fails, nothing moves */
    CHECK(res == DDP_ERR_IO && strstr(ddp_last_error(g), "cannot create"), "no directory: %s: %s", ddp_result_string(res),
          ddp_last_error(g));
    CHECK_OK(ddp_barrier(g), NULL); /* the group is still usable */
    side_free(&s2);
    side_free(&s3);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* Read a whole-model file with no group: every tensor, as its header says (l1.w: 40 x 25). */
static void read_whole(const char *what, float *p[NP]) {
    char path[400], name[32];
    ddp_tensor t[NP], *listed = NULL;
    int i, n = 0, k;
    path_of(path, sizeof path, what);
    CHECK_OK(ddp_checkpoint_list(path, &listed, &n, NULL), NULL);
    CHECK(n == NP, "%s holds %d tensors", what, n);
    for (i = 0; i < NP; i++) {
        param_name(i, name, sizeof name);
        for (k = 0; k < n && strcmp(listed[k].name, name); k++) continue;
        CHECK(k < n && listed[k].dtype == DDP_F32, "%s: %s", what, name);
        CHECK(i == 1 ? listed[k].ndim == 2 && listed[k].shape[0] == 40 && listed[k].shape[1] == 25
                     : listed[k].ndim == 1 && listed[k].shape[0] == (int64_t)COUNT[i],
              "%s: %s has %d dimensions", what, name, listed[k].ndim);
        t[i] = listed[k];
        t[i].name = strdup(name);
        t[i].data = p[i] = (float *)malloc(COUNT[i] * sizeof(float));
    }
    ddp_checkpoint_list_free(listed, n);
    CHECK_OK(ddp_checkpoint_load(NULL, path, t, NP, NULL), NULL);
    for (i = 0; i < NP; i++) free((void *)t[i].name);
}

/* tests/interop/safetensors_io.py's reader (the standard library's json and struct; checksums checked)
   takes the file, with l1.w's shape. */
static void python_reads(const char *what) {
    char cmd[800];
    if (system("python3 -c 'import json' 2>/dev/null") != 0) {
        printf("SKIP-PART python reader: no python3\n");
        return;
    }
    snprintf(cmd, sizeof cmd, "python3 -c 'import sys; sys.path.insert(0, \"tests/interop\"); import safetensors_io as st; "
             "m, t = st.read_file(sys.argv[1]); assert len(t) == %d and list(t[\"l1.w\"][1]) == [40, 25], t[\"l1.w\"][:2]' "
             "%s/%s", NP, dir, what);
    CHECK(system(cmd) == 0, "safetensors_io.py does not read %s", what);
}

static void compare(float *a[NP], float *b[NP], double tol, const char *what) {
    int i;
    size_t e;
    for (i = 0; i < NP; i++)
        for (e = 0; e < COUNT[i]; e++)
            CHECK(tol ? fsdp_close(a[i][e], b[i][e], tol) : a[i][e] == b[i][e], "%s: parameter %d [%zu]: %.9g against %.9g",
                  what, i, e, a[i][e], b[i][e]);
}

static void free_all(float *p[NP]) {
    int i;
    for (i = 0; i < NP; i++) free(p[i]);
}

int main(void) {
    static const int worlds[3] = {1, 3, 4};
    float *ref2[NP], *a[NP], *b[NP], *whole[NP];
    serial ref;
    char what[64];
    int k, t = 0, step;
    snprintf(dir, sizeof dir, "/tmp/ddp_fsdp_ckpt_%d", (int)getpid());
    tl_rm_dir(dir);
    CHECK(mkdir(dir, 0755) == 0, "mkdir %s", dir);
    CHECK(tl_run_ranks(2, run_main, NULL, 60) == 0, "2 ranks: train, save, train");
    CHECK(tl_run_ranks(2, run_main, (void *)"slices", 60) == 0, "2 ranks: resume from the slices");
    read_whole("final_2.safetensors", ref2);
    read_whole("resumed_2_slices.safetensors", a);
    compare(a, ref2, 0, "resumed on 2 ranks against the uninterrupted run");
    free_all(a);
    printf("2 ranks: resumed from the slices = the uninterrupted run, bit for bit\n");
    serial_init(&ref); /* the serial model after S1 steps of 2 ranks: the whole file */
    for (step = 0; step < S1; step++) serial_step(&ref, &M, 2, step, ++t);
    read_whole("whole.safetensors", whole);
    python_reads("whole.safetensors");
    compare(whole, ref.p, 1e-6, "ddp_fsdp_save_full after S1 steps against the serial model");
    free_all(whole);
    for (k = 0; k < 3; k++) {
        int n = worlds[k], tn = t;
        serial cont = ref;
        CHECK(tl_run_ranks(n, run_main, (void *)"slices", 60) == 0, "%d ranks: resume from the slices", n);
        CHECK(tl_run_ranks(n, run_main, (void *)"whole", 60) == 0, "%d ranks: resume from the whole file", n);
        snprintf(what, sizeof what, "resumed_%d_slices.safetensors", n);
        read_whole(what, a);
        snprintf(what, sizeof what, "resumed_%d_whole.safetensors", n);
        read_whole(what, b);
        compare(b, a, 0, "parameters from the whole file against parameters from the slices");
        serial_init(&cont); /* the serial model: S1 steps of 2 ranks' gradients, then S2 of n ranks' */
        for (step = 0, tn = 0; step < S1; step++) serial_step(&cont, &M, 2, step, ++tn);
        for (; step < S1 + S2; step++) serial_step(&cont, &M, n, step, ++tn);
        compare(a, cont.p, 1e-5, "resumed on another world size against the serial model");
        serial_free(&cont);
        free_all(a), free_all(b);
        printf("%d ranks: resumed from the slices = from the whole file, bit for bit; = serial within 1e-5\n", n);
    }
    serial_free(&ref);
    free_all(ref2);
    CHECK(tl_run_ranks(2, errors_main, NULL, 60) == 0, "errors");
    CHECK(tl_count_files(dir, "", ".tmp") == 0, "a temporary file was left behind");
    tl_rm_dir(dir);
    printf("test_reducer_fsdp_ckpt: ok\n");
    return 0;
}
