/* Checkpoints with a group of 2, 3 and 4 real processes (tl_run_ranks + ddp_init):
   - save: only rank 0's tensors are written, and the file is complete on every rank when save returns
   - load: every rank reads; or rank 0 reads and broadcasts (the others pass a path that does not
     exist, so success shows the data came by broadcast)
   - failures anywhere are errors everywhere, naming the rank: rank 0 cannot read (broadcast), rank 1
     cannot read (every rank reads), rank 0 has a bad argument (save), lists differ (broadcast)
   - a file without checksums (another writer's) loads by broadcast and by every rank; require_checksums
     refuses it on every rank
   - shards: each rank's own data round trips; a stale shard of rank 1 fails every rank; a shard set
     saved by another world size is DDP_ERR_MISMATCH; keep_last removes every rank's old shards
   - async save: collectives run while it writes, the file is rank 0's data at the call, a failure is
     every rank's, ddp_destroy with a save in flight finishes it, a rank dying during it fails the others' ddp_wait
   - resize resume: 4 processes take part of an epoch and save, 3 processes resume and finish it; every
     index once (with and without drop_last)
   - slices of 3 global tensors saved on 4/3/2/1 ranks and loaded on 3/5/1/4: every element back; another
     global_count, or a tensor nobody saved, fails on every rank
   - on 3 ranks: slices that overlap, a replicated tensor saved whole by every rank, or slices that
     disagree on global_count are refused at save on every rank, and no file is written; a hole ([8, 10))
     or a range an old save holds twice is named at load
   - keep_last after a resume on fewer ranks (4 -> 2) removes the shards of the ranks the group no longer
     has: every rotated shard */
#include "testlib.h"

#include <dirent.h>
#include <sys/stat.h>

static char dir[256];

#define N 1000

typedef struct model {
    float w[N];
    int64_t step;
    ddp_tensor t[2];
} model;

static void model_init(model *m, uint64_t seed) {
    int i;
    for (i = 0; i < N; i++) m->w[i] = (float)(tl_rand(&seed) % 1000) * 0.5f;
    m->step = (int64_t)seed;
    memset(m->t, 0, sizeof m->t);
    m->t[0].name = "w";
    m->t[0].dtype = DDP_F32;
    m->t[0].ndim = 2;
    m->t[0].shape[0] = 10;
    m->t[0].shape[1] = N / 10;
    m->t[0].data = m->w;
    m->t[1].name = "step";
    m->t[1].dtype = DDP_I64;
    m->t[1].ndim = 0;
    m->t[1].data = &m->step;
}

static const char *at(const char *name, char *buf, size_t cap) {
    snprintf(buf, cap, "%s/%s", dir, name);
    return buf;
}

static int same(const model *a, const model *b) { return memcmp(a->w, b->w, sizeof a->w) == 0 && a->step == b->step; }

static void expect_fail(ddp_group *g, ddp_result r, ddp_result want, const char *needle, const char *what) {
    CHECK(r == want, "rank %d, %s: got %s (%s)", ddp_rank(g), what, ddp_result_string(r), ddp_last_error(g));
    CHECK(strstr(ddp_last_error(g), needle), "rank %d, %s: message \"%s\" lacks \"%s\"", ddp_rank(g), what, ddp_last_error(g), needle);
}

static void copy_file(const char *from, const char *to) {
    char buf[65536];
    size_t n;
    FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
    CHECK(a && b, "copy %s -> %s", from, to);
    while ((n = fread(buf, 1, sizeof buf, a)) > 0) CHECK(fwrite(buf, 1, n, b) == n, "copy");
    fclose(a);
    fclose(b);
}

