/* flashledger's native tile step: one call runs one (query tile, key tile) step of the
 * blocked loop for every head, with the tile's scores kept in a per-thread buffer.
 *
 * Built at run time by flashledger/_native.py (twice: -DFL_DOUBLE=0 for float32 and
 * -DFL_DOUBLE=1 for float64, each with -fopenmp against the OpenMP runtime PyTorch has
 * loaded) and called from the Python loop, which keeps the schedule, the skipping and the
 * ledger. The math is the loop's own (online.step_ and the backward's tile body):
 *
 *   forward:  S = scale · log2(e) · Q_i K_jᵀ   (base-2 units: the factor rides on the matmul)
 *             S[~visible] = -inf               (partial tiles only)
 *             m' = max(m, rowmax S); α = 2^(m - m'); P = 2^(S - m');
 *             ℓ' = α ℓ + Σ P; acc' = α acc + P V_j            (m' = -inf reads as 0)
 *   backward: S = scale · Q_i K_jᵀ, formed as the PyTorch step forms it (masked alike);
 *             P = 2^((S - λ) · log2 e);
 *             dP = dO_i V_jᵀ; dS = P ⊙ (dP - D);
 *             dV_j += Pᵀ dO_i; dK_j += scale · dSᵀ Q_i; dQ_i += scale · dS K_j
 *
 * Every exponent is a difference of two numbers carrying roundings of the same size (the
 * matmul's, and the running max's, itself one of the scores), then at most one product:
 * the error budget of the PyTorch step's exp(S - m'). In the forward, m stays in base-2
 * units during a query tile (the finish converts it); the backward reads λ in natural
 * units, as the forward wrote it, so P does not inherit a rounding of λ·log2 e.
 *
 * The matmuls run on one core each, from inside the OpenMP loop over heads, on
 * cache-resident blocks. Where the compiler targets AVX-512 they run on the step's own
 * register-blocked kernel (own_mm: 4 vectors x 6 columns of C in 24 registers, the last
 * rows 3 x 8, 2 x 12 or 1 x 12; A read in place, B by broadcasts, every entry summed in
 * order by fused multiply-adds); otherwise,
 * or when switched off, on the BLAS gemm PyTorch itself uses (sgemm_/dgemm_). Every
 * operand is laid out so that the kernel needs no packing: A contiguous along m, B read
 * along rows or columns. Layouts (row-major, contiguous), H = B·Hq query heads, head h
 * reading K/V head h / G: q, dO (H, Lq, ·); k (Hk, Lk, d), kt = Kᵀ (Hk, d, Lk), v (Hk, Lk,
 * d_v), and in the backward vt = Vᵀ (Hk, d_v, Lk); acc (H, R, d_v) of one query tile, dQ
 * (H, Lq, d), dK_jᵀ, dV_jᵀ (H, ·, bk); m, ℓ (H, R); λ, D (H, Lq).
 */
#include <math.h>
#include <omp.h>
#include <string.h>

#if FL_DOUBLE
typedef double T;
typedef long long TI;
#define SUF(name) name##_f64
#define GEMM dgemm
#define LOG log
#else
typedef float T;
typedef int TI;
#define SUF(name) name##_f32
#define GEMM sgemm
#define LOG logf
#endif

#if defined(__AVX512F__)
#define VBYTES 64
#elif defined(__AVX__)
#define VBYTES 32
#else
#define VBYTES 16
#endif
#define W ((int)(VBYTES / sizeof(T)))
typedef T VT __attribute__((vector_size(VBYTES)));
typedef TI VI __attribute__((vector_size(VBYTES)));

typedef void (*gemm_fn)(const char *, const char *, const int *, const int *, const int *,
                        const T *, const T *, const int *, const T *, const int *, const T *,
                        T *, const int *);
static gemm_fn GEMM;

void SUF(fl_set_gemm)(void *fn) { GEMM = (gemm_fn)fn; }
int SUF(fl_max_threads)(void) { return omp_get_max_threads(); }
int SUF(fl_vector_bytes)(void) { return VBYTES; }

static const double LOG2E = 1.4426950408889634, LN2 = 0.6931471805599453;

