/* onebit-stats kernel: score a chunk of P/A trace records (docs/trace-format.md) in one pass.
 *
 * Compiled through cffi by onebit_predict/stats_kernel.py; onebit_predict/stats.py documents
 * the metrics and the rules (which rows are scored, what a previous token is). This file
 * computes exactly what stats.py's numpy engine computes, record by record:
 *
 *   - the consistency control's counters (every record, whatever its layer);
 *   - the counters of the scored rows by (distance, layer) (records of layers < n_layer only):
 *     distance 0 for a record without PREDICTED, else its lookahead distance (record offset
 *     18, version 3; always 1 in a version 1/2 trace, whose field is not read);
 *   - the last record of each (seq_id, layer), carried from one chunk to the next.
 *
 * A row's previous token is its predecessor in (step, pos) order among the records of its
 * (seq_id, layer) in this chunk plus the one carried from earlier chunks, ties kept in file
 * order with the carried record first: the order of a stable sort of [carried, chunk].
 * Real traces are in that order already (steps ascend, a sequence's rows ascend within a
 * step), so a chunk is linked in file order with a hash table of the groups; a chunk that
 * is not is sorted instead.
 *
 * Set membership (is this actual id among the predicted ones, among the previous token's)
 * goes through per-expert tables stamped with a per-row counter, so nothing is cleared
 * between rows; ids outside the tables (out of range, or beyond TABLE_MAX experts) are
 * compared one by one. Trace integers are little-endian: this file refuses other hosts.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "onebit-stats kernel: the trace is little-endian and this host is not"
#endif

/* integer counters per layer, in LayerCounts' order without the two float sums */
#define OBS_C_RECORDS 0
#define OBS_C_TOKENS 1
#define OBS_C_ACTUAL 2
#define OBS_C_HITS_USED 3
#define OBS_C_HITS_DEPTH 4
#define OBS_C_HITS_READ 5
#define OBS_C_READ 6
#define OBS_C_GATED 7
#define OBS_C_EXACT 8
#define OBS_C_BASE_TOKENS 9
#define OBS_C_BASE_ACTUAL 10
#define OBS_C_BASE_HITS 11
#define OBS_N_INT 12
/* float sums per layer */
#define OBS_F_MASS_HIT 0
#define OBS_F_MASS 1
#define OBS_N_FLOAT 2
/* the control's counters, in stats._ISSUES' order */
#define OBS_I_LAYER_RANGE 0
#define OBS_I_ACTUAL_RANGE 1
#define OBS_I_ACTUAL_DUP 2
#define OBS_I_ACTUAL_W 3
#define OBS_I_N_READ_DEPTH 4
#define OBS_I_UNPREDICTED 5
#define OBS_I_PRED_MODE_OFF 6
#define OBS_I_PRED_MASK 7
#define OBS_I_PRED_RANGE 8
#define OBS_I_PRED_DUP 9
#define OBS_I_PRED_UNRANKED 10
#define OBS_I_PRED_N_READ 11
#define OBS_N_ISSUES 12

#define OBS_FLAG_PREDICTED 1u /* TRACE_FLAG_PREDICTED */
#define OBS_FLAG_DECODE 2u    /* TRACE_FLAG_DECODE */
#define OBS_N_LAYER_IDS 65536 /* layer is a u16 */
#define OBS_N_DIST 4          /* distances 0 (unpredicted) .. 3 (TRACE_MAX_DISTANCE) */
#define OBS_FIXED 20          /* TRACE_RECORD_FIXED */

#define TABLE_MAX 65536 /* experts with a lookup table entry; beyond: compared one by one */
#define PREV_NONE (-1)    /* row_prev: no earlier record of the group */
#define PREV_CARRIED (-2) /* row_prev: the group's record carried from earlier chunks */

typedef struct obs_state obs_state;

struct obs_state {
    int32_t n_layer, n_expert, n_used, depth, k, min_read, mode_off, margin_inf;
    int32_t legacy; /* version 1/2: a PREDICTED record is 1 ahead, offset 18 is not read */
    float margin;
    size_t rs; /* record size */
    int64_t *ints;   /* [OBS_N_INT][OBS_N_DIST][n_layer], owned by the caller */
    double *floats;  /* [OBS_N_FLOAT][OBS_N_DIST][n_layer], owned by the caller */
    int64_t *issues; /* [OBS_N_ISSUES], owned by the caller */
    uint8_t predictable[OBS_N_LAYER_IDS];