static int rank_main(int rank, int n, void *arg) {
    ddp_group *g;
    model mine, got, want;
    ddp_meta meta = {0, 0, 0}, back = {0, 0, 0};
    ddp_checkpoint_load_desc bd;
    char p[512], q[512], name[64];
    int64_t v;
    (void)arg;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    CHECK(ddp_rank(g) == rank && ddp_world_size(g) == n, "init");
    memset(&bd, 0, sizeof bd);
    bd.broadcast = 1;

    /* save: rank 0's data is what lands; the file is whole as soon as save returns, on every rank */
    model_init(&mine, 100 + (uint64_t)rank);
    model_init(&want, 100);
    CHECK_OK(ddp_meta_set_int(&meta, DDP_META_WORLD_SIZE, n), g);
    snprintf(name, sizeof name, "model_w%d.safetensors", n);
    CHECK_OK(ddp_checkpoint_save(g, at(name, p, sizeof p), mine.t, 2, &meta), g);
    model_init(&got, 7);
    CHECK_OK(ddp_checkpoint_load(g, p, got.t, 2, &back), g);
    CHECK(same(&got, &want), "rank %d loaded something other than rank 0's tensors", rank);
    CHECK_OK(ddp_meta_get_int(&back, DDP_META_WORLD_SIZE, &v), NULL);
    CHECK(v == n, "metadata");

    /* broadcast: only rank 0's path is used */
    model_init(&got, 7);
    CHECK_OK(ddp_checkpoint_load_ex(g, rank == 0 ? p : "/nonexistent/ckpt.safetensors", got.t, 2, &back, &bd), g);
    CHECK(same(&got, &want), "rank %d: broadcast load", rank);
    CHECK_OK(ddp_meta_get_int(&back, DDP_META_WORLD_SIZE, &v), NULL);
    CHECK(v == n, "metadata by broadcast");

    /* failures are everyone's */
    expect_fail(g, ddp_checkpoint_load_ex(g, rank == 0 ? "/nonexistent/a.safetensors" : p, got.t, 2, NULL, &bd), DDP_ERR_IO,
                rank == 0 ? "cannot open" : "rank 0", "rank 0 cannot read (broadcast)");
    expect_fail(g, ddp_checkpoint_load(g, rank == 1 ? "/nonexistent/b.safetensors" : p, got.t, 2, NULL), DDP_ERR_IO,
                rank == 1 ? "cannot open" : "rank 1", "rank 1 cannot read");
    {
        ddp_tensor bad = mine.t[0];
        bad.dtype = rank == 0 ? (ddp_dtype)42 : DDP_F32;
        expect_fail(g, ddp_checkpoint_save(g, at("bad.safetensors", q, sizeof q), &bad, 1, NULL), DDP_ERR_INVALID_ARGUMENT,
                    rank == 0 ? "invalid dtype" : "rank 0", "bad argument on rank 0");
    }
    {
        ddp_tensor one = got.t[rank == 0 ? 0 : 1];
        ddp_checkpoint_load_desc sub = bd;
        sub.allow_unexpected = 1;
        expect_fail(g, ddp_checkpoint_load_ex(g, p, &one, 1, NULL, &sub), DDP_ERR_MISMATCH, rank == 0 ? "rank 1" : "step",
                    "different lists with broadcast");
    }
    /* a file from another writer (as safetensors.torch.save_file writes it: no ddp.crc32c checksums) loads
       by every path; require_checksums refuses it on every rank, whichever rank asked (issue #35) */
    {
        char json[160];
        int len = snprintf(json, sizeof json, "{\"step\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[0,8]},"
                                              "\"w\":{\"dtype\":\"F32\",\"shape\":[10,%d],\"data_offsets\":[8,%d]}}", N / 10, 8 + 4 * N);
        ddp_checkpoint_load_desc req = bd;
        at("torch.safetensors", q, sizeof q);
        if (rank == 0) {
            FILE *f = fopen(q, "wb");
            unsigned char prefix[8];
            int k;
            while ((8 + len) % 8) json[len++] = ' ';
            for (k = 0; k < 8; k++) prefix[k] = (unsigned char)((uint64_t)len >> (8 * k));
            CHECK(f && fwrite(prefix, 1, 8, f) == 8 && fwrite(json, 1, (size_t)len, f) == (size_t)len &&
                      fwrite(&want.step, 8, 1, f) == 1 && fwrite(want.w, sizeof want.w, 1, f) == 1 && fclose(f) == 0,
                  "writing %s", q);
        }
        CHECK_OK(ddp_barrier(g), g);
        model_init(&got, 7);
        CHECK_OK(ddp_checkpoint_load_ex(g, rank == 0 ? q : "/nonexistent/torch.safetensors", got.t, 2, NULL, &bd), g);
        CHECK(same(&got, &want), "rank %d: broadcast load of a file without checksums", rank);
        model_init(&got, 7);
        CHECK_OK(ddp_checkpoint_load(g, q, got.t, 2, NULL), g);
        CHECK(same(&got, &want), "rank %d: load of a file without checksums", rank);
        req.require_checksums = 1;
        expect_fail(g, ddp_checkpoint_load_ex(g, q, got.t, 2, NULL, &req), DDP_ERR_FORMAT, rank == 0 ? "require_checksums" : "rank 0",
                    "require_checksums (broadcast)");
        req.broadcast = 0;
        req.require_checksums = rank == 1;
        expect_fail(g, ddp_checkpoint_load_ex(g, q, got.t, 2, NULL, &req), DDP_ERR_FORMAT, rank == 1 ? "require_checksums" : "rank 1",
                    "require_checksums on rank 1");
    }
    /* a save that fails on one rank (issue #18): on every rank the message names the save, the path, the
       rank that failed and the OS error (not the collective that carried the news) */
    {
        static const char *const needles[] = {"checkpoint save failed on rank 0", "/nonexistent-dir/c.safetensors",
                                              "No such file or directory"};
        static const char *const shard_needles[] = {"checkpoint shard save failed on rank 1", ".rank1.tmp", "Is a directory"};
        char blocker[600];
        int k;
        expect_fail(g, ddp_checkpoint_save(g, "/nonexistent-dir/c.safetensors", mine.t, 2, NULL), DDP_ERR_IO, needles[0],
                    "save into a missing directory");
        for (k = 1; k < 3; k++)
            CHECK(strstr(ddp_last_error(g), needles[k]), "rank %d: \"%s\" lacks \"%s\"", rank, ddp_last_error(g), needles[k]);
        CHECK(!strstr(ddp_last_error(g), "all_gather"), "rank %d: the message names the collective: %s", rank, ddp_last_error(g));
        /* rank 1 cannot write its shard: a directory stands where its temporary file goes */
        snprintf(name, sizeof name, "blocked_w%d.safetensors", n);
        at(name, q, sizeof q);
        snprintf(blocker, sizeof blocker, "%s.rank1.tmp", q);
        if (rank == 1) CHECK(mkdir(blocker, 0700) == 0, "mkdir %s", blocker);
        CHECK_OK(ddp_barrier(g), g);
        expect_fail(g, ddp_checkpoint_save_shard(g, q, mine.t, 2, NULL, NULL), DDP_ERR_IO, shard_needles[0],
                    "shard save blocked on rank 1");
        for (k = 1; k < 3; k++)
            CHECK(strstr(ddp_last_error(g), shard_needles[k]), "rank %d: \"%s\" lacks \"%s\"", rank, ddp_last_error(g), shard_needles[k]);
        CHECK(!strstr(ddp_last_error(g), "all_gather"), "rank %d: the message names the collective: %s", rank, ddp_last_error(g));
        CHECK_OK(ddp_barrier(g), g);
        if (rank == 1) rmdir(blocker);
    }
    /* the group still works after all those errors */
    model_init(&got, 7);
    CHECK_OK(ddp_checkpoint_load(g, p, got.t, 2, NULL), g);
    CHECK(same(&got, &want), "load after errors");

    /* shards: each rank's own data */
    {
        ddp_checkpoint_save_desc sd;
        char shard[600], old[620];
        memset(&sd, 0, sizeof sd);
        snprintf(name, sizeof name, "opt_w%d_%06d.safetensors", n, 1);
        CHECK_OK(ddp_checkpoint_save_shard(g, at(name, p, sizeof p), mine.t, 2, &meta, NULL), g);
        model_init(&got, 7);
        CHECK_OK(ddp_checkpoint_load_shard(g, p, got.t, 2, &back, NULL), g);
        CHECK(same(&got, &mine), "rank %d: own shard", rank);
        model_init(&got, 7);
        CHECK_OK(ddp_checkpoint_load_shard(g, p, got.t, 2, NULL, &bd), g);
        CHECK(same(&got, &mine), "rank %d: own shard, marker broadcast", rank);

        /* rank 1 puts back its shard of an earlier save: every rank must refuse the set */
        snprintf(shard, sizeof shard, "%s.rank%d", p, rank);
        snprintf(old, sizeof old, "%s.old", shard);
        if (rank == 1) copy_file(shard, old);
        CHECK_OK(ddp_checkpoint_save_shard(g, p, mine.t, 2, &meta, NULL), g);
        if (rank == 1) CHECK(rename(old, shard) == 0, "rename");
        CHECK_OK(ddp_barrier(g), g);
        expect_fail(g, ddp_checkpoint_load_shard(g, p, got.t, 2, NULL, NULL), DDP_ERR_FORMAT, rank == 1 ? "incomplete" : "rank 1",
                    "stale shard on rank 1");

        /* saved by one process: another world size */
        expect_fail(g, ddp_checkpoint_load_shard(g, at("single.safetensors", q, sizeof q), got.t, 2, NULL, NULL), DDP_ERR_MISMATCH,
                    "saved by 1 ranks", "world size differs");

        /* keep_last 1 over three saves: one marker and its n shards remain */
        sd.keep_last = 1;
        for (v = 2; v <= 4; v++) {
            snprintf(name, sizeof name, "opt_w%d_%06lld.safetensors", n, (long long)v);
            CHECK_OK(ddp_checkpoint_save_shard(g, at(name, p, sizeof p), mine.t, 2, NULL, &sd), g);
        }
        CHECK_OK(ddp_barrier(g), g);
        if (rank == 0) {
            char prefix[32];
            int count;
            snprintf(prefix, sizeof prefix, "opt_w%d_", n);
            count = tl_count_files(dir, prefix, NULL);
            CHECK(count == 1 + n, "keep_last 1 left %d files of opt_w%d (want %d)", count, n, 1 + n);
        }
        model_init(&got, 7);
        CHECK_OK(ddp_checkpoint_load_shard(g, p, got.t, 2, NULL, NULL), g);
        CHECK(same(&got, &mine), "after rotation");
    }
    /* async save (issue #21): the program's collectives go on while it is written; the file holds rank
       0's tensors as they were at the call; a failure is every rank's ddp_wait error, naming rank 0, the
       path and the reason; ddp_destroy with a save in flight finishes it (main checks the file) */
    {
        ddp_work *w;
        float x;
        int k;
        model_init(&mine, 300 + (uint64_t)rank);
        snprintf(name, sizeof name, "async_w%d.safetensors", n);
        CHECK_OK(ddp_checkpoint_save_async(g, at(name, p, sizeof p), mine.t, 2, &meta, &w), g);
        model_init(&mine, 999); /* the next training step overwrites the tensors */
        for (k = 0; k < 20; k++) {
            x = 1.0f;
            CHECK_OK(ddp_all_reduce(g, &x, 1, DDP_F32, DDP_SUM), g);
            CHECK(x == (float)n, "rank %d: all_reduce during an async save gave %g", rank, (double)x);
        }
        CHECK_OK(ddp_wait(w), g);
        model_init(&want, 300);
        model_init(&got, 7);
        CHECK_OK(ddp_checkpoint_load(g, p, got.t, 2, NULL), g);
        CHECK(same(&got, &want), "rank %d: the async save does not hold rank 0's tensors as they were at the call", rank);

        {
            double t0 = tl_now(), took;
            CHECK_OK(ddp_checkpoint_save_async(g, "/nonexistent-dir/d.safetensors", mine.t, 2, NULL, &w), g);
            CHECK_OK(ddp_barrier(g), g);
            expect_fail(g, ddp_wait(w), DDP_ERR_IO, "checkpoint save (async) failed on rank 0", "async save into a missing directory");
            took = tl_now() - t0;
            CHECK(took < 10.0, "rank %d: the failed async save took %.1f s to report", rank, took);
            if (rank == n - 1) printf("%d ranks: a failing async save reported on rank %d after %.4f s\n", n, rank, took);
        }
        CHECK(strstr(ddp_last_error(g), "/nonexistent-dir/d.safetensors.tmp") && strstr(ddp_last_error(g), "No such file or directory"),
              "rank %d: %s", rank, ddp_last_error(g));
        CHECK_OK(ddp_barrier(g), g); /* the group goes on */

        model_init(&mine, 500 + (uint64_t)rank);
        snprintf(name, sizeof name, "async_destroy_w%d.safetensors", n);
        CHECK_OK(ddp_checkpoint_save_async(g, at(name, p, sizeof p), mine.t, 2, NULL, &w), g);
    }
    ddp_meta_free(&meta);
    ddp_meta_free(&back);
    CHECK_OK(ddp_destroy(g), NULL); /* with the last async save in flight, never waited on */
    return 0;
}