static inline VT splat(T x) {
    VT v;
    for (int i = 0; i < W; ++i) v[i] = x;
    return v;
}
static inline VT vsel(VI m, VT a, VT b) { return (VT)(((VI)a & m) | ((VI)b & ~m)); }
static inline VT vmax(VT a, VT b) { return vsel((VI)(a > b), a, b); }
/* x clamped to [lo, ..] / [.., hi]; NaN passes through */
static inline VT vmax_keep(VT x, VT lo) { return vsel((VI)(lo > x), lo, x); }
static inline VT vmin_keep(VT x, VT hi) { return vsel((VI)(hi < x), hi, x); }
#if defined(__AVX512F__)
#include <immintrin.h>
#if FL_DOUBLE
static inline VT vround(VT x) { return (VT)_mm512_roundscale_pd((__m512d)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline VT vscale(VT p, VT r) { return (VT)_mm512_scalef_pd((__m512d)p, (__m512d)r); }
#else
static inline VT vround(VT x) { return (VT)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline VT vscale(VT p, VT r) { return (VT)_mm512_scalef_ps((__m512)p, (__m512)r); }
#endif
#else
/* round to nearest through the 1.5 · 2^(mantissa bits) trick; 2^r built in the exponent
 * bits, in two normal halves so that r down to the clamp's bound stays exact (then 0) */
#if FL_DOUBLE
#define FL_MAGIC 6755399441055744.0
#define FL_SHIFT 52
#define FL_BIAS 1023
#else
#define FL_MAGIC 12582912.0f
#define FL_SHIFT 23
#define FL_BIAS 127
#endif
static inline VT vround(VT x) { return (x + (T)FL_MAGIC) - (T)FL_MAGIC; }
static inline VT vscale(VT p, VT r) {
    VI n = (VI)(r + (T)FL_MAGIC) - (VI)splat((T)FL_MAGIC); /* r as an integer */
    VI h = n >> 1;                                         /* n = h + (n - h) */
    VT a = (VT)((h + FL_BIAS) << FL_SHIFT), b = (VT)((n - h + FL_BIAS) << FL_SHIFT);
    return p * a * b;
}
#endif
static inline VT loadv(const T *p) { VT v; memcpy(&v, p, sizeof v); return v; }
static inline void storev(T *p, VT v) { memcpy(p, &v, sizeof v); }

/* 2^x, vectorised: x = n + f with n = round(x), |f| <= 1/2; 2^f by a polynomial (float32:
 * degree 6, relative error 2e-9 before rounding; float64: Taylor to degree 13, 4e-18) and
 * 2^n built in the exponent bits. Below the smallest normal (and for -inf) the result is
 * exactly 0; x is clamped above at the largest finite exponent. */
static inline VT vexp2(VT x) {
#if FL_DOUBLE
    const T lo = -1100.0, hi = 1023.0;
    static const T c[] = {1.0, 0.6931471805599453, 0.24022650695910072, 0.05550410866482158,
                          0.009618129107628477, 0.0013333558146428443, 0.0001540353039338161,
                          1.5252733804059841e-05, 1.321548679014431e-06, 1.01780860092397e-07,
                          7.054911620801123e-09, 4.4455382718708116e-10,
                          2.5678435993488206e-11, 1.3691488853904128e-12};
    const int deg = 13;
#else
    const T lo = -160.0f, hi = 127.0f;
    static const T c[] = {1.0f, 0.6931471824645996f, 0.24022646248340607f,
                          0.05550329014658928f, 0.009618519805371761f,
                          0.0013399859890341759f, 0.00015337577497120947f};
    const int deg = 6;
#endif
    /* clamp (a NaN stays NaN: the bound is only taken where the comparison holds) */
#if defined(__AVX512F__)
    (void)hi; /* scalef saturates to inf by itself */
    VT xc = vmax_keep(x, splat(lo));
#else
    VT xc = vmin_keep(vmax_keep(x, splat(lo)), splat(hi));
#endif
    VT r = vround(xc), f = xc - r;
    VT p = splat(c[deg]);
    for (int i = deg - 1; i >= 0; --i) p = p * f + c[i];
    return vscale(p, r); /* p · 2^r, exactly 0 below the smallest subnormal */
}

static inline T exp2s(T x) { return vexp2(splat(x))[0]; }

/* The step's matmuls: C (m x n, column-major, ldc) = alpha · A B + beta · C, beta 0 or 1,
 * A (m x k) column-major (lda), B read as B(kk, j) = b[kk · sbk + j · sbn]. Every call site
 * lays its operands out so that A needs no packing (its m index is contiguous) and B is
 * read by broadcasts. With AVX-512 the step's own register-blocked kernel runs it (one
 * core: the calls are made from inside the OpenMP loops); otherwise, or when switched off
 * (fl_set_own_gemm), the BLAS gemm. */
#if defined(__AVX512F__)
#define FL_OWN 1
#if FL_DOUBLE
typedef __mmask8 MT;
static inline VT loadm(MT k, const T *p) { return (VT)_mm512_maskz_loadu_pd(k, p); }
static inline void storem(T *p, MT k, VT v) { _mm512_mask_storeu_pd(p, k, (__m512d)v); }
#else
typedef __mmask16 MT;
static inline VT loadm(MT k, const T *p) { return (VT)_mm512_maskz_loadu_ps(k, p); }
static inline void storem(T *p, MT k, VT v) { _mm512_mask_storeu_ps(p, k, (__m512)v); }
#endif
/* One block of C: MV vectors of rows (vector r under mask mk[r]: a tail's last vector
 * partly; `full`: no masks) x NB columns in MV·NB registers, each entry summed over kk in
 * order with one fused multiply-add per term; C = alpha · sum (+ C). The unmasked loop is
 * a copy of the masked one on purpose: loading every vector through its mask (all ones
 * for a full block) measured 3x slower (479 -> 163 GFLOP/s float32 on two threads). */
#define FL_MM_BLOCK(MV, NB)                                                                  \
    static void mm_block_##MV##_##NB(int k, T alpha, const T *A, long long lda,              \
                                     const T *B, long long sbk, long long sbn, int accum,    \
                                     T *C, long long ldc, const MT *mk, int full) {          \
        VT acc[NB][MV], zero = {0};                                                          \
        for (int c = 0; c < NB; ++c)                                                         \
            for (int r = 0; r < MV; ++r) acc[c][r] = zero;                                   \
        if (full)                                                                            \
            for (int kk = 0; kk < k; ++kk) {                                                 \
                VT av[MV];                                                                   \
                for (int r = 0; r < MV; ++r) av[r] = loadv(A + kk * lda + r * W);           \
                for (int c = 0; c < NB; ++c) {                                               \
                    VT b = zero + B[kk * sbk + c * sbn];                                     \
                    for (int r = 0; r < MV; ++r) acc[c][r] += av[r] * b;                     \
                }                                                                            \
            }                                                                                \
        else                                                                                 \
            for (int kk = 0; kk < k; ++kk) {                                                 \
                VT av[MV];                                                                   \
                for (int r = 0; r < MV; ++r) av[r] = loadm(mk[r], A + kk * lda + r * W);     \
                for (int c = 0; c < NB; ++c) {                                               \
                    VT b = zero + B[kk * sbk + c * sbn];                                     \
                    for (int r = 0; r < MV; ++r) acc[c][r] += av[r] * b;                     \
                }                                                                            \
            }                                                                                \
        VT al = zero + alpha;                                                                \
        for (int c = 0; c < NB; ++c)                                                         \
            for (int r = 0; r < MV; ++r) {                                                   \
                T *p = C + c * ldc + r * W;                                                  \
                VT x = al * acc[c][r];                                                       \
                storem(p, mk[r], accum ? loadm(mk[r], p) + x : x);                           \
            }                                                                                \
    }
/* the shapes: 4 vectors x 6 columns, and for the last rows of C 3 x 8, 2 x 12, 1 x 12
 * (24 accumulators where the rows allow), each with its narrower column tails */
#define FL_COLS_6(MV) \
    FL_MM_BLOCK(MV, 1) FL_MM_BLOCK(MV, 2) FL_MM_BLOCK(MV, 3) FL_MM_BLOCK(MV, 4) \
    FL_MM_BLOCK(MV, 5) FL_MM_BLOCK(MV, 6)
#define FL_COLS_8(MV) FL_COLS_6(MV) FL_MM_BLOCK(MV, 7) FL_MM_BLOCK(MV, 8)
#define FL_COLS_12(MV) \
    FL_COLS_8(MV) FL_MM_BLOCK(MV, 9) FL_MM_BLOCK(MV, 10) FL_MM_BLOCK(MV, 11) FL_MM_BLOCK(MV, 12)
FL_COLS_6(4)
FL_COLS_8(3)
FL_COLS_12(2)
FL_COLS_12(1)
typedef void (*mm_block_fn)(int, T, const T *, long long, const T *, long long, long long, int,
                            T *, long long, const MT *, int);
#define FL_TABLE_6(MV) 0, mm_block_##MV##_1, mm_block_##MV##_2, mm_block_##MV##_3, \
    mm_block_##MV##_4, mm_block_##MV##_5, mm_block_##MV##_6
#define FL_TABLE_8(MV) FL_TABLE_6(MV), mm_block_##MV##_7, mm_block_##MV##_8
#define FL_TABLE_12(MV) FL_TABLE_8(MV), mm_block_##MV##_9, mm_block_##MV##_10, \
    mm_block_##MV##_11, mm_block_##MV##_12
static const mm_block_fn blocks_1[13] = {FL_TABLE_12(1)}, blocks_2[13] = {FL_TABLE_12(2)},
                         blocks_3[9] = {FL_TABLE_8(3)}, blocks_4[7] = {FL_TABLE_6(4)};
static const mm_block_fn *const mm_blocks[5] = {0, blocks_1, blocks_2, blocks_3, blocks_4};
static const int mm_cols[5] = {0, 12, 12, 8, 6};

static void own_mm(int m, int n, int k, T alpha, const T *A, long long lda, const T *B,
                   long long sbk, long long sbn, int accum, T *C, long long ldc) {
    /* C's rows in blocks of 4 vectors; the last 1-3 vectors (5 as 3 + 2) in a block of
     * their own, with more columns. A block of A's rows stays in L1 over all of n. */
    for (int i0 = 0; i0 < m;) {
        int left = (m - i0 + W - 1) / W, mv = left == 5 ? 3 : left < 4 ? left : 4;
        int rows = m - i0 < mv * W ? m - i0 : mv * W, nr = mm_cols[mv];
        MT mk[4];
        for (int r = 0; r < mv; ++r) {
            int x = rows - r * W;
            mk[r] = x >= W ? (MT)-1 : (MT)((1u << x) - 1);
        }
        for (int j0 = 0; j0 < n; j0 += nr) {
            int nb = n - j0 < nr ? n - j0 : nr;
            mm_blocks[mv][nb](k, alpha, A + i0, lda, B + j0 * sbn, sbk, sbn, accum,
                              C + i0 + j0 * ldc, ldc, mk, rows == mv * W);
        }
        i0 += rows;
    }
}
#else
#define FL_OWN 0
#endif
static int use_own = FL_OWN;
/* 1: the step's own kernel (where built), 0: the BLAS gemm. Returns the setting in force. */
int SUF(fl_set_own_gemm)(int on) { return use_own = FL_OWN && on; }

static void mm(int m, int n, int k, T alpha, const T *A, long long lda, const T *B,
               long long sbk, long long sbn, T beta, T *C, long long ldc) {
#if FL_OWN
    if (use_own) {
        own_mm(m, n, k, alpha, A, lda, B, sbk, sbn, beta != 0, C, ldc);
        return;
    }
#endif
    /* B as BLAS sees it: "N" (column j at b + j·ldb) when it runs along kk, else "T"; a
     * single column runs along kk whatever sbn says */
    int bn = sbk == 1 && (n == 1 || sbn >= k);
    int ia = (int)lda, ic = (int)ldc, ib = (int)(bn ? (n == 1 ? (k > 1 ? k : 1) : sbn) : sbk);
    GEMM("N", bn ? "N" : "T", &m, &n, &k, &alpha, A, &ia, B, &ib, &beta, C, &ic);
}

/* The step's matmul on its own (tests, and the bench's rate): mm on the calling thread. */
void SUF(fl_matmul)(int m, int n, int k, double alpha, const T *A, long long lda, const T *B,
                    long long sbk, long long sbn, double beta, T *C, long long ldc) {
    mm(m, n, k, (T)alpha, A, lda, B, sbk, sbn, (T)beta, C, ldc);
}

/* The step's matmul rate: every thread runs `reps` products C += A B of n x n by n x n on
 * buffers of its own (bufs: threads x 3 x n x n), as the tile steps run theirs. */
void SUF(fl_matmul_rate)(T *bufs, int n, int reps) {
#pragma omp parallel
    {
        T *a = bufs + (long long)omp_get_thread_num() * 3 * n * n, *b = a + (long long)n * n;
        T *c = b + (long long)n * n;
        for (int r = 0; r < reps; ++r) mm(n, n, n, 1, a, n, b, 1, n, 1, c, n);
    }
}

/* dst (n, cols, rows) = src (n, rows, cols) transposed, in 64 x 64 blocks over the
 * threads: the Kᵀ / Vᵀ a pass reads, laid out once. */
void SUF(fl_transpose)(const T *src, T *dst, long long n, long long rows, long long cols) {
    long long rb = (rows + 63) / 64;
#pragma omp parallel for schedule(static)
    for (long long w = 0; w < n * rb; ++w) {
        long long b = w / rb, r0 = (w % rb) * 64, r1 = r0 + 64 < rows ? r0 + 64 : rows;
        const T *sb = src + b * rows * cols;
        T *db = dst + b * rows * cols;
        for (long long c0 = 0; c0 < cols; c0 += 64) {
            long long c1 = c0 + 64 < cols ? c0 + 64 : cols;
            for (long long c = c0; c < c1; ++c)
                for (long long r = r0; r < r1; ++r) db[c * rows + r] = sb[r * cols + c];
        }
    }
}

struct fl_args {
    const T *q, *k, *kt, *v, *vt; /* (H, Lq, d), (Hk, Lk, d), (Hk, d, Lk), (Hk, Lk, d_v), (Hk, d_v, Lk) */
    T *acc, *m, *ell;     /* forward state of one query tile: acc (H, R, d_v), m (base-2
                             units) and ℓ (H, R), R = state_rows */
    const T *dout, *lse, *dd; /* backward: dO (H, Lq, d_v); λ (+inf on empty rows), D (H, Lq) */
    T *dq, *dk_t, *dv_t;  /* backward: dQ (H, Lq, d); dK_jᵀ, dV_jᵀ (H, ·, bk) of the key tile */
    T *work;              /* per thread: 2 · rows · cols + rows */
    const long long *iv_lo, *iv_hi; /* interval masks: row i of batch b sees keys
                                       [iv_lo, iv_hi)[b · iv_bstride + i] (local), or NULL */
    long long heads, group, lq, lk, d, dv, work_stride;
    long long hq, iv_bstride; /* query heads per batch; the intervals' batch stride (0: shared) */
    long long state_rows;     /* R: rows of the forward state (the query tile's, at most) */
    double scale;
    long long scale_exact; /* scale is a power of two: exact as the matmul's alpha */
};

/* S = factor · Q Kᵀ for rows [r0, r0 + nr) of head h and keys [k0, k0 + nc), the factor
 * riding on the matmul, or, with `after`, (Q Kᵀ) · factor as the reference rounds it;
 * masked to -inf where the visibility row says 0. */
static void scores(const struct fl_args *a, long long h, long long r0, int nr, long long k0,
                   int nc, T *s, const unsigned char *vis, long long vis_row, double factor,
                   int after) {
    const T *qh = a->q + (h * a->lq + r0) * a->d;
    const T *kt = a->kt + (h / a->group) * a->d * a->lk + k0;
    /* S (nr x nc, row-major) = Q_i K_jᵀ, formed as Sᵀ = (Kᵀ_j)ᵀ-columns times Q's rows */
    mm(nc, nr, (int)a->d, after ? (T)1 : (T)factor, kt, a->lk, qh, 1, a->d, 0, s, nc);
    if (after) {
        T f = (T)factor;
        for (long long j = 0; j < (long long)nr * nc; ++j) s[j] *= f;
    }
    if (vis)
        for (int r = 0; r < nr; ++r) {
            const unsigned char *vr = vis + r * vis_row;
            T *row = s + (long long)r * nc;
            for (int j = 0; j < nc; ++j)
                if (!vr[j]) row[j] = -INFINITY;
        }
}

static T row_max(const T *row, int nc) {
    VT t0 = splat(-INFINITY), t1 = t0, t2 = t0, t3 = t0; /* four chains hide the latency */
    int j = 0;
    for (; j + 4 * W <= nc; j += 4 * W) {
        t0 = vmax(t0, loadv(row + j));
        t1 = vmax(t1, loadv(row + j + W));
        t2 = vmax(t2, loadv(row + j + 2 * W));
        t3 = vmax(t3, loadv(row + j + 3 * W));
    }
    for (; j + W <= nc; j += W) t0 = vmax(t0, loadv(row + j));
    t0 = vmax(vmax(t0, t1), vmax(t2, t3));
    T t = -INFINITY;
    for (int i = 0; i < W; ++i) t = t0[i] > t ? t0[i] : t;
    for (; j < nc; ++j) t = row[j] > t ? row[j] : t;
    return t;
}

/* row <- 2^(row - shift) in place; returns the row sum. */
static T exp_row(T *row, int nc, T shift) {
    VT sh = splat(shift), s0 = splat(0), s1 = s0;
    int j = 0;
    for (; j + 2 * W <= nc; j += 2 * W) {
        VT p0 = vexp2(loadv(row + j) - sh), p1 = vexp2(loadv(row + j + W) - sh);
        storev(row + j, p0);
        storev(row + j + W, p1);
        s0 += p0;
        s1 += p1;
    }
    for (; j + W <= nc; j += W) {
        VT p = vexp2(loadv(row + j) - sh);
        storev(row + j, p);
        s0 += p;
    }
    s0 += s1;
    T s = 0;
    for (int i = 0; i < W; ++i) s += s0[i];
    for (; j < nc; ++j) {
        row[j] = exp2s(row[j] - shift);
        s += row[j];
    }
    return s;
}

/* The columns [lo, hi) of an nr x nc visibility block that hold every visible entry
 * (lo = hi when none is visible). Columns outside add exact zeros to every sum, so a step
 * may leave them out of its matmuls. */
static void visible_span(const unsigned char *vis, int nr, int nc, long long row_stride,
                         int *lo, int *hi) {
    int a = nc, b = 0;
    for (int r = 0; r < nr; ++r) {
        const unsigned char *vr = vis + r * row_stride;
        int j = 0;
        while (j < a && !vr[j]) ++j;
        if (j < a) a = j;
        int e = nc;
        while (e > b && !vr[e - 1]) --e;
        if (e > b) b = e;
    }
    *lo = a < b ? a : 0;
    *hi = a < b ? b : 0;
}

/* Rows per work item inside a partial tile: small, so that each item's visible span (a
 * causal or banded diagonal) is narrow. */
#define FL_PARTIAL_ROWS 64

/* Which columns of a row block [r0, r0 + nr) of head h, in the tile of keys [k0, k0 + nc),
 * a step computes: the span [*lo, *hi) of the tile (lo = hi: nothing visible) and, for an
 * interval mask (nr <= FL_PARTIAL_ROWS), each row's visible columns [ca[r], cb[r]) relative
 * to lo; otherwise (a full tile, or a byte mask `vis` whose zeros the scores turn into
 * -inf) every row runs over the whole span and ca, cb are left alone. Returns the visible
 * dots of an interval block (0 otherwise). */
static long long row_ranges(const struct fl_args *a, long long h, long long r0, int nr,
                            long long k0, int nc, const unsigned char *vis, int intervals,
                            int *ca, int *cb, int *lo, int *hi) {
    *lo = 0;
    *hi = nc;
    if (vis) visible_span(vis, nr, nc, nc, lo, hi);
    if (!intervals) return 0;
    long long off = (h / a->hq) * a->iv_bstride + r0, seen = 0;
    const long long *il = a->iv_lo + off, *ih = a->iv_hi + off;
    int mn = nc, mx = 0;
    for (int r = 0; r < nr; ++r) {
        long long x = il[r] - k0, y = ih[r] - k0;
        x = x < 0 ? 0 : x > nc ? nc : x;
        y = y < x ? x : y > nc ? nc : y;
        ca[r] = (int)x;
        cb[r] = (int)y;
        if (x < y) {
            seen += y - x;
            mn = (int)x < mn ? (int)x : mn;
            mx = (int)y > mx ? (int)y : mx;
        }
    }
    *lo = mn < mx ? mn : 0;
    *hi = mn < mx ? mx : 0;
    for (int r = 0; r < nr; ++r) { /* relative to lo; an empty row runs over nothing */
        int e = ca[r] >= cb[r];
        ca[r] = e ? 0 : ca[r] - *lo;
        cb[r] = e ? 0 : cb[r] - *lo;
    }
    return seen;
}

/* Zero a row's columns outside [c0, c1) of [0, w). */
static inline void zero_outside(T *row, int c0, int c1, int w) {
    if (c0 > 0) memset(row, 0, (size_t)c0 * sizeof(T));
    if (c1 < w) memset(row + c1, 0, (size_t)(w - c1) * sizeof(T));
}

/* Forward for rows [r0, r0 + nr) of head h against keys [k0, k0 + nc), the rows' state at
 * state row sr0; `vis` (row stride nc) or NULL, `intervals` (see row_ranges). s: nr · nc +
 * nr scratch. Returns the visible dots of an interval block. */
static long long forward_rows(const struct fl_args *a, long long h, long long r0,
                              long long sr0, int nr, long long k0, int nc,
                              const unsigned char *vis, int intervals, T *s) {
    int lo, hi, ca[FL_PARTIAL_ROWS], cb[FL_PARTIAL_ROWS];
    long long seen = row_ranges(a, h, r0, nr, k0, nc, vis, intervals, ca, cb, &lo, &hi);
    if (lo == hi) return 0; /* nothing visible: m, ℓ and acc stay as they are */
    int w = hi - lo, idv = (int)a->dv;
    scores(a, h, r0, nr, k0 + lo, w, s, vis ? vis + lo : NULL, nc, a->scale * LOG2E, 0);
    long long sr = a->state_rows;
    T *mh = a->m + h * sr + sr0, *lh = a->ell + h * sr + sr0;
    T *alpha = s + (long long)nr * w; /* α per row */
    int moved = 0;                     /* did any row's max move? */
    for (int r = 0; r < nr; ++r) {
        T *row = s + (long long)r * w;
        int c0 = intervals ? ca[r] : 0, c1 = intervals ? cb[r] : w; /* the row's columns */
        T m_old = mh[r], top = row_max(row + c0, c1 - c0);
        T m_new = m_old > top ? m_old : top, m_sub = m_new == -INFINITY ? 0 : m_new;
        alpha[r] = exp2s(m_old - m_sub); /* exactly 1 when the max did not move */
        moved |= alpha[r] != (T)1;
        T sum = exp_row(row + c0, c1 - c0, m_sub);
        zero_outside(row, c0, c1, w); /* P = 0 where the row cannot see */
        mh[r] = m_new;
        lh[r] = sum + alpha[r] * lh[r];
    }
    T *acc = a->acc + (h * sr + sr0) * a->dv; /* the rows' acc */
    if (moved)
        for (int r = 0; r < nr; ++r) {
            T *ar = acc + r * a->dv;
            for (long long c = 0; c < a->dv; ++c) ar[c] *= alpha[r];
        }
    const T *vh = a->v + ((h / a->group) * a->lk + k0 + lo) * a->dv;
    /* acc (nr x d_v) += P (nr x w) V_j (w x d_v), formed as accᵀ += V_jᵀ Pᵀ */
    mm(idv, nr, w, 1, vh, idv, s, 1, w, 1, acc, idv);
    return seen;
}

/* Work item w of a forward tile step: head w / chunks, its row block w % chunks. */
static long long forward_item(const struct fl_args *a, long long w, long long chunks,
                              long long chunk, long long q0, long long q1, long long k0,
                              int nc, int intervals, const unsigned char *vis,
                              long long vis_sn, long long vis_sg) {
    long long h = w / chunks, c0 = (w % chunks) * chunk, r0 = q0 + c0;
    int nr = (int)((r0 + chunk < q1 ? r0 + chunk : q1) - r0);
    T *s = a->work + omp_get_thread_num() * a->work_stride;
    const unsigned char *vh =
        vis ? vis + (h / a->group) * vis_sn + (h % a->group) * vis_sg + c0 * nc : NULL;
    return forward_rows(a, h, r0, c0, nr, k0, nc, vh, intervals, s);
}

/* A run of full forward tile steps: queries [q0, q1) against the key tiles [k0, k0 + bk),
 * [k0 + bk, k0 + 2 bk), ... up to k1 (the last may be shorter), every head, in that order.
 * Each tile's full step in turn, in one parallel region:
 * a work item owns its rows' state, so it runs through all the tiles with no barrier
 * between them and keeps its acc in its core's cache (static: a fixed item -> thread map). */
void SUF(fl_forward_full_tiles)(const struct fl_args *a, long long q0, long long q1,
                                long long k0, long long k1, long long bk, long long chunk) {
    long long rows = q1 - q0, chunks = (rows + chunk - 1) / chunk;
    long long items = a->heads * chunks;
#pragma omp parallel for schedule(static)
    for (long long w = 0; w < items; ++w)
        for (long long kk = k0; kk < k1; kk += bk) {
            int nc = (int)(kk + bk < k1 ? bk : k1 - kk);
            forward_item(a, w, chunks, chunk, q0, q1, kk, nc, 0, NULL, 0, 0);
        }
}

/* One forward tile step, queries [q0, q1) x keys [k0, k1), every head, the state of row
 * q0 + r at state row r (the Python loop finalises and resets it per query tile, as the
 * PyTorch step's loop does); rows are split in chunks of `chunk` (of FL_PARTIAL_ROWS in
 * a partial tile) so that small head counts still fill the threads. A full tile is a run
 * of one (fl_forward_full_tiles). A partial tile's visibility is `vis`, its bytes (rows x
 * cols, uint8) for head h at vis + (h / group) * vis_sn + (h % group) * vis_sg (strides 0
 * where the mask broadcasts), or, with vis NULL, the pass's intervals (a->iv_lo,
 * a->iv_hi); its uneven spans are handed out as threads free up. Returns the visible dots
 * of an interval tile (0 otherwise), summed over heads. */
long long SUF(fl_forward_tile)(const struct fl_args *a, long long q0, long long q1,
                               long long k0, long long k1, long long chunk, int partial,
                               const unsigned char *vis, long long vis_sn, long long vis_sg) {
    if (!partial) {
        SUF(fl_forward_full_tiles)(a, q0, q1, k0, k1, k1 - k0, chunk);
        return 0;
    }
    int intervals = !vis;
    if (chunk > FL_PARTIAL_ROWS) chunk = FL_PARTIAL_ROWS;
    long long rows = q1 - q0, chunks = (rows + chunk - 1) / chunk, seen = 0;
    int nc = (int)(k1 - k0);
    long long items = a->heads * chunks;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : seen)
    for (long long w = 0; w < items; ++w)
        seen += forward_item(a, w, chunks, chunk, q0, q1, k0, nc, intervals, vis, vis_sn, vis_sg);
    return seen;
}

/* The end of query tile [q0, q1): o = acc / ℓ and lse = m · ln 2 + log ℓ (natural units)
 * into o (H, Lq, d_v) and lse (H, Lq), an empty row (ℓ = 0) giving o = 0 and lse = -inf,
 * as online.finalize does; then the state is reset (m = -inf, ℓ = 0, acc = 0) for the
 * next query tile. Runs while the tile's acc is still in the cores' caches. */
void SUF(fl_forward_finish)(const struct fl_args *a, long long q0, long long q1, T *o,
                            T *lse) {
    long long sr = a->state_rows, n = q1 - q0, dv = a->dv;
#pragma omp parallel for schedule(static)
    for (long long h = 0; h < a->heads; ++h) {
        T *mh = a->m + h * sr, *lh = a->ell + h * sr, *ah = a->acc + h * sr * dv;
        T *oh = o + (h * a->lq + q0) * dv, *lseh = lse + h * a->lq + q0;
        for (long long r = 0; r < n; ++r) {
            T l = lh[r], m_nat = mh[r] * (T)LN2, *orow = oh + r * dv;
            int empty = l == 0;
            lseh[r] = empty ? -INFINITY : m_nat + LOG(l);
            for (long long c = 0; c < dv; ++c) orow[c] = empty ? 0 : ah[r * dv + c] / l;
        }
        for (long long r = 0; r < sr; ++r) {
            mh[r] = -INFINITY;
            lh[r] = 0;
        }
        memset(ah, 0, (size_t)(dv * sr) * sizeof(T));
    }
}

/* Backward for rows [r0, r0 + nr) of head h against keys [k0, k0 + nc); `vis` (row stride
 * nc) or NULL, `intervals` (see row_ranges); s: 2 · nr · nc scratch. Returns the visible
 * dots of an interval block. */
static long long backward_rows(const struct fl_args *a, long long h, long long r0, int nr,
                               long long k0, int nc, const unsigned char *vis, int intervals,
                               T *s) {
    int lo, hi, ca[FL_PARTIAL_ROWS], cb[FL_PARTIAL_ROWS];
    long long seen = row_ranges(a, h, r0, nr, k0, nc, vis, intervals, ca, cb, &lo, &hi);
    if (lo == hi) return 0; /* every P is 0: no contribution */
    int w = hi - lo, id = (int)a->d, idv = (int)a->dv;
    T *dp = s + (long long)nr * w;
    /* the scores the PyTorch step (and the reference) form: the scale on the matmul only
     * when it is a power of two, so that a forward run with that step is matched exactly */
    scores(a, h, r0, nr, k0 + lo, w, s, vis ? vis + lo : NULL, nc, a->scale, !a->scale_exact);
    const T *doh = a->dout + (h * a->lq + r0) * a->dv;
    const T *vt = a->vt + (h / a->group) * a->dv * a->lk + k0 + lo;
    const T *qh = a->q + (h * a->lq + r0) * a->d;
    T sc = (T)a->scale;
    /* dP (nr x w) = dO V_jᵀ */
    mm(w, nr, idv, 1, vt, a->lk, doh, 1, idv, 0, dp, w);
    const T *lam = a->lse + h * a->lq + r0, *dd = a->dd + h * a->lq + r0;
    for (int r = 0; r < nr; ++r) {
        T *pr = s + (long long)r * w, *dr = dp + (long long)r * w;
        VT sh = splat(lam[r]), dv_ = splat(dd[r]), l2e = splat((T)LOG2E);
        int c0 = intervals ? ca[r] : 0, c1 = intervals ? cb[r] : w, j = c0;
        zero_outside(pr, c0, c1, w); /* P = dS = 0 where the row cannot see */
        zero_outside(dr, c0, c1, w);
        for (; j + W <= c1; j += W) {
            VT p = vexp2((loadv(pr + j) - sh) * l2e);
            storev(pr + j, p);
            storev(dr + j, p * (loadv(dr + j) - dv_));
        }
        for (; j < c1; ++j) {
            T p = exp2s((pr[j] - lam[r]) * (T)LOG2E);
            pr[j] = p;
            dr[j] = p * (dr[j] - dd[r]);
        }
    }
    T *dvt = a->dv_t + h * a->dv * nc + lo, *dkt = a->dk_t + h * a->d * nc + lo;
    T *dqh = a->dq + (h * a->lq + r0) * a->d;
    const T *kh = a->k + ((h / a->group) * a->lk + k0 + lo) * a->d;
    /* dV_jᵀ (d_v x w) += dOᵀ P;  dK_jᵀ (d x w) += scale Qᵀ dS;  dQ (nr x d) += scale dS K_j */
    mm(w, idv, nr, 1, s, w, doh, idv, 1, 1, dvt, nc);
    mm(w, id, nr, sc, dp, w, qh, id, 1, 1, dkt, nc);
    mm(id, nr, w, sc, kh, id, dp, 1, w, 1, dqh, id);
    return seen;
}

/* One backward tile step (queries [q0, q1) x keys [k0, k1)), every head. dK_j and dV_j
 * accumulate (transposed) per query head in a->dk_t, a->dv_t ((H, ·, k1 - k0)); dQ_i in
 * a->dq. A partial tile (visibility as in fl_forward_tile) runs in blocks of
 * FL_PARTIAL_ROWS rows. Returns the visible dots of an interval tile (0 otherwise). */
long long SUF(fl_backward_tile)(const struct fl_args *a, long long q0, long long q1,
                                long long k0, long long k1, int partial,
                                const unsigned char *vis, long long vis_sn,
                                long long vis_sg) {
    int nc = (int)(k1 - k0), intervals = partial && !vis;
    long long rows = q1 - q0, step = partial ? FL_PARTIAL_ROWS : rows, seen = 0;
#pragma omp parallel for schedule(static) reduction(+ : seen)
    for (long long h = 0; h < a->heads; ++h) {
        T *s = a->work + omp_get_thread_num() * a->work_stride;
        const unsigned char *vh =
            vis ? vis + (h / a->group) * vis_sn + (h % a->group) * vis_sg : NULL;
        for (long long c0 = 0; c0 < rows; c0 += step) {
            int nr = (int)(c0 + step < rows ? step : rows - c0);
            seen += backward_rows(a, h, q0 + c0, nr, k0, nc, vh ? vh + c0 * nc : NULL,
                                  intervals, s);
        }
    }
    return seen;
}

/* The end of key tile [k0, k1) in the backward: dK_j, dV_j of each K/V head, the sums of
 * its group's per-query-head dK_jᵀ, dV_jᵀ (in group order), into rows [k0, k1) of dk
 * (Hk, Lk, d) and dv (Hk, Lk, d_v); then dK_jᵀ, dV_jᵀ are zeroed for the next key tile. */
void SUF(fl_backward_finish)(const struct fl_args *a, long long k0, long long k1, T *dk,
                             T *dv) {
    long long nc = k1 - k0, hk = a->heads / a->group;
#pragma omp parallel for schedule(static)
    for (long long kh = 0; kh < 2 * hk; ++kh) { /* dK of K/V head kh, then dV of kh - hk */
        int is_v = kh >= hk;
        long long hh = is_v ? kh - hk : kh, x = is_v ? a->dv : a->d;
        T *src = (is_v ? a->dv_t : a->dk_t) + hh * a->group * x * nc; /* (G, x, nc) */
        T *dst = (is_v ? dv : dk) + (hh * a->lk + k0) * x;             /* (nc, x) */
        for (long long c = 0; c < nc; ++c)
            for (long long e = 0; e < x; ++e) {
                T sum = src[e * nc + c];
                for (long long g = 1; g < a->group; ++g) sum += src[(g * x + e) * nc + c];
                dst[c * x + e] = sum;
            }
        memset(src, 0, (size_t)(a->group * x * nc) * sizeof(T));
    }
}