    /* groups (seq_id, layer): slots, and an open-addressing table of slot indices */
    int64_t n_groups, cap_groups;
    uint64_t *g_key;
    uint32_t *g_step;
    int32_t *g_pos;
    uint8_t *g_has;    /* a carried record exists */
    int32_t *g_actual; /* [cap_groups][n_used]: the carried record's actual ids */
    int32_t *g_cur;    /* this chunk: latest row of the group, PREV_CARRIED for the carried one */
    uint32_t *g_gen;   /* the chunk g_cur belongs to */
    int32_t *table;
    uint64_t table_mask;
    uint32_t gen;

    /* per-chunk scratch */
    int64_t cap_rows;
    int32_t *row_group; /* -1: layer >= n_layer, not scored */
    int32_t *row_prev;
    int32_t *touched; /* groups of this chunk */
    int64_t n_touched;
    struct sort_item *items;

    /* per-expert lookup tables, valid where the stamp is this row's */
    int32_t tsize;
    uint32_t stamp;
    uint32_t *a_stamp, *p_stamp, *b_stamp;
    int32_t *p_rank; /* first index of the id in the prediction */
};

struct sort_item {
    int32_t g;
    uint32_t step;
    int32_t pos;
    int32_t idx; /* chunk row, or -1 for the carried record (first among ties) */
};

static inline int32_t ld_i32(const uint8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }
static inline uint32_t ld_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint16_t ld_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline float ld_f32(const uint8_t *p) { float v; memcpy(&v, p, 4); return v; }

void obs_free(obs_state *s);

obs_state *obs_new(int32_t n_layer, int32_t n_expert, int32_t n_used, int32_t depth, float margin,
                   int32_t min_read, int32_t mode_off, int32_t legacy, const uint8_t *predictable,
                   int64_t *ints, double *floats, int64_t *issues) {
    if (n_layer < 1 || n_expert < 1 || n_used < 1 || depth < 1) return NULL;
    obs_state *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->n_layer = n_layer;
    s->n_expert = n_expert;
    s->n_used = n_used;
    s->depth = depth;
    s->k = n_used < depth ? n_used : depth;
    s->min_read = min_read;
    s->mode_off = mode_off;
    s->legacy = legacy;
    s->margin = margin;
    s->margin_inf = isinf(margin) && margin > 0;
    s->rs = (size_t)OBS_FIXED + 8u * (size_t)n_used + 8u * (size_t)depth;
    s->ints = ints;
    s->floats = floats;
    s->issues = issues;
    memcpy(s->predictable, predictable, OBS_N_LAYER_IDS);
    s->tsize = n_expert < TABLE_MAX ? n_expert : TABLE_MAX;
    s->a_stamp = calloc((size_t)s->tsize, sizeof(uint32_t));
    s->p_stamp = calloc((size_t)s->tsize, sizeof(uint32_t));
    s->b_stamp = calloc((size_t)s->tsize, sizeof(uint32_t));
    s->p_rank = calloc((size_t)s->tsize, sizeof(int32_t));
    s->table_mask = 255;
    s->table = malloc((s->table_mask + 1) * sizeof(int32_t));
    if (!s->a_stamp || !s->p_stamp || !s->b_stamp || !s->p_rank || !s->table) {
        obs_free(s);
        return NULL;
    }
    memset(s->table, 0xff, (s->table_mask + 1) * sizeof(int32_t));
    return s;
}

void obs_free(obs_state *s) {
    if (!s) return;
    free(s->g_key); free(s->g_step); free(s->g_pos); free(s->g_has); free(s->g_actual);
    free(s->g_cur); free(s->g_gen); free(s->table);
    free(s->row_group); free(s->row_prev); free(s->touched); free(s->items);
    free(s->a_stamp); free(s->p_stamp); free(s->b_stamp); free(s->p_rank);
    free(s);
}

static inline uint32_t next_stamp(obs_state *s) {
    if (++s->stamp == 0) { /* wrapped after 2^32 rows: old stamps would look current */
        size_t bytes = (size_t)s->tsize * sizeof(uint32_t);
        memset(s->a_stamp, 0, bytes);
        memset(s->p_stamp, 0, bytes);
        memset(s->b_stamp, 0, bytes);
        s->stamp = 1;
    }
    return s->stamp;
}

static inline uint64_t slot_of(uint64_t key, uint64_t mask) {
    return (key * 0x9E3779B97F4A7C15ull >> 20) & mask;
}