/* A rank dies while the others' async save is in flight: their ddp_wait fails naming it (the agreement on
   the save's private group loses it), within seconds rather than the group's timeout. The first save,
   waited on by all, makes the private group; the last rank then dies instead of making the second (so it
   cannot have taken part in that save's agreement before dying). */
static int async_death_main(int rank, int n, void *arg) {
    ddp_group *g;
    model m;
    ddp_work *w;
    char p[512];
    double t0, took;
    (void)arg;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    model_init(&m, 1);
    CHECK_OK(ddp_checkpoint_save_async(g, at("async_death.safetensors", p, sizeof p), m.t, 2, NULL, &w), g);
    CHECK_OK(ddp_wait(w), g);
    if (rank == n - 1) _exit(7); /* as a crash would */
    t0 = tl_now();
    CHECK_OK(ddp_checkpoint_save_async(g, p, m.t, 2, NULL, &w), g);
    expect_fail(g, ddp_wait(w), DDP_ERR_PEER_LOST, "lost rank 2", "a rank died during the async save");
    CHECK(strstr(ddp_last_error(g), "checkpoint save (async) of ") && strstr(ddp_last_error(g), "async_death.safetensors"),
          "rank %d: the message does not name the save: %s", rank, ddp_last_error(g));
    took = tl_now() - t0;
    CHECK(took < 10.0, "rank %d: the lost rank took %.1f s to report (the timeout is 300 s)", rank, took);
    if (rank == 0) printf("async save, rank 2 dies: ddp_wait on rank 0 failed after %.3f s: %s\n", took, ddp_last_error(g));
    ddp_destroy(g); /* fails too (rank 2 is gone); frees everything */
    return 0;
}