static int grow_groups(obs_state *s) {
    int64_t cap = s->cap_groups ? 2 * s->cap_groups : 256;
    if (cap > INT32_MAX) return -1;
    void *p;
#define GROW(field, n) \
    if (!(p = realloc(s->field, (size_t)(n) * sizeof *s->field))) return -1; \
    s->field = p;
    GROW(g_key, cap) GROW(g_step, cap) GROW(g_pos, cap) GROW(g_has, cap) GROW(g_cur, cap) GROW(g_gen, cap)
    GROW(g_actual, cap * s->n_used)
#undef GROW
    s->cap_groups = cap;
    /* the table stays at most half full */
    uint64_t size = s->table_mask + 1;
    if ((uint64_t)cap * 2 > size) {
        while ((uint64_t)cap * 2 > size) size *= 2;
        int32_t *t = malloc(size * sizeof(int32_t));
        if (!t) return -1;
        memset(t, 0xff, size * sizeof(int32_t));
        for (int64_t g = 0; g < s->n_groups; g++) {
            uint64_t h = slot_of(s->g_key[g], size - 1);
            while (t[h] >= 0) h = (h + 1) & (size - 1);
            t[h] = (int32_t)g;
        }
        free(s->table);
        s->table = t;
        s->table_mask = size - 1;
    }
    return 0;
}

/* the slot of (seq_id, layer), a new one (nothing carried) if the group is new; -1: out of memory */
static inline int32_t group_of(obs_state *s, int32_t seq, uint16_t layer) {
    uint64_t key = ((uint64_t)(uint32_t)seq << 16) | layer;
    uint64_t h = slot_of(key, s->table_mask);
    for (;;) {
        int32_t g = s->table[h];
        if (g < 0) break;
        if (s->g_key[g] == key) return g;
        h = (h + 1) & s->table_mask;
    }
    if (s->n_groups == s->cap_groups) {
        if (grow_groups(s)) return -1;
        h = slot_of(key, s->table_mask); /* the table may have been rebuilt */
        while (s->table[h] >= 0) h = (h + 1) & s->table_mask;
    }
    int32_t g = (int32_t)s->n_groups++;
    s->table[h] = g;
    s->g_key[g] = key;
    s->g_has[g] = 0;
    s->g_gen[g] = 0;
    return g;
}

static int ensure_rows(obs_state *s, int64_t n) {
    if (n <= s->cap_rows) return 0;
    void *p;
#define GROW(field, count) \
    if (!(p = realloc(s->field, (size_t)(count) * sizeof *s->field))) return -1; \
    s->field = p;
    GROW(row_group, n) GROW(row_prev, n) GROW(touched, n) GROW(items, 2 * n)
#undef GROW
    s->cap_rows = n;
    return 0;
}

static int cmp_items(const void *pa, const void *pb) {
    const struct sort_item *a = pa, *b = pb;
    if (a->g != b->g) return a->g < b->g ? -1 : 1;
    if (a->step != b->step) return a->step < b->step ? -1 : 1;
    if (a->pos != b->pos) return a->pos < b->pos ? -1 : 1;
    return a->idx < b->idx ? -1 : a->idx > b->idx;
}

static inline int touch(obs_state *s, int32_t g) {
    if (s->g_gen[g] == s->gen) return 0;
    s->g_gen[g] = s->gen;
    s->g_cur[g] = s->g_has[g] ? PREV_CARRIED : PREV_NONE;
    s->touched[s->n_touched++] = g;
    return 1;
}

#define GROUP_NONE (-1) /* a layer beyond n_layer: the row belongs to no group */
#define GROUP_OOM (-2)

/* the (seq_id, layer) group of row i (record r), noted in row_group and touched; GROUP_NONE
   (row_prev cleared too) or GROUP_OOM */
static int32_t assign_group(obs_state *s, const uint8_t *r, int64_t i) {
    uint16_t layer = ld_u16(r + 12);
    if (layer >= s->n_layer) {
        s->row_group[i] = GROUP_NONE;
        s->row_prev[i] = PREV_NONE;
        return GROUP_NONE;
    }
    int32_t g = group_of(s, ld_i32(r + 4), layer);
    if (g < 0) return GROUP_OOM;
    s->row_group[i] = g;
    touch(s, g);
    return g;
}

/* row_group and row_prev of every row; 0 ok, -1 out of memory */
static int link_rows(obs_state *s, const uint8_t *buf, int64_t n) {
    const size_t rs = s->rs;
    s->gen++;
    s->n_touched = 0;
    int64_t i = 0;
    /* in file order while every group's records come in (step, pos) order */
    for (; i < n; i++) {
        const uint8_t *r = buf + (size_t)i * rs;
        int32_t g = assign_group(s, r, i);
        if (g == GROUP_OOM) return -1;
        if (g < 0) continue;
        int32_t cur = s->g_cur[g];
        if (cur != PREV_NONE) {
            uint32_t step = ld_u32(r), cstep;
            int32_t pos = ld_i32(r + 8), cpos;
            if (cur >= 0) {
                const uint8_t *c = buf + (size_t)cur * rs;
                cstep = ld_u32(c);
                cpos = ld_i32(c + 8);
            } else {
                cstep = s->g_step[g];
                cpos = s->g_pos[g];
            }
            if (step < cstep || (step == cstep && pos < cpos)) break; /* out of order: sort */
        }
        s->row_prev[i] = cur;
        s->g_cur[g] = (int32_t)i;
    }
    if (i == n) return 0;

    /* out of order: sort [carried, chunk] by (group, step, pos, row) */
    for (; i < n; i++) {
        if (assign_group(s, buf + (size_t)i * rs, i) == GROUP_OOM) return -1;
    }
    int64_t m = 0;
    for (int64_t t = 0; t < s->n_touched; t++) {
        int32_t g = s->touched[t];
        if (s->g_has[g]) s->items[m++] = (struct sort_item){g, s->g_step[g], s->g_pos[g], -1};
    }
    for (i = 0; i < n; i++) {
        if (s->row_group[i] < 0) continue;
        const uint8_t *r = buf + (size_t)i * rs;
        s->items[m++] = (struct sort_item){s->row_group[i], ld_u32(r), ld_i32(r + 8), (int32_t)i};
    }
    qsort(s->items, (size_t)m, sizeof *s->items, cmp_items);
    for (int64_t j = 0; j < m; j++) {
        const struct sort_item *it = &s->items[j];
        if (it->idx >= 0) {
            int same = j > 0 && s->items[j - 1].g == it->g;
            s->row_prev[it->idx] = !same ? PREV_NONE : s->items[j - 1].idx >= 0 ? s->items[j - 1].idx : PREV_CARRIED;
        }
        if (j + 1 == m || s->items[j + 1].g != it->g) s->g_cur[it->g] = it->idx >= 0 ? it->idx : PREV_CARRIED;
    }
    return 0;
}

/* whether two entries of ids[0..n) are equal (the rows whose ids are not all in the tables) */
static int has_dup_pairwise(const uint8_t *ids, int32_t n) {
    for (int32_t x = 1; x < n; x++) {
        int32_t v = ld_i32(ids + 4 * (size_t)x);
        for (int32_t y = 0; y < x; y++)
            if (ld_i32(ids + 4 * (size_t)y) == v) return 1;
    }
    return 0;
}

/* first index of v in ids[0..n), or n */
static inline int32_t find_linear(const uint8_t *ids, int32_t n, int32_t v) {
    for (int32_t c = 0; c < n; c++)
        if (ld_i32(ids + 4 * (size_t)c) == v) return c;
    return n;
}

/* the margin gate and floor (policy.n_read_rows), in binary32 */
static inline int32_t gate_n_read(const obs_state *s, const uint8_t *logits) {
    int32_t run = s->depth;
    if (!s->margin_inf) {
        float l0 = ld_f32(logits);
        for (int32_t c = 0; c < s->depth; c++) {
            float d = l0 - ld_f32(logits + 4 * (size_t)c);
            if (!(d <= s->margin)) { run = c; break; }
        }
    }
    if (run < s->min_read) run = s->min_read;
    return run < s->depth ? run : s->depth;
}

/* score and check one chunk of n whole records; 0 ok, -1 out of memory, -2 bad size, -3 a version-3
   record's distance out of its bounds (the reader refuses those first: trace.record_distances) */