/* Resize resume with real processes (issue #21): `from` ranks take SEEN_STEPS batches of the epoch, rank 0
   saves the resume state (ddp_checkpoint_save, global position from its sampler); `to` ranks load it,
   ddp_sampler_resume and finish the epoch. Each rank writes the indices it took to dir/seen_<phase>_<rank>;
   main counts them against the epoch's permutation. */
#define RS_N 1001
#define RS_EPOCH 3
#define RS_BATCH 8
#define RS_SEEN_STEPS 5
typedef struct resize_arg {
    int phase; /* 0: the first run, 1: the resumed one */
    int drop_last;
} resize_arg;

static void resize_path(char *buf, size_t cap, const resize_arg *a, int rank) {
    snprintf(buf, cap, "%s/seen_%d_%d_%d", dir, a->drop_last, a->phase, rank);
}

static int resize_main(int rank, int n, void *arg) {
    const resize_arg *a = (const resize_arg *)arg;
    ddp_group *g;
    ddp_sampler s;
    ddp_sampler_desc d;
    ddp_resume_state rs;
    ddp_meta meta = {0, 0, 0};
    int64_t batch[RS_BATCH], dummy = 0;
    ddp_tensor t;
    size_t got;
    char p[512], ck[512];
    FILE *f;
    int steps = 0;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    memset(&d, 0, sizeof d);
    memset(&rs, 0, sizeof rs);
    memset(&t, 0, sizeof t);
    t.name = "dummy", t.dtype = DDP_I64, t.ndim = 0, t.data = &dummy;
    d.dataset_size = RS_N, d.num_replicas = n, d.rank = rank, d.seed = 21, d.drop_last = a->drop_last;
    CHECK_OK(ddp_sampler_init(&s, &d), NULL);
    snprintf(ck, sizeof ck, "%s/resize_%d.safetensors", dir, a->drop_last);
    if (a->phase == 1) {
        CHECK_OK(ddp_checkpoint_load(g, ck, &t, 1, &meta), g);
        CHECK_OK(ddp_meta_get_resume(&meta, &rs), NULL);
        CHECK(rs.epoch == RS_EPOCH && rs.world_size == 4, "resume state");
        CHECK_OK(ddp_sampler_resume(&s, (uint64_t)rs.epoch, (uint64_t)rs.sampler_global_position), NULL);
    } else {
        ddp_sampler_set_epoch(&s, RS_EPOCH);
    }
    resize_path(p, sizeof p, a, rank);
    f = fopen(p, "wb");
    CHECK(f, "open %s", p);
    while ((a->phase == 1 || steps < RS_SEEN_STEPS) && ddp_sampler_next_batch(&s, RS_BATCH, batch, &got) == DDP_SUCCESS && got) {
        CHECK(fwrite(batch, sizeof batch[0], got, f) == got, "write");
        CHECK_OK(ddp_barrier(g), g); /* a training step */
        steps++;
    }
    fclose(f);
    if (a->phase == 0) {
        rs.epoch = RS_EPOCH, rs.step = steps, rs.world_size = n;
        rs.sampler_position = (int64_t)ddp_sampler_position(&s);
        rs.sampler_global_position = (int64_t)ddp_sampler_global_position(&s);
        CHECK(rs.sampler_global_position == (int64_t)(RS_SEEN_STEPS * RS_BATCH * n), "global position %lld", (long long)rs.sampler_global_position);
        CHECK_OK(ddp_meta_set_resume(&meta, &rs), NULL);
        CHECK_OK(ddp_checkpoint_save(g, ck, &t, 1, &meta), g);
    }
    ddp_meta_free(&meta);
    ddp_sampler_free(&s);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* Save on 4 processes, resume on 3: without drop_last every index of the epoch once plus torch's padding
   at the end; with drop_last none twice and only the tail of the rest dropped. */
static void test_resize_resume_ranks(int drop_last) {
    resize_arg a;
    ddp_sampler_desc d;
    ddp_sampler one;
    int64_t perm[RS_N], x;
    unsigned count[RS_N];
    uint64_t i, seen = 0, extra = 0, unseen = 0, c, want_extra, want_unseen;
    int phase, r, sizes[2] = {4, 3};
    char p[512];
    memset(count, 0, sizeof count);
    a.drop_last = drop_last;
    for (phase = 0; phase < 2; phase++) {
        a.phase = phase;
        CHECK(tl_run_ranks(sizes[phase], resize_main, &a, 120) == 0, "resize resume, phase %d on %d ranks failed", phase, sizes[phase]);
        for (r = 0; r < sizes[phase]; r++) {
            FILE *f;
            resize_path(p, sizeof p, &a, r);
            f = fopen(p, "rb");
            CHECK(f, "open %s", p);
            while (fread(&x, sizeof x, 1, f) == 1) {
                CHECK(x >= 0 && x < RS_N, "index %lld", (long long)x);
                count[x]++, seen++;
            }
            fclose(f);
            unlink(p);
        }
    }
    memset(&d, 0, sizeof d); /* the epoch's permutation, independently: one replica */
    d.dataset_size = RS_N, d.num_replicas = 1, d.seed = 21;
    CHECK_OK(ddp_sampler_init(&one, &d), NULL);
    ddp_sampler_set_epoch(&one, RS_EPOCH);
    CHECK_OK(ddp_sampler_indices(&one, perm), NULL);
    ddp_sampler_free(&one);
    c = RS_N - RS_SEEN_STEPS * RS_BATCH * 4; /* left after the first run: 841 */
    want_extra = drop_last ? 0 : (c + 2) / 3 * 3 - c;
    want_unseen = drop_last ? c % 3 : 0;
    for (i = 0; i < RS_N; i++) {
        if (!count[perm[i]]) unseen++;
        else extra += count[perm[i]] - 1;
        if (!drop_last) CHECK(count[perm[i]] == 1 + (i < want_extra), "perm[%llu] = %lld seen %u times", (unsigned long long)i, (long long)perm[i], count[perm[i]]);
        else CHECK(count[perm[i]] == (i < RS_N - want_unseen), "drop_last: perm[%llu] seen %u times", (unsigned long long)i, count[perm[i]]);
    }
    CHECK(unseen == want_unseen && extra == want_extra, "unseen %llu extra %llu", (unsigned long long)unseen, (unsigned long long)extra);
    printf("resize resume%s: 4 processes took %d indices, 3 processes finished the epoch: %llu handed out, every index of %d once%s\n",
           drop_last ? " (drop_last)" : "", RS_SEEN_STEPS * RS_BATCH * 4, (unsigned long long)seen, RS_N,
           drop_last ? ", the last 1 dropped" : " plus 2 padding repeats of the first");
}

/* ---- slices saved by N ranks, loaded by M (ddp_checkpoint_save_slices / load_slices) ----
   Three global tensors (f32 of 1000 and 7 elements, f64 of 333), each cut into world nearly equal
   contiguous slices (rank r: [r*len/w, (r+1)*len/w)); element i of tensor k holds slice_value(k, i),
   whoever saved it. Saved on `from` ranks, loaded on `to` ranks with their own cut: every element must
   come back; then a request past what was saved (another global_count) fails on every rank. */
static const size_t SL_LEN[3] = {1000, 7, 333};
static double slice_value(int k, size_t i) { return (double)k * 10000.0 + (double)i * 0.5; }
typedef struct slice_arg {
    int save; /* 1: save on these ranks; 0: load */
    int from; /* the world size that saved */
} slice_arg;

static void slice_cut(int k, int rank, int world, ddp_slice *s, void *data) {
    static const char *names[3] = {"exp_avg/embed", "exp_avg/bias", "exp_avg_sq/head"};
    s->name = names[k];
    s->dtype = k == 2 ? DDP_F64 : DDP_F32;
    s->global_count = SL_LEN[k];
    s->offset = SL_LEN[k] * (size_t)rank / (size_t)world;
    s->count = SL_LEN[k] * (size_t)(rank + 1) / (size_t)world - s->offset;
    s->data = data;
}

static int slices_main(int rank, int n, void *arg) {
    const slice_arg *a = (const slice_arg *)arg;
    ddp_group *g;
    ddp_slice s[3];
    float f[2][1000];
    double d[333];
    ddp_meta meta = {0, 0, 0};
    char p[512];
    size_t i;
    int k;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    snprintf(p, sizeof p, "%s/slices_from%d.safetensors", dir, a->from);
    for (k = 0; k < 3; k++) slice_cut(k, rank, n, &s[k], k == 2 ? (void *)d : (void *)f[k]);
    if (a->save) {
        for (k = 0; k < 3; k++)
            for (i = 0; i < s[k].count; i++) {
                double v = slice_value(k, s[k].offset + i);
                if (k == 2) d[i] = v;
                else f[k][i] = (float)v;
            }
        CHECK_OK(ddp_meta_set_int(&meta, "step", 77), g);
        CHECK_OK(ddp_checkpoint_save_slices(g, p, s, 3, &meta, NULL), g);
    } else {
        memset(f, 0xff, sizeof f);
        memset(d, 0xff, sizeof d);
        CHECK_OK(ddp_checkpoint_load_slices(g, p, s, 3, &meta), g);
        for (k = 0; k < 3; k++)
            for (i = 0; i < s[k].count; i++) {
                double got = k == 2 ? d[i] : (double)f[k][i];
                CHECK(got == slice_value(k, s[k].offset + i), "saved on %d, loaded on %d ranks: rank %d, %s[%zu] = %g, want %g",
                      a->from, n, rank, s[k].name, s[k].offset + i, got, slice_value(k, s[k].offset + i));
            }
        CHECK(ddp_meta_get(&meta, "step") && strcmp(ddp_meta_get(&meta, "step"), "77") == 0, "rank %d: metadata step %s", rank,
              ddp_meta_get(&meta, "step") ? ddp_meta_get(&meta, "step") : "(none)");
        { /* rank 0 asks for a tensor nobody saved: a gap, on every rank */
            ddp_slice miss;
            memset(&miss, 0, sizeof miss);
            miss.name = "never_saved", miss.dtype = DDP_F32, miss.global_count = 4, miss.count = rank == 0 ? 4 : 0, miss.data = f[0];
            expect_fail(g, ddp_checkpoint_load_slices(g, p, &miss, 1, NULL), DDP_ERR_MISMATCH,
                        rank == 0 ? "lacks elements [0, 4) of \"never_saved\"" : "rank 0", "a slice nobody saved");
        }
        s[1].global_count = 8, s[1].offset = 0, s[1].count = rank == n - 1 ? 8 : 0; /* the last rank asks for more than exists */
        expect_fail(g, ddp_checkpoint_load_slices(g, p, s, 3, NULL), DDP_ERR_MISMATCH, "global_count", "a slice of another size");
    }
    ddp_meta_free(&meta);
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

static void test_slices(void) {
    static const int pairs[][2] = {{4, 3}, {3, 5}, {2, 1}, {1, 4}};
    size_t i;
    for (i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
        slice_arg a;
        a.from = pairs[i][0];
        a.save = 1;
        CHECK(tl_run_ranks(pairs[i][0], slices_main, &a, 120) == 0, "slices saved on %d ranks failed", pairs[i][0]);
        a.save = 0;
        CHECK(tl_run_ranks(pairs[i][1], slices_main, &a, 120) == 0, "slices saved on %d ranks, loaded on %d, failed", pairs[i][0],
              pairs[i][1]);
        printf("slices: saved on %d ranks, loaded on %d: every element of 3 tensors back; a gap or another global_count fails on every rank\n",
               pairs[i][0], pairs[i][1]);
    }
}

/* ---- slices that do not fit together (issue #35) ----
   On 3 ranks, "w" of 10 f32 elements (w[i] = i + 1), into files each rank checks are not written:
   - rank 0 saves [0, 6), rank 1 [0, 4), rank 2 nothing: refused on every rank, naming both ranks and
     ranges (the old save took it, and its load of [0, 10) returned success with elements 6-9 never
     written and 0-3 from rank 1)
   - every rank saves all of "w" (a replicated tensor): refused the same way, pointing to
     ddp_checkpoint_save (the old load of it said "holds 30 of the 10 elements ... did not cover them")
   - rank 1 says global_count 12: refused, naming both sizes
   - rank 0 saves [0, 6), rank 1 [6, 8): a load of [0, 10) fails on every rank naming the hole [8, 10);
     [0, 8) loads
   - files of the old kind (written here with ddp_checkpoint_save_shard and the slice names, as the old
     save wrote them): the save and the replicated one; their loads name the range held twice
     and both ranks, instead of a success with wrong data or a count of 30 out of 10 */
static void no_files(ddp_group *g, const char *p) {
    char q[600];
    snprintf(q, sizeof q, "%s.rank%d", p, ddp_rank(g));
    CHECK_OK(ddp_barrier(g), g);
    CHECK(access(p, F_OK) != 0 && access(q, F_OK) != 0, "rank %d: a refused slice save left %s or %s", ddp_rank(g), p, q);
}

static void old_kind_save(ddp_group *g, const char *p, const float *w, size_t count) {
    ddp_tensor t;
    memset(&t, 0, sizeof t);
    t.name = "w@0/10", t.dtype = DDP_F32, t.ndim = 1, t.shape[0] = (int64_t)count, t.data = (void *)(uintptr_t)w;
    CHECK_OK(ddp_checkpoint_save_shard(g, p, &t, count ? 1 : 0, NULL, NULL), g);
}

static int slice_errors_main(int rank, int n, void *arg) {
    ddp_group *g;
    ddp_slice s;
    float w[10], back[10];
    char p[512];
    double t0;
    int i;
    (void)n, (void)arg;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    for (i = 0; i < 10; i++) w[i] = (float)(i + 1);
    memset(&s, 0, sizeof s);
    s.name = "w", s.dtype = DDP_F32, s.global_count = 10, s.data = w;

    s.count = rank == 0 ? 6 : rank == 1 ? 4 : 0;
    t0 = tl_now();
    expect_fail(g, ddp_checkpoint_save_slices(g, at("overlap.safetensors", p, sizeof p), &s, 1, NULL, NULL), DDP_ERR_INVALID_ARGUMENT,
                "checkpoint slice save of ", "overlapping slices");
    if (rank == 0) printf("3 ranks: overlapping slices refused at save after %.3f ms: %s\n", (tl_now() - t0) * 1e3, ddp_last_error(g));
    CHECK(strstr(ddp_last_error(g), "rank 0 saves \"w\" [0, 6) and rank 1 saves \"w\" [0, 4)") &&
              strstr(ddp_last_error(g), "is saved once, with ddp_checkpoint_save"),
          "rank %d: the refusal does not name both ranks and ranges: %s", rank, ddp_last_error(g));
    no_files(g, p);

    s.count = 10; /* a replicated tensor */
    expect_fail(g, ddp_checkpoint_save_slices(g, at("whole.safetensors", p, sizeof p), &s, 1, NULL, NULL), DDP_ERR_INVALID_ARGUMENT,
                "rank 0 saves \"w\" [0, 10) and rank 1 saves \"w\" [0, 10)", "every rank saves the whole tensor");
    CHECK(strstr(ddp_last_error(g), "is saved once, with ddp_checkpoint_save"), "rank %d: no pointer to ddp_checkpoint_save: %s", rank,
          ddp_last_error(g));
    no_files(g, p);

    s.offset = rank == 1 ? 5 : 0, s.count = rank == 1 ? 5 : rank == 0 ? 5 : 0, s.global_count = rank == 1 ? 12 : 10;
    expect_fail(g, ddp_checkpoint_save_slices(g, at("sizes.safetensors", p, sizeof p), &s, 1, NULL, NULL), DDP_ERR_INVALID_ARGUMENT,
                "rank 0 saves \"w\" as 10 elements of F32 but rank 1 as 12 elements of F32", "global_count differs");
    no_files(g, p);

    s.global_count = 10, s.offset = 0, s.count = 0; /* nobody stores anything: nothing to exchange, a valid save */
    CHECK_OK(ddp_checkpoint_save_slices(g, at("empty.safetensors", p, sizeof p), &s, 1, NULL, NULL), g);
    CHECK_OK(ddp_checkpoint_load_slices(g, p, &s, 1, NULL), g);
    s.offset = rank == 1 ? 6 : 0, s.count = rank == 0 ? 6 : rank == 1 ? 2 : 0, s.data = w + s.offset;
    CHECK_OK(ddp_checkpoint_save_slices(g, at("holed.safetensors", p, sizeof p), &s, 1, NULL, NULL), g);
    s.data = back, s.offset = 0, s.count = rank == 0 ? 10 : 0;
    t0 = tl_now();
    expect_fail(g, ddp_checkpoint_load_slices(g, p, &s, 1, NULL), DDP_ERR_MISMATCH,
                rank == 0 ? "lacks elements [8, 10) of \"w\", which this rank asked for ([0, 10) of 10)" : "rank 0", "a hole at the end");
    if (rank == 0) printf("3 ranks: a hole refused at load after %.3f ms: %s\n", (tl_now() - t0) * 1e3, ddp_last_error(g));
    memset(back, 0, sizeof back);
    s.count = 8;
    CHECK_OK(ddp_checkpoint_load_slices(g, p, &s, 1, NULL), g);
    CHECK(memcmp(back, w, 8 * sizeof w[0]) == 0, "rank %d: [0, 8) of the holed save", rank);

    old_kind_save(g, at("old_overlap.safetensors", p, sizeof p), w, rank == 0 ? 6 : rank == 1 ? 4 : 0);
    s.count = rank == 0 ? 10 : 0;
    expect_fail(g, ddp_checkpoint_load_slices(g, p, &s, 1, NULL), DDP_ERR_FORMAT,
                rank == 0 ? "holds elements [0, 4) of \"w\" twice, in the shards of rank 1 and rank 0" : "rank 0", "an old overlapping save");
    old_kind_save(g, at("old_whole.safetensors", p, sizeof p), w, 10);
    expect_fail(g, ddp_checkpoint_load_slices(g, p, &s, 1, NULL), DDP_ERR_FORMAT,
                rank == 0 ? "holds elements [0, 10) of \"w\" twice, in the shards of rank 0 and rank 1" : "rank 0", "an old replicated save");
    if (rank == 0) printf("3 ranks: an old replicated save at load: %s\n", ddp_last_error(g));
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

/* keep_last after a resume on fewer ranks (issue #35): steps 1-3 saved as shards by 4 ranks, then 4-6 by
   2 ranks, keep_last 1 throughout, and a leftover "<step 2>.rank3.tmp" between the two runs: only step
   6's marker and its 2 shards remain (the old rotation, each rank deleting its own shards, left step 3's
   .rank2 and .rank3 forever). */
static int resized_rotation_main(int rank, int n, void *arg) {
    int first = *(const int *)arg, v;
    ddp_group *g;
    ddp_checkpoint_save_desc sd;
    model m;
    char name[64], p[512];
    (void)n;
    CHECK_OK(ddp_init(NULL, &g), NULL);
    memset(&sd, 0, sizeof sd);
    sd.keep_last = 1;
    model_init(&m, 40 + (uint64_t)rank);
    for (v = first; v < first + 3; v++) {
        snprintf(name, sizeof name, "resized_%06d.safetensors", v);
        CHECK_OK(ddp_checkpoint_save_shard(g, at(name, p, sizeof p), m.t, 2, NULL, &sd), g);
    }
    CHECK_OK(ddp_destroy(g), NULL);
    return 0;
}

static void test_resized_rotation(void) {
    static const char *const want[] = {"resized_000006.safetensors", "resized_000006.safetensors.rank0",
                                       "resized_000006.safetensors.rank1"};
    int first = 1, count = 0, k;
    char p[512];
    DIR *d;
    struct dirent *e;
    CHECK(tl_run_ranks(4, resized_rotation_main, &first, 120) == 0, "steps 1-3 on 4 ranks failed");
    { /* a crash leftover */
        FILE *f = fopen(at("resized_000002.safetensors.rank3.tmp", p, sizeof p), "wb");
        CHECK(f && fputs("junk", f) >= 0 && fclose(f) == 0, "write %s", p);
    }
    first = 4;
    CHECK(tl_run_ranks(2, resized_rotation_main, &first, 120) == 0, "steps 4-6 on 2 ranks failed");
    d = opendir(dir);
    while ((e = readdir(d)) != NULL) {
        int known = 0;
        if (strncmp(e->d_name, "resized_", 8) != 0) continue;
        for (k = 0; k < 3; k++) known |= strcmp(e->d_name, want[k]) == 0;
        CHECK(known, "keep_last 1 after 4 -> 2 ranks left %s", e->d_name);
        count++;
    }
    closedir(d);
    CHECK(count == 3, "keep_last 1 after 4 -> 2 ranks left %d files (want step 6's marker and 2 shards)", count);
    printf("keep_last after a resume on fewer ranks: steps 1-3 on 4 ranks, 4-6 on 2: only step 6's marker and 2 shards remain\n");
}

int main(void) {
    static const int sizes[] = {2, 3, 4};
    model m;
    char p[512];
    size_t i;
    snprintf(dir, sizeof dir, "%s/ckpt_ranks_XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    CHECK(mkdtemp(dir), "mkdtemp");
    model_init(&m, 5);
    CHECK_OK(ddp_checkpoint_save_shard(NULL, at("single.safetensors", p, sizeof p), m.t, 2, NULL, NULL), NULL);
    for (i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        model back;
        char name[64];
        CHECK(tl_run_ranks(sizes[i], rank_main, NULL, 120) == 0, "%d ranks failed", sizes[i]);
        snprintf(name, sizeof name, "async_destroy_w%d.safetensors", sizes[i]);
        model_init(&m, 500);
        model_init(&back, 7);
        CHECK_OK(ddp_checkpoint_load(NULL, at(name, p, sizeof p), back.t, 2, NULL), NULL);
        CHECK(same(&back, &m), "the async save in flight at ddp_destroy did not finish with rank 0's data");
        printf("%d ranks: ok\n", sizes[i]);
    }
    {
        int codes[3];
        tl_run_ranks_status(3, async_death_main, NULL, 120, codes);
        CHECK(codes[0] == 0 && codes[1] == 0 && codes[2] == 7, "async save with a dying rank: exit codes %d %d %d", codes[0], codes[1], codes[2]);
    }
    test_resize_resume_ranks(0);
    test_resize_resume_ranks(1);
    test_slices();
    CHECK(tl_run_ranks(3, slice_errors_main, NULL, 120) == 0, "slices that do not fit together, on 3 ranks");
    printf("slices on 3 ranks: overlapping, replicated and differently sized saves refused on every rank, no file written; a hole "
           "and an old overlapping save named at load\n");
    test_resized_rotation();
    tl_rm_dir(dir);
    printf("checkpoint ranks: ok\n");
    return 0;
}