int obs_chunk(obs_state *s, const uint8_t *buf, int64_t n) {
    if (n < 0 || n > INT32_MAX / 2) return -2;
    if (ensure_rows(s, n) || link_rows(s, buf, n)) return -1;

    const int32_t n_layer = s->n_layer, n_expert = s->n_expert, n_used = s->n_used, depth = s->depth;
    const int32_t k = s->k, tsize = s->tsize;
    const size_t rs = s->rs, off_w = OBS_FIXED + 4 * (size_t)n_used, off_p = OBS_FIXED + 8 * (size_t)n_used,
                 off_l = off_p + 4 * (size_t)depth;
    int64_t *iss = s->issues;
    uint32_t *a_stamp = s->a_stamp, *p_stamp = s->p_stamp, *b_stamp = s->b_stamp;
    int32_t *p_rank = s->p_rank;

    for (int64_t i = 0; i < n; i++) {
        const uint8_t *r = buf + (size_t)i * rs;
        const uint8_t *A = r + OBS_FIXED, *W = r + off_w, *P = r + off_p, *L = r + off_l;
        const uint16_t layer = ld_u16(r + 12), n_read = ld_u16(r + 14), flags = ld_u16(r + 16);
        const int predicted = (flags & OBS_FLAG_PREDICTED) != 0;
        const uint16_t dist = s->legacy ? (uint16_t)predicted : ld_u16(r + 18);
        if (!s->legacy && (predicted ? dist < 1 || dist >= OBS_N_DIST || layer < dist : dist != 0)) return -3;
        const uint32_t st = next_stamp(s);

        /* --- the control, on every record */
        if (layer >= n_layer) iss[OBS_I_LAYER_RANGE]++;
        int a_range = 0, a_dup = 0, a_off = 0; /* a_off: ids without a table entry */
        for (int32_t j = 0; j < n_used; j++) {
            int32_t id = ld_i32(A + 4 * (size_t)j);
            if (id < 0 || id >= n_expert) a_range = 1;
            if (id < 0 || id >= tsize) { a_off++; continue; }
            if (a_stamp[id] == st) a_dup = 1;
            a_stamp[id] = st;
        }
        if (!a_dup && a_off > 1) a_dup = has_dup_pairwise(A, n_used);
        iss[OBS_I_ACTUAL_RANGE] += a_range;
        iss[OBS_I_ACTUAL_DUP] += a_dup;
        for (int32_t j = 0; j < n_used; j++) {
            float w = ld_f32(W + 4 * (size_t)j);
            if (!(w >= 0) || isinf(w)) { iss[OBS_I_ACTUAL_W]++; break; }
        }
        if (n_read > depth) iss[OBS_I_N_READ_DEPTH]++;
        if (!predicted) {
            int odd = n_read != 0;
            for (int32_t c = 0; c < depth && !odd; c++) odd = ld_i32(P + 4 * (size_t)c) != -1;
            iss[OBS_I_UNPREDICTED] += odd;
        } else {
            if (s->mode_off) iss[OBS_I_PRED_MODE_OFF]++;
            if (!s->predictable[layer]) iss[OBS_I_PRED_MASK]++;
            int p_range = 0, p_dup = 0, p_off = 0;
            for (int32_t c = depth - 1; c >= 0; c--) { /* backwards: p_rank keeps the first index */
                int32_t id = ld_i32(P + 4 * (size_t)c);
                if (id < 0 || id >= n_expert) p_range = 1;
                if (id < 0 || id >= tsize) { p_off++; continue; }
                if (p_stamp[id] == st) p_dup = 1;
                p_stamp[id] = st;
                p_rank[id] = c;
            }
            if (!p_dup && p_off > 1) p_dup = has_dup_pairwise(P, depth);
            iss[OBS_I_PRED_RANGE] += p_range;
            iss[OBS_I_PRED_DUP] += p_dup;
            int unranked = isnan(ld_f32(L));
            for (int32_t c = 0; c + 1 < depth && !unranked; c++)
                unranked = !(ld_f32(L + 4 * (size_t)(c + 1)) <= ld_f32(L + 4 * (size_t)c));
            iss[OBS_I_PRED_UNRANKED] += unranked;
            if (n_read != gate_n_read(s, L)) iss[OBS_I_PRED_N_READ]++;
        }

        /* --- the scores, on records of the model's layers */
        if (layer >= n_layer) continue;
        /* the (distance, layer) group's counter c: ints[(c * OBS_N_DIST + dist) * n_layer + layer] */
        const int64_t cell = (int64_t)dist * n_layer + layer, stride = (int64_t)OBS_N_DIST * n_layer;
        s->ints[OBS_C_RECORDS * stride + cell]++;
        const int32_t pv = s->row_prev[i];
        if (pv == PREV_NONE || !(flags & OBS_FLAG_DECODE)) continue;
        int32_t ppos;
        const int32_t *prev_actual_c = NULL; /* the carried record's ids (native) */
        const uint8_t *prev_actual_r = NULL; /* or a chunk row's (trace bytes) */
        if (pv >= 0) {
            const uint8_t *pr = buf + (size_t)pv * rs;
            ppos = ld_i32(pr + 8);
            prev_actual_r = pr + OBS_FIXED;
        } else {
            int32_t g = s->row_group[i];
            ppos = s->g_pos[g];
            prev_actual_c = s->g_actual + (size_t)g * (size_t)n_used;
        }
        if ((int64_t)ppos + 1 != (int64_t)ld_i32(r + 8)) continue; /* a first token */

        /* previous-token baseline: |A ∩ A_prev| */
        int32_t base_hits = 0;
        for (int32_t j = 0; j < n_used; j++) {
            int32_t id = prev_actual_r ? ld_i32(prev_actual_r + 4 * (size_t)j) : prev_actual_c[j];
            if (id >= 0 && id < tsize) b_stamp[id] = st;
        }
        for (int32_t j = 0; j < n_used; j++) {
            int32_t id = ld_i32(A + 4 * (size_t)j);
            if (id >= 0 && id < tsize) {
                base_hits += b_stamp[id] == st;
            } else if (prev_actual_r) {
                base_hits += find_linear(prev_actual_r, n_used, id) < n_used;
            } else {
                for (int32_t c = 0; c < n_used; c++)
                    if (prev_actual_c[c] == id) { base_hits++; break; }
            }
        }
        s->ints[OBS_C_BASE_TOKENS * stride + cell]++;
        s->ints[OBS_C_BASE_ACTUAL * stride + cell] += n_used;
        s->ints[OBS_C_BASE_HITS * stride + cell] += base_hits;
        if (!predicted) continue;

        /* prediction metrics: where each actual id is in P (depth when it is not) */
        const int32_t nr = n_read < depth ? n_read : depth;
        int32_t hits_used = 0, hits_depth = 0, hits_read = 0, all_top = 1;
        double mass_hit = 0.0, mass = 0.0;
        for (int32_t j = 0; j < n_used; j++) {
            int32_t id = ld_i32(A + 4 * (size_t)j), rank;
            if (id >= 0 && id < tsize) rank = p_stamp[id] == st ? p_rank[id] : depth;
            else rank = find_linear(P, depth, id);
            double w = (double)ld_f32(W + 4 * (size_t)j);
            mass += w;
            mass_hit += w * (double)(rank < nr); /* w * 0, not a skip: a NaN weight stays NaN */
            hits_used += rank < k;
            all_top &= rank < k;
            hits_depth += rank < depth;
            hits_read += rank < nr;
        }
        int exact = all_top; /* and every one of P[:k] is in A: set equality */
        for (int32_t c = 0; c < k && exact; c++) {
            int32_t id = ld_i32(P + 4 * (size_t)c);
            exact = (id >= 0 && id < tsize) ? a_stamp[id] == st : find_linear(A, n_used, id) < n_used;
        }
        int64_t *ci = s->ints + cell;
        ci[OBS_C_TOKENS * stride]++;
        ci[OBS_C_ACTUAL * stride] += n_used;
        ci[OBS_C_HITS_USED * stride] += hits_used;
        ci[OBS_C_HITS_DEPTH * stride] += hits_depth;
        ci[OBS_C_HITS_READ * stride] += hits_read;
        ci[OBS_C_READ * stride] += nr;
        ci[OBS_C_GATED * stride] += depth - nr;
        ci[OBS_C_EXACT * stride] += exact;
        s->floats[OBS_F_MASS_HIT * stride + cell] += mass_hit;
        s->floats[OBS_F_MASS * stride + cell] += mass;
    }

    /* carry the latest record of each group seen in this chunk */
    for (int64_t t = 0; t < s->n_touched; t++) {
        int32_t g = s->touched[t], cur = s->g_cur[g];
        if (cur < 0) continue;
        const uint8_t *r = buf + (size_t)cur * rs;
        s->g_step[g] = ld_u32(r);
        s->g_pos[g] = ld_i32(r + 8);
        memcpy(s->g_actual + (size_t)g * (size_t)n_used, r + OBS_FIXED, 4 * (size_t)n_used);
        s->g_has[g] = 1;
    }
    return 0;
}
