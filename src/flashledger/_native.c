/* flashledger's native step: one call runs one whole pass of the blocked loop (the
 * forward, or the backward) over the schedule the Python loop built, for every head, in
 * one OpenMP parallel region.
 *
 * Built at run time by flashledger/_native.py (twice: -DFL_DOUBLE=0 for float32 and
 * -DFL_DOUBLE=1 for float64, each with -fopenmp against the OpenMP runtime PyTorch has
 * loaded) and called from the Python loop, which keeps the schedule (which tiles run, in
 * which order, which are partial), the skipping and the ledger. The math is the loop's
 * own (online.step_ and the backward's tile body):
 *
 *   forward:  S = scale · log2(e) · Q_i K_jᵀ   (base-2 units: the factor rides on the matmul)
 *             S[~visible] = -inf               (partial tiles only)
 *             m' = max(m, rowmax S); α = 2^(m - m'); P = 2^(S - m');
 *             ℓ' = α ℓ + Σ P; acc' = α acc + P V_j            (m' = -inf reads as 0)
 *   backward: S = scale · log2(e) · Q_i K_jᵀ, formed as the forward formed it (the same
 *             calls, factors and terms; masked alike);
 *             P = 2^(S - λ · log2 e);
 *             dP = dO_i V_jᵀ; dS = P ⊙ (dP - D);
 *             dV_j += Pᵀ dO_i; dK_j += scale · dSᵀ Q_i; dQ_i += scale · dS K_j
 *
 * Every exponent is a difference of two numbers carrying roundings of the same size (the
 * matmul's, and the running max's, itself one of the scores): the error budget of the
 * PyTorch step's exp(S - m'). In the forward, m stays in base-2 units during a query tile
 * (the finish converts it: λ is written in natural units). The backward forms each score
 * bit for bit as the forward did, in its units, and converts λ once per row: over a row,
 * the rebuilt P is then the forward's times one constant (λ·log2 e's rounding, a few
 * units in the last place of |λ|), which dS = P ⊙ (dP - D) cancels, D being the row's
 * Σ P dP. A rounding that differs from key to key does not cancel: scores formed in
 * natural units (as the PyTorch step forms them) round each key apart from the forward's
 * by a unit in the last place of |S|, the rows of dS no longer sum to ~0, and dQ = scale
 * · dS K picks up the keys' common direction times that sum: with |S| ~ 1e3 in float32
 * and keys sharing a direction, 20-40 x the PyTorch step's error. The same holds of every
 * step between: the matmul (a BLAS gets a factor that is not a power of two after the
 * product, see scores; a forward that read K in place has its dot products summed in
 * its order again, fl_args.dot_scores) and the merge of a forward's key splits (from
 * the parts' m and ℓ, merge_states, not from their rounded λ). Both passes run on one
 * step or the other (blocked.py's _native_step: the FA1 order and an observed pass run
 * the PyTorch step), never one of each on the library's own paths.
 *
 * Work items. The forward's item is (query tile, head, chunk of its rows): it runs its
 * rows through the tile's key tiles in order, the state (m, ℓ, acc) in its thread's
 * scratch, and writes O and λ. The backward's item is (K/V head, part of the key tiles):
 * per key tile, dK_j and dV_j accumulate over the query tiles and the group's query heads
 * in scratch; dQ accumulates in the part's own dQ. No two items write the same rows, so
 * items run with no barrier between tiles and are handed out as threads free up: one
 * barrier per pass, where a tile per call paid one per tile step (and, with threads that
 * spin while they wait, lost a scheduler time slice to each when another process shares
 * the cores). Decode (a few query rows, many keys): a group's query heads run as one
 * block of rows and each row's key tiles are split into parts (flash-decoding), merged
 * afterwards in Python with the one merge.
 *
 * The matmuls run on one core each, from inside the items, on cache-resident blocks.
 * Where the compiler targets AVX-512, or AVX2 with FMA, they can run on the step's own
 * register-blocked kernel (own_mm; AVX-512: 4 vectors x 6 columns of C in 24 registers,
 * the last rows 3 x 8, 2 x 12 or 1 x 12; AVX2: 2 x 6 in 12 of its 16, the last rows 1 x
 * 12; A read in place, B by broadcasts, every entry summed in order by fused
 * multiply-adds); otherwise, or when switched off, on the BLAS gemm PyTorch itself uses
 * (sgemm_/dgemm_), or OpenBLAS's. Every operand is laid out so that the kernel needs no
 * packing: A contiguous along m, B read along rows or columns. Layouts (row-major, contiguous),
 * H = B·Hq query heads, head h reading K/V head h / G: q, dO, O (H, Lq, ·); k (Hk, Lk, d),
 * the forward's kt = Kᵀ (Hk, d, Lk), v (Hk, Lk, d_v); dQ (H, Lq, d); λ, D (H, Lq); an
 * item's acc (rows, d_v), and in the backward its key tile's Kᵀ_j, Vᵀ_j, dK_jᵀ, dV_jᵀ (·, bk).
 *
 * Half inputs. Built twice more, -DFL_HALF=1 (bfloat16) and -DFL_HALF=2 (float16), the
 * same loops keep Q, K (Kᵀ), V (Vᵀ) and dO in the input dtype (TIN; T = float for all
 * the rest) and run every product on the BLAS's mixed gemm (MKL's gemm_bf16bf16f32_ /
 * gemm_f16f16f32_: half operands, float32 sums and results); P (and in the backward dS)
 * is rounded to the input dtype right before the products that read it, as flash-attn
 * does, from the float32 value the row sums (ℓ) and dS were formed from. The running
 * state, the accumulators (acc, dK_jᵀ, dV_jᵀ, dQ), λ and D stay float32. The rounding is
 * to nearest, ties to even, subnormals kept (store_in: AVX512-BF16 / AVX-512 F16C where
 * built for them, the same rule in integers or _Float16 elsewhere). In the float builds
 * TIN = T and the rounded copies are the float buffers themselves.
 *
 * Half inputs on the float32 build (the path the calibration may choose instead, e.g.
 * float16 where MKL's float16 gemm is the slower): the pass reads Q, K, V and dO in their
 * dtype (q16, k16, v16, dout16) and widens each row as it needs it, exactly: the forward a
 * work item's Q rows and each tile's V rows, Kᵀ laid out widened (fl_transpose_wide); the
 * backward each key tile's K_j, Kᵀ_j and Vᵀ_j once per item and a block's Q and dO rows
 * per block. The float32 step's arithmetic on the same float32 values, so the results are
 * those of the inputs converted up front, bit for bit, without the float32 copies.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#ifndef FL_HALF
#define FL_HALF 0 /* 1: bfloat16 inputs, 2: float16 inputs (T = float) */
#endif
#if FL_DOUBLE
typedef double T;
typedef long long TI;
#define SUF(name) name##_f64
#define GEMM dgemm
#define LOG log
#else
typedef float T;
typedef int TI;
#if FL_HALF == 1
#define SUF(name) name##_bf16
#elif FL_HALF == 2
#define SUF(name) name##_f16
#else
#define SUF(name) name##_f32
#endif
#define GEMM sgemm
#define LOG logf
#endif
/* the inputs' storage (Q, K, Kᵀ, V, Vᵀ, dO) and the matmuls' operands: the half dtype's
 * bits, or T itself */
#if FL_HALF
typedef unsigned short TIN;
#else
typedef T TIN;
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
                        const T *, const TIN *, const int *, const TIN *, const int *,
                        const T *, T *, const int *);
static gemm_fn GEMM;
/* the forward pass's BLAS gemm, where it runs on another back end than the rest (NULL: GEMM) */
static gemm_fn gemm_fwd;

void SUF(fl_set_gemm)(void *fn) { GEMM = (gemm_fn)fn; }
void SUF(fl_set_forward_gemm)(void *fn) { gemm_fwd = (gemm_fn)fn; }
int SUF(fl_max_threads)(void) { return omp_get_max_threads(); }
/* the calling thread's team size (OpenMP keeps one per thread: a thread Python starts
 * does not see torch.set_num_threads from the main thread) */
void SUF(fl_set_threads)(int n) { omp_set_num_threads(n > 0 ? n : 1); }
int SUF(fl_vector_bytes)(void) { return VBYTES; }
/* 1 where the step's vector arithmetic fuses multiply-adds (FMA: every build but the SSE
 * and AVX-only ones, whose Horner steps round the product and the sum apart) */
int SUF(fl_fused)(void) {
#if defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

static const double LOG2E = 1.4426950408889634, LN2 = 0.6931471805599453;

static inline VT splat(T x) { /* one broadcast (a loop over the lanes can compile to W) */
    VT v = {x};
    return __builtin_shuffle(v, (VI){0});
}
static inline VT vsel(VI m, VT a, VT b) { return (VT)(((VI)a & m) | ((VI)b & ~m)); }
/* (a > b ? a : b) and (a < b ? a : b): x86's max and min, one instruction each (written as
 * a select, they compile to a compare and two logic operations); a NaN in b is kept */
#define FL_MAXMIN(MAX, MIN, V)                                                               \
    static inline VT vgt(VT a, VT b) { return (VT)MAX((V)a, (V)b); }                          \
    static inline VT vlt(VT a, VT b) { return (VT)MIN((V)a, (V)b); }
#if defined(__AVX512F__) && VBYTES == 64 && FL_DOUBLE
FL_MAXMIN(_mm512_max_pd, _mm512_min_pd, __m512d)
#elif defined(__AVX512F__) && VBYTES == 64
FL_MAXMIN(_mm512_max_ps, _mm512_min_ps, __m512)
#elif defined(__AVX__) && VBYTES == 32 && FL_DOUBLE
FL_MAXMIN(_mm256_max_pd, _mm256_min_pd, __m256d)
#elif defined(__AVX__) && VBYTES == 32
FL_MAXMIN(_mm256_max_ps, _mm256_min_ps, __m256)
#else
static inline VT vgt(VT a, VT b) { return vsel((VI)(a > b), a, b); }
static inline VT vlt(VT a, VT b) { return vsel((VI)(a < b), a, b); }
#endif
static inline VT vmax(VT a, VT b) { return vgt(a, b); }
/* x clamped to [lo, ..] / [.., hi]; NaN passes through */
static inline VT vmax_keep(VT x, VT lo) { return vgt(lo, x); }
static inline VT vmin_keep(VT x, VT hi) { return vlt(hi, x); }
#if defined(__AVX512F__)
#if FL_DOUBLE
static inline VT vround(VT x) { return (VT)_mm512_roundscale_pd((__m512d)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline VT vscale(VT p, VT r) { return (VT)_mm512_scalef_pd((__m512d)p, (__m512d)r); }
/* p · 2^r in the lanes where x is not below lo (NaN included), 0 in the others */
static inline VT vscale_from(VT p, VT r, VT x, T lo) {
    __mmask8 keep = _mm512_cmp_pd_mask((__m512d)x, _mm512_set1_pd(lo), _CMP_NLT_UQ);
    return (VT)_mm512_maskz_scalef_pd(keep, (__m512d)p, (__m512d)r);
}
#else
static inline VT vround(VT x) { return (VT)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline VT vscale(VT p, VT r) { return (VT)_mm512_scalef_ps((__m512)p, (__m512)r); }
static inline VT vscale_from(VT p, VT r, VT x, T lo) {
    __mmask16 keep = _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(lo), _CMP_NLT_UQ);
    return (VT)_mm512_maskz_scalef_ps(keep, (__m512)p, (__m512)r);
}
#endif
#else
/* round to nearest through the 1.5 · 2^(mantissa bits) trick: t = x + magic holds round(x)
 * in its low mantissa bits, so 2^round(x) is t's bits, rebased, shifted into the exponent
 * (every r vexp2 forms, clamped to [FL_EXP2_MIN, hi], has a normal 2^r) */
#if FL_DOUBLE
#define FL_MAGIC 6755399441055744.0
#define FL_SHIFT 52
#define FL_BIAS 1023
#else
#define FL_MAGIC 12582912.0f
#define FL_SHIFT 23
#define FL_BIAS 127
#endif
static inline VT vmagic(VT x) { return x + (T)FL_MAGIC; }
static inline VT vround_of(VT t) { return t - (T)FL_MAGIC; }
static inline VT vpow2_of(VT t) {
    return (VT)(((VI)t - (VI)splat((T)FL_MAGIC) + FL_BIAS) << FL_SHIFT);
}
#endif
static inline VT loadv(const T *p) { VT v; memcpy(&v, p, sizeof v); return v; }
static inline void storev(T *p, VT v) { memcpy(p, &v, sizeof v); }

/* A float's bits rounded to bfloat16 or float16: to nearest, ties to even; subnormals
 * kept, overflow to ±inf, NaN stays NaN (quiet), as PyTorch's conversion does. The half
 * builds round P and dS with them (to_in), the float32 build a decode call's O. */
#if !FL_DOUBLE
static inline unsigned short bf16_bits(float x) {
    unsigned int u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40); /* NaN */
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1)) >> 16); /* the carry rounds up */
}
static inline unsigned short f16_bits(float x) {
    _Float16 h = (_Float16)x;
    unsigned short r;
    memcpy(&r, &h, sizeof r);
    return r;
}
#endif

/* T values rounded to the input dtype: to_in one, store_in a vector (W of them), by the
 * rule above. In the float builds a plain store. */
#if FL_HALF == 1
typedef unsigned int VU __attribute__((vector_size(VBYTES)));
typedef unsigned short VH __attribute__((vector_size(VBYTES / 2)));
static inline TIN to_in(T x) { return bf16_bits(x); }
/* the same rule, lane by lane in integers */
static inline VH bf16_of(VT v) {
    VU u = (VU)v;
    VU r = (u + 0x7fffu + ((u >> 16) & 1)) >> 16;
    VU nan = (VU)((u & 0x7fffffffu) > 0x7f800000u);
    r = (r & ~nan) | (((u >> 16) | 0x40) & nan);
    return __builtin_convertvector(r, VH);
}
static inline void store_in(TIN *p, VT v) {
#if defined(__AVX512BF16__) && VBYTES == 64
    /* vcvtneps2bf16 rounds to nearest even but reads subnormal inputs as zero: a vector
     * holding one (|x| < 2^-126, x != 0: rare, P or dS far below its row's scale) takes
     * the integer rule */
    __m512i a = _mm512_and_si512((__m512i)v, _mm512_set1_epi32(0x7fffffff));
    __mmask16 sub = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(a, _mm512_set1_epi32(1)),
                                            _mm512_set1_epi32(0x7fffff));
    if (!sub) {
        __m256bh h = _mm512_cvtneps_pbh((__m512)v);
        memcpy(p, &h, sizeof h);
        return;
    }
#endif
    VH h = bf16_of(v);
    memcpy(p, &h, sizeof h);
}
#elif FL_HALF == 2
static inline TIN to_in(T x) { return f16_bits(x); }
static inline void store_in(TIN *p, VT v) {
#if defined(__AVX512F__)
    __m256i h = _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    memcpy(p, &h, sizeof h);
#elif defined(__F16C__) && VBYTES == 32
    __m128i h = _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    memcpy(p, &h, sizeof h);
#else
    for (int i = 0; i < W; ++i) p[i] = to_in(v[i]);
#endif
}
#else
static inline TIN to_in(T x) { return x; }
static inline void store_in(TIN *p, VT v) { storev(p, v); }
#endif

/* 2^x, vectorised: x = n + f with n = round(x), |f| <= 1/2; 2^f by a polynomial (float32:
 * degree 6, relative error 2e-9 before rounding, degree 4 and 3.1e-6 in the half builds;
 * float64: 1 + f q(f), q of degree 10 near-minimax (Chebyshev) on [-1/2, 1/2], 2e-17, two
 * operations fewer than Taylor to degree 13 for the same error; each exactly 1 at f = 0)
 * and 2^n built in the exponent bits. float64 on AVX-512 splits finer: x = n + j/16 + f,
 * |f| <= 1/32, 2^(j/16) from a table of 16 (one two-register permute) and 2^f - 1 = f q(f),
 * q of degree 5 (1.5e-17 absolute): 13 operations a vector instead of 17, within one unit
 * in the last place as before (a quarter of the results one unit off, the table's rounding,
 * where Taylor's form had one in twenty). The softmax's loop held 13 % of a float64
 * forward's samples; the forward ran in 0.95-0.96 x the time (Intel Xeon model 207,
 * L = 4096). x is clamped above at the largest finite exponent
 * (vexp2_nonpos, for exponents that are never positive, leaves that clamp out).
 * Below x = FL_EXP2_MIN (-100; float64 -1000) the result is exactly 0. The step's exponents
 * are differences from a row's maximum: such a probability is 76 bits (float64: 947) under
 * the unit roundoff of the sums it enters (ℓ >= 1), and cutting it there keeps every value
 * the step forms from P normal: a subnormal P, or a product P·V that underflows (2^-125·V
 * for |V| < 1/2), costs a microcode assist each. Measured on an ALiBi forward at L = 4096
 * (its scores fall through that range along every row; Intel Xeon): 340 ms with the
 * subnormals, 96 with P cut at 2^-125 but the scaling below it still underflowing, 72 with
 * that clamped, 61-65 with the cut at 2^-100, as fast as ALiBi with zero slopes. x is
 * clamped below at FL_EXP2_MIN, so that no step of the computation underflows, and the
 * result there replaced by 0. NaN stays NaN. */
#if FL_DOUBLE
#define FL_EXP2_MIN -1000.0
#else
#define FL_EXP2_MIN -100.0f
#endif
static inline VT vexp2_(VT x, int upper) {
#if FL_DOUBLE
    const T lo = FL_EXP2_MIN, hi = 1023.0;
    /* p = 1 + f q(f) as one polynomial, f^0 first */
    static const T c[] = {1.0, 0.6931471805599453, 0.24022650695910097, 0.0555041086648216,
                          0.009618129107606888, 0.0013333558146416936, 0.0001540353044173605,
                          1.525273382983612e-05, 1.321544258792169e-06, 1.0178062445845774e-07,
                          7.072585949269223e-09, 4.4549605981865186e-10};
    const int deg = 11;
#elif FL_HALF
    /* the half builds round P to the input dtype (relative error 2^-9 or 2^-12) before
     * P V reads it: degree 4 (relative error 3.1e-6, 26 ulps of float32, in P and in the
     * row sums ℓ) is far below that rounding */
    const T lo = FL_EXP2_MIN, hi = 127.0f;
    static const T c[] = {1.0f, 0.69312197f, 0.24023719f, 0.055916935f, 0.009600403f};
    const int deg = 4;
#else
    const T lo = FL_EXP2_MIN, hi = 127.0f;
    static const T c[] = {1.0f, 0.6931471824645996f, 0.24022646248340607f,
                          0.05550329014658928f, 0.009618519805371761f,
                          0.0013399859890341759f, 0.00015337577497120947f};
    const int deg = 6;
#endif
#if defined(__AVX512F__)
    /* no clamp: scalef saturates to inf by itself, and a lane below lo (-inf included,
     * whose r and f are -inf and NaN) is zeroed by the masked scale, which keeps NaN; the
     * same values as the clamped form below, two operations of about fifteen fewer (a
     * forward pass's softmax spent 16 % of its samples on them, Intel Xeon model 207) */
    (void)hi, (void)upper;
#if FL_DOUBLE
    (void)c, (void)deg;
    static const T tab[16] = { /* 2^(j/16), rounded to nearest */
        1.0, 1.0442737824274138, 1.0905077326652577, 1.1387886347566916, 1.189207115002721,
        1.241857812073484, 1.2968395546510096, 1.3542555469368927, 1.4142135623730951,
        1.4768261459394993, 1.5422108254079407, 1.6104903319492543, 1.681792830507429,
        1.7562521603732995, 1.8340080864093424, 1.9152065613971474};
    static const T e[] = {0.6931471805599457, 0.24022650695910075, 0.0555041086566393,
                          0.009618129106919537, 0.0013333781576784268, 0.00015403723980749256};
    /* t = x + 1.5 · 2^48 rounds x to a multiple of 1/16: r = t - 1.5 · 2^48, exact f = x -
     * r, and t's low 4 bits are j = 16 r mod 16 (two's complement: r = floor(r) + j/16 for
     * negative r too), the index the permute reads; scalef's 2^floor(r) puts n back */
    const VT big = splat(0x1.8p48);
    VT t = x + big, r = t - big, f = x - r;
    __m512d lo8 = _mm512_loadu_pd(tab), hi8 = _mm512_loadu_pd(tab + 8);
    VT tj = (VT)_mm512_permutex2var_pd(lo8, (__m512i)t, hi8);
    VT q = splat(e[5]);
    for (int i = 4; i >= 0; --i) q = q * f + e[i];
    /* 2^(j/16) (1 + f q): the last step one fused multiply-add */
    return vscale_from(tj * (q * f) + tj, r, x, lo);
#else
    VT r = vround(x), f = x - r;
    VT p = splat(c[deg]);
    for (int i = deg - 1; i >= 0; --i) p = p * f + c[i];
    return vscale_from(p, r, x, lo);
#endif
#else
    /* clamp (a NaN stays NaN: the bound is only taken where the comparison holds) */
    VT xc = vmax_keep(x, splat(lo));
    if (upper) xc = vmin_keep(xc, splat(hi));
    VT t = vmagic(xc), r = vround_of(t), f = xc - r;
    VT p = splat(c[deg]);
    for (int i = deg - 1; i >= 0; --i) p = p * f + c[i];
    /* p · 2^r, and 0 below FL_EXP2_MIN (a NaN compares false and stays) */
    VT y = p * vpow2_of(t);
    return vsel((VI)(x < splat(FL_EXP2_MIN)), splat(0), y);
#endif
}

static inline VT vexp2(VT x) { return vexp2_(x, 1); }
/* 2^x where x <= 0 or NaN (the forward's exponents, differences from the row's max): the
 * same values without the upper clamp, one operation of the ~16 fewer (on AMD EPYC
 * family 25 model 1, 7.5 cycles a vector of float32 instead of 8.4) */
static inline VT vexp2_nonpos(VT x) { return vexp2_(x, 0); }
static inline T exp2s(T x) { return vexp2(splat(x))[0]; }

/* tanh(x), vectorised (a softcap's): below |x| = 1/2 its Taylor series in x² (float64 to
 * x^33, float32 to x^15: the next term under a unit in the last place there), x · (1 -
 * x²/3 + 2x⁴/15 - ...); above, 1 - 2 / (e^{2|x|} + 1) with vexp2, the sign put back. Within
 * 2.4 units in the last place of tanh in both dtypes (measured against long double's
 * tanhl on 1.5 million points from 2^-30 to 128); tanh(±inf) = ±1, NaN stays NaN. */
static inline VT vtanh(VT x) {
#if FL_DOUBLE
    static const T c[] = {1.0, -0.3333333333333333, 0.13333333333333333, -0.05396825396825397,
                          0.021869488536155203, -0.008863235529902197, 0.003592128036572481,
                          -0.0014558343870513183, 0.000590027440945586, -0.00023912911424355248,
                          9.691537956929451e-05, -3.927832388331683e-05, 1.5918905069328964e-05,
                          -6.451689215655431e-06, 2.6147711512907546e-06, -1.0597268320104654e-06,
                          4.294911078273806e-07};
    const int deg = 16;
#else
    static const T c[] = {1.0f, -0.33333334f, 0.13333334f, -0.053968254f, 0.021869488f,
                          -0.008863236f, 0.003592128f, -0.0014558344f};
    const int deg = 7;
#endif
    VT a = vsel((VI)(x < splat(0)), -x, x), z = x * x, p = splat(c[deg]);
    for (int i = deg - 1; i >= 0; --i) p = p * z + c[i];
    VT e = vexp2(a * (T)(2 * LOG2E)), big = splat(1) - splat(2) / (e + splat(1));
    big = vsel((VI)(x < splat(0)), -big, big);
    return vsel((VI)(a < splat((T)0.5)), x * p, big);
}

/* The step's matmuls: C (m x n, column-major, ldc) = alpha · A B + beta · C, beta 0 or 1,
 * A (m x k) column-major (lda), B read as B(kk, j) = b[kk · sbk + j · sbn]. Every call site
 * lays its operands out so that A needs no packing (its m index is contiguous) and B is
 * read by broadcasts. With AVX-512, or AVX2 and FMA, the step's own register-blocked
 * kernel runs it (one core: the calls are made from inside the OpenMP loops); otherwise,
 * or when switched off (fl_set_own_gemm), the BLAS gemm; half inputs always on the BLAS's
 * mixed gemm. */
#if (defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && VBYTES == 32)) && !FL_HALF
#define FL_OWN 1
/* x broadcast from memory: a load µop alone (no shuffle on the port an FMA needs, as a
 * register broadcast costs on Intel, nor the add of `zero + x`) */
#if defined(__AVX512F__) && FL_DOUBLE
static inline VT bcast(const T *p) { return (VT)_mm512_set1_pd(*p); }
#elif defined(__AVX512F__)
static inline VT bcast(const T *p) { return (VT)_mm512_set1_ps(*p); }
#elif FL_DOUBLE
static inline VT bcast(const T *p) { return (VT)_mm256_broadcast_sd(p); }
#else
static inline VT bcast(const T *p) { return (VT)_mm256_broadcast_ss(p); }
#endif
#if defined(__AVX512F__)
#if FL_DOUBLE
typedef __mmask8 MT;
static inline VT loadm(MT k, const T *p) { return (VT)_mm512_maskz_loadu_pd(k, p); }
static inline void storem(T *p, MT k, VT v) { _mm512_mask_storeu_pd(p, k, (__m512d)v); }
#else
typedef __mmask16 MT;
static inline VT loadm(MT k, const T *p) { return (VT)_mm512_maskz_loadu_ps(k, p); }
static inline void storem(T *p, MT k, VT v) { _mm512_mask_storeu_ps(p, k, (__m512)v); }
#endif
/* the first x lanes */
static inline MT lanes(int x) { return x >= W ? (MT)-1 : (MT)((1u << x) - 1); }
/* x in the lanes of k, fill in the others */
#if FL_DOUBLE
static inline VT vkeep(MT k, VT x, VT fill) {
    return (VT)_mm512_mask_blend_pd(k, (__m512d)fill, (__m512d)x);
}
#else
static inline VT vkeep(MT k, VT x, VT fill) {
    return (VT)_mm512_mask_blend_ps(k, (__m512)fill, (__m512)x);
}
#endif
#else
/* AVX2: no mask registers; a lane mask is a vector of all-ones / zero integers, read by
 * vmaskmov (only a tail's last vector of rows goes through it) */
typedef VI MT;
#if FL_DOUBLE
static inline VT loadm(MT k, const T *p) { return (VT)_mm256_maskload_pd(p, (__m256i)k); }
static inline void storem(T *p, MT k, VT v) { _mm256_maskstore_pd(p, (__m256i)k, (__m256d)v); }
static inline MT lanes(int x) { return (MT){0, 1, 2, 3} < (TI)x; }
#else
static inline VT loadm(MT k, const T *p) { return (VT)_mm256_maskload_ps(p, (__m256i)k); }
static inline void storem(T *p, MT k, VT v) { _mm256_maskstore_ps(p, (__m256i)k, (__m256)v); }
static inline MT lanes(int x) { return (MT){0, 1, 2, 3, 4, 5, 6, 7} < (TI)x; }
#endif
static inline VT vkeep(MT k, VT x, VT fill) { return vsel(k, x, fill); }
#endif
/* One block of C: MV vectors of rows (vector r under mask mk[r]: a tail's last vector
 * partly; `full`: no masks) x NB columns in MV·NB registers, each entry summed over kk in
 * order with one fused multiply-add per term; C = alpha · sum (+ C). With cm (a forward's
 * S = Q Kᵀ, C's columns its rows): each column's values as written back also merged into
 * the column's vector of maxima at cm + c·W, lane by lane (a ragged vector's unused lanes
 * left out), so that the softmax takes each row's maximum without a pass over S: a
 * float32 forward at L = 4096 and 8192 in 0.96-0.97 x the time (Intel Xeon model 207,
 * benchmarks/two_builds.py --forward, 11 rounds). The unmasked loop is
 * a copy of the masked one on purpose: loading every vector through its mask (all ones
 * for a full block) measured 3x slower (479 -> 163 GFLOP/s float32 on two threads). Every
 * loop over the registers is unrolled by name (FL_UNROLL): left to itself GCC rolls the
 * write-back into a loop over a stack copy of the accumulators (24 zeroing stores on
 * entry, 24 spills and reloads at the end). Unrolled, a forward tile's 512-key QKᵀ
 * (k = 64) ran at 50 % of the register FMA peak instead of 47-48 %, one block alone 79-80
 * instead of 76-77; its PV (k = 512) the same within the noise (one thread, 15 interleaved
 * rounds, Intel Xeon family 6 model 167). */
#define FL_UNROLL _Pragma("GCC unroll 32")
/* the unmasked loop over kk unrolled twice on AVX2 (16 registers: 12 accumulators, two of
 * A, a broadcast): a forward tile's QKᵀ (k = 64) and PV (k = 1024) ran at 84 / 89 % of
 * the register FMA peak instead of 80 / 86 (one thread, AMD EPYC family 25 model 1). Not
 * measured on AVX-512, which keeps the loop as it was. */
#if defined(__AVX512F__)
#define FL_KK
#else
#define FL_KK _Pragma("GCC unroll 2")
#endif
#define FL_MM_BLOCK(MV, NB)                                                                  \
    static void mm_block_##MV##_##NB(int k, T alpha, const T *A, long long lda,              \
                                     const T *B, long long sbk, long long sbn, int accum,    \
                                     T *C, long long ldc, const MT *mk, int full, T *cm) {   \
        VT acc[NB][MV], zero = {0};                                                          \
        FL_UNROLL for (int c = 0; c < NB; ++c)                                               \
            FL_UNROLL for (int r = 0; r < MV; ++r) acc[c][r] = zero;                         \
        if (full)                                                                            \
            FL_KK for (int kk = 0; kk < k; ++kk) {                                           \
                VT av[MV];                                                                   \
                FL_UNROLL for (int r = 0; r < MV; ++r) av[r] = loadv(A + kk * lda + r * W);  \
                FL_UNROLL for (int c = 0; c < NB; ++c) {                                     \
                    VT b = bcast(B + kk * sbk + c * sbn);                                     \
                    FL_UNROLL for (int r = 0; r < MV; ++r) acc[c][r] += av[r] * b;           \
                }                                                                            \
            }                                                                                \
        else                                                                                 \
            for (int kk = 0; kk < k; ++kk) {                                                 \
                VT av[MV];                                                                   \
                FL_UNROLL for (int r = 0; r < MV; ++r)                                       \
                    av[r] = loadm(mk[r], A + kk * lda + r * W);                              \
                FL_UNROLL for (int c = 0; c < NB; ++c) {                                     \
                    VT b = bcast(B + kk * sbk + c * sbn);                                     \
                    FL_UNROLL for (int r = 0; r < MV; ++r) acc[c][r] += av[r] * b;           \
                }                                                                            \
            }                                                                                \
        VT al = zero + alpha;                                                                \
        if (cm) /* and each column's maximum, lane by lane, merged into cm */                \
            FL_UNROLL for (int c = 0; c < NB; ++c) {                                         \
                VT top = loadv(cm + c * W);                                                  \
                FL_UNROLL for (int r = 0; r < MV; ++r) {                                     \
                    T *p = C + c * ldc + r * W;                                              \
                    VT x = al * acc[c][r];                                                   \
                    if (full) {                                                              \
                        x = accum ? loadv(p) + x : x;                                        \
                        storev(p, x);                                                        \
                    } else {                                                                 \
                        x = accum ? loadm(mk[r], p) + x : x;                                 \
                        storem(p, mk[r], x);                                                 \
                        x = vkeep(mk[r], x, splat(-INFINITY));                               \
                    }                                                                        \
                    top = vmax(top, x);                                                      \
                }                                                                            \
                storev(cm + c * W, top);                                                     \
            }                                                                                \
        else if (full)                                                                       \
            FL_UNROLL for (int c = 0; c < NB; ++c)                                           \
                FL_UNROLL for (int r = 0; r < MV; ++r) {                                     \
                    T *p = C + c * ldc + r * W;                                              \
                    VT x = al * acc[c][r];                                                   \
                    storev(p, accum ? loadv(p) + x : x);                                     \
                }                                                                            \
        else                                                                                 \
            FL_UNROLL for (int c = 0; c < NB; ++c)                                           \
                FL_UNROLL for (int r = 0; r < MV; ++r) {                                     \
                    T *p = C + c * ldc + r * W;                                              \
                    VT x = al * acc[c][r];                                                   \
                    storem(p, mk[r], accum ? loadm(mk[r], p) + x : x);                       \
                }                                                                            \
    }
#define FL_COLS_6(MV) \
    FL_MM_BLOCK(MV, 1) FL_MM_BLOCK(MV, 2) FL_MM_BLOCK(MV, 3) FL_MM_BLOCK(MV, 4) \
    FL_MM_BLOCK(MV, 5) FL_MM_BLOCK(MV, 6)
#define FL_COLS_8(MV) FL_COLS_6(MV) FL_MM_BLOCK(MV, 7) FL_MM_BLOCK(MV, 8)
#define FL_COLS_12(MV) \
    FL_COLS_8(MV) FL_MM_BLOCK(MV, 9) FL_MM_BLOCK(MV, 10) FL_MM_BLOCK(MV, 11) FL_MM_BLOCK(MV, 12)
typedef void (*mm_block_fn)(int, T, const T *, long long, const T *, long long, long long, int,
                            T *, long long, const MT *, int, T *);
#define FL_TABLE_6(MV) 0, mm_block_##MV##_1, mm_block_##MV##_2, mm_block_##MV##_3, \
    mm_block_##MV##_4, mm_block_##MV##_5, mm_block_##MV##_6
#define FL_TABLE_8(MV) FL_TABLE_6(MV), mm_block_##MV##_7, mm_block_##MV##_8
#define FL_TABLE_12(MV) FL_TABLE_8(MV), mm_block_##MV##_9, mm_block_##MV##_10, \
    mm_block_##MV##_11, mm_block_##MV##_12
#if defined(__AVX512F__)
/* AVX-512, 32 registers: 4 vectors x 6 columns, and for the last rows of C 3 x 8, 2 x 12,
 * 1 x 12 (24 accumulators where the rows allow), each with its narrower column tails */
FL_COLS_6(4)
FL_COLS_8(3)
FL_COLS_12(2)
FL_COLS_12(1)
static const mm_block_fn blocks_1[13] = {FL_TABLE_12(1)}, blocks_2[13] = {FL_TABLE_12(2)},
                         blocks_3[9] = {FL_TABLE_8(3)}, blocks_4[7] = {FL_TABLE_6(4)};
static const mm_block_fn *const mm_blocks[5] = {0, blocks_1, blocks_2, blocks_3, blocks_4};
static const int mm_cols[5] = {0, 12, 12, 8, 6};
/* vectors of rows in the next block, of `left`: 4 at a time, the last 1-3 (5 as 3 + 2) in
 * a block of their own */
static inline int mm_vectors(int left) { return left == 5 ? 3 : left < 4 ? left : 4; }
#else
/* AVX2, 16 registers: 2 vectors x 6 columns (12 accumulators, 2 vectors of A, one
 * broadcast), the last vector of rows 1 x 12. (3 x 4, one load fewer per step, needs all
 * 16 registers: GCC spills, and it ran at half the rate.) */
FL_COLS_6(2)
FL_COLS_12(1)
static const mm_block_fn blocks_1[13] = {FL_TABLE_12(1)}, blocks_2[7] = {FL_TABLE_6(2)};
static const mm_block_fn *const mm_blocks[3] = {0, blocks_1, blocks_2};
static const int mm_cols[3] = {0, 12, 6};
static inline int mm_vectors(int left) { return left < 2 ? left : 2; }
#endif

static void own_mm(int m, int n, int k, T alpha, const T *A, long long lda, const T *B,
                   long long sbk, long long sbn, int accum, T *C, long long ldc, T *cm) {
    /* C's rows in blocks of mm_vectors vectors, with more columns for a narrower last
     * block. A block of A's rows runs over all of n. (Passes over k of 64-256 at a time,
     * to keep the block in L1 when k is 512, measured no faster on either vendor: the L2
     * keeps up.) */
    for (int i0 = 0; i0 < m;) {
        int mv = mm_vectors((m - i0 + W - 1) / W);
        int rows = m - i0 < mv * W ? m - i0 : mv * W, nr = mm_cols[mv];
        MT mk[4];
        for (int r = 0; r < mv; ++r) mk[r] = lanes(rows - r * W);
        for (int j0 = 0; j0 < n; j0 += nr) {
            int nb = n - j0 < nr ? n - j0 : nr;
            mm_blocks[mv][nb](k, alpha, A + i0, lda, B + j0 * sbn, sbk, sbn, accum,
                              C + i0 + j0 * ldc, ldc, mk, rows == mv * W,
                              cm ? cm + (long long)j0 * W : NULL);
        }
        i0 += rows;
    }
}
#else
#define FL_OWN 0
#endif
static int use_own = FL_OWN;
/* the forward pass's: 1 own kernel, 0 BLAS (gemm_fwd), -1 as use_own and GEMM. The
 * calibration measures the forward's back end apart: on AMD EPYC family 25 model 1 the own
 * kernel ran a forward in 0.90 x SDPA's time where MKL took 1.00, and MKL forward +
 * backward in 0.88 where the own kernel took 0.96 (float32, L = 8192 and 4096, 2 threads). */
static int own_fwd = -1;
/* set while this thread runs a forward work item (mm takes the forward's back end) */
static _Thread_local int in_forward;
/* 1: a backward block's score products (S = Q K_jᵀ again and dP = dO V_jᵀ, k = d, the
 * forward's S product's shape) run on the own kernel whatever the back end; the three
 * products that sum over the block's rows or keys (dV_j, dK_j, dQ) stay on it. The
 * calibration measures it where the back end is a BLAS: a BLAS call packs both operands
 * of each such product (K_jᵀ and V_jᵀ again for every block of rows), which the own kernel
 * reads in place; on Intel Xeon model 207 (MKL, L = 4096, 2 threads) a float64 forward +
 * backward ran in 0.98 x the time so, float32 in 0.99 x (11 rounds against the build
 * before). */
static int scores_own;
/* set while this thread forms a backward block's score products (scores_own's) */
static _Thread_local int in_scores;
/* *c, set back to 0 in the same atomic step (the counts below, read by the tests) */
static long long take_count(long long *c) {
    long long n;
#pragma omp atomic capture
    {
        n = *c;
        *c = 0;
    }
    return n;
}
/* score products the own kernel ran for scores_own alone (not small enough to run there
 * anyway), since the last call (which resets it) */
static long long scores_own_products;
long long SUF(fl_scores_own_products)(void) { return take_count(&scores_own_products); }
/* m·n·k at or below which a product runs on the own kernel even with a BLAS chosen */
#define FL_SMALL_MM (1LL << 18)
#define FL_MAX_SPLITS 64 /* key splits of a forward pass, at most (the caller asks 16) */
/* 1: the step's own kernel (where built), 0: the BLAS gemm. Returns the setting in force. */
int SUF(fl_set_own_gemm)(int on) { return use_own = FL_OWN && on; }
/* the forward pass's: 1 own, 0 BLAS (fl_set_forward_gemm's), -1 as the rest of the step */
int SUF(fl_set_forward_own_gemm)(int on) { return own_fwd = on < 0 ? -1 : FL_OWN && on; }
/* 1: a backward's score products on the own kernel (where built), 0: on the back end.
 * Returns the setting in force. */
int SUF(fl_set_scores_own_gemm)(int on) { return scores_own = FL_OWN && on; }
/* 1 where the own kernel was built (AVX-512, or AVX2 with FMA; not the half builds) */
int SUF(fl_own_built)(void) { return FL_OWN; }
/* 1: a forward's full tiles take their rows' score maxima from the own kernel's write-back
 * of S (no pass over S for them); 0: from a pass over S, as every other tile (the tests
 * compare the two). Returns the setting in force. */
static int product_maxima = 1;
int SUF(fl_set_product_maxima)(int on) { return product_maxima = on != 0; }
/* blocks of rows whose maxima came from the product, since the last call (which resets it) */
static long long product_maxima_blocks;
long long SUF(fl_product_maxima_blocks)(void) { return take_count(&product_maxima_blocks); }

/* 1 where mm runs an m x n x k product on the own kernel in this thread, 0 on a BLAS */
static int mm_own(long long m, long long n, long long k) {
#if FL_OWN
    int fwd = in_forward && own_fwd >= 0; /* the forward's own back end */
    /* a small product (a decode step's, a partial tile's narrow span) costs a BLAS call
     * more to enter than to run: it takes the own kernel, whichever back end is chosen */
    return (fwd ? own_fwd : use_own) || in_scores || m * n * k <= FL_SMALL_MM;
#else
    (void)m, (void)n, (void)k;
    return 0;
#endif
}

static int mm(int m, int n, int k, T alpha, const TIN *A, long long lda, const TIN *B,
              long long sbk, long long sbn, T beta, T *C, long long ldc, T *cm) {
    int fwd = in_forward && own_fwd >= 0; /* the forward's own back end */
    gemm_fn gemm = fwd && gemm_fwd ? gemm_fwd : GEMM;
    (void)cm;
#if FL_OWN
    if (mm_own(m, n, k)) {
        int small = (long long)m * n * k <= FL_SMALL_MM;
        if (in_scores && !small) { /* here for scores_own alone */
#pragma omp atomic
            ++scores_own_products;
        }
        own_mm(m, n, k, alpha, A, lda, B, sbk, sbn, beta != 0, C, ldc, cm);
        return cm != NULL;
    }
#endif
    /* B as BLAS sees it: "N" (column j at b + j·ldb) when it runs along kk, else "T"; a
     * single column runs along kk whatever sbn says */
    int bn = sbk == 1 && (n == 1 || sbn >= k);
    int ia = (int)lda, ic = (int)ldc, ib = (int)(bn ? (n == 1 ? (k > 1 ? k : 1) : sbn) : sbk);
    gemm("N", bn ? "N" : "T", &m, &n, &k, &alpha, A, &ia, B, &ib, &beta, C, &ic);
    return 0;
}

/* The step's matmul on its own (tests, and the bench's rate): mm on the calling thread. */
void SUF(fl_matmul)(int m, int n, int k, double alpha, const TIN *A, long long lda,
                    const TIN *B, long long sbk, long long sbn, double beta, T *C, long long ldc) {
    mm(m, n, k, (T)alpha, A, lda, B, sbk, sbn, (T)beta, C, ldc, NULL);
}

/* A row stride for x elements that is not a power of two times a cache line's worth of
 * elements: x rounded up to whole vectors, plus one vector. Rows of a power-of-two stride
 * (Lk = 4096, tiles of 512) all fall in a few L1 sets and evict each other when a matmul
 * walks down a column; one more line per row spreads them over every set. */
static inline long long padded(long long x) { return (x + W - 1) / W * W + W; }
long long SUF(fl_padded)(long long x) { return padded(x); }

/* The step's matmul rate: every thread runs `reps` products C += A B of n x n by n x n on
 * buffers of its own (ab: threads x 2 x n x padded(n), c: threads x n x padded(n), rows
 * padded as the step pads its tiles), as the tile steps run theirs. */
void SUF(fl_matmul_rate)(const TIN *ab, T *c, int n, int reps) {
    long long ld = padded(n), sz = n * ld; /* the step's padded row strides */
#pragma omp parallel
    {
        long long me = omp_get_thread_num();
        const TIN *a = ab + me * 2 * sz, *b = a + sz;
        T *cm = c + me * sz;
        for (int r = 0; r < reps; ++r) mm(n, n, n, 1, a, ld, b, 1, ld, 1, cm, ld, NULL);
    }
}

/* The 8 x 8 (float64: 4 x 4) block at s (rows ss apart) transposed into d (rows ds apart),
 * in registers: loads, unpacks, shuffles and lane swaps, a copy of every value. */
#if defined(__AVX__) && !FL_HALF
#if FL_DOUBLE
#define FL_TR 4 /* the block's side: one vector */
#else
#define FL_TR 8
#endif
static inline void transpose_block(const TIN *s, long long ss, TIN *d, long long ds) {
#if FL_DOUBLE
    __m256d r0 = _mm256_loadu_pd(s), r1 = _mm256_loadu_pd(s + ss);
    __m256d r2 = _mm256_loadu_pd(s + 2 * ss), r3 = _mm256_loadu_pd(s + 3 * ss);
    __m256d t0 = _mm256_unpacklo_pd(r0, r1), t1 = _mm256_unpackhi_pd(r0, r1); /* a0 b0 a2 b2 */
    __m256d t2 = _mm256_unpacklo_pd(r2, r3), t3 = _mm256_unpackhi_pd(r2, r3);
    _mm256_storeu_pd(d, _mm256_permute2f128_pd(t0, t2, 0x20)); /* a0 b0 c0 d0 */
    _mm256_storeu_pd(d + ds, _mm256_permute2f128_pd(t1, t3, 0x20));
    _mm256_storeu_pd(d + 2 * ds, _mm256_permute2f128_pd(t0, t2, 0x31));
    _mm256_storeu_pd(d + 3 * ds, _mm256_permute2f128_pd(t1, t3, 0x31));
#else
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(s + i * ss);
    for (int i = 0; i < 8; i += 2) { /* a0 b0 a1 b1 | a4 b4 a5 b5, a2 b2 a3 b3 | a6 b6 a7 b7 */
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) { /* a0 b0 c0 d0 | a4 b4 c4 d4, ... a3 b3 c3 d3 | a7 ... */
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; ++i) { /* column i from rows a-d and e-h, then column i + 4 */
        _mm256_storeu_ps(d + i * ds, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        _mm256_storeu_ps(d + (i + 4) * ds, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
    }
#endif
}
#else
#define FL_TR 0
#endif

/* Rows [r0, r1) of src (cols values a row, contiguous) transposed into dst, row r's value c
 * at dst[c · ld + r]: whole vector blocks in registers (transpose_block), the edges value
 * by value, the same copy either way. */
static inline void transpose_span(const TIN *src, long long cols, long long r0, long long r1,
                                  TIN *dst, long long ld) {
    long long rv = r0, cv = 0; /* the vector blocks: rows [r0, rv), cols [0, cv) */
#if FL_TR
    rv = r0 + (r1 - r0) / FL_TR * FL_TR;
    cv = cols / FL_TR * FL_TR;
    for (long long r = r0; r < rv; r += FL_TR)
        for (long long c = 0; c < cv; c += FL_TR)
            transpose_block(src + r * cols + c, cols, dst + c * ld + r, ld);
#endif
    for (long long c = 0; c < cols; ++c) /* the edges: rows [rv, r1), and cols [cv, cols) */
        for (long long r = c < cv ? rv : r0; r < r1; ++r) dst[c * ld + r] = src[r * cols + c];
}

/* dst = each of the n (rows x cols) matrices of src transposed, per tile of `tile` rows
 * (0 or rows: one tile): dst (n, tiles, cols, ld), tile j of matrix b the transpose of its
 * rows [j·tile, (j + 1)·tile), row stride ld >= tile (the last tile's rows may be fewer):
 * the Kᵀ a forward reads (t_at), laid out once. Work items are (matrix, tile, 64 rows),
 * each a transpose_span. Measured (AMD EPYC family 25 model 1, 2
 * threads, K of 4 x L x 64 into a warm buffer, median of 50-200 calls): float32 at L = 4096
 * (per key tile of 512) 0.30 ms value by value, 0.15-0.18 with the blocks; at L = 512
 * 63 µs, 33-39; float64 at L = 4096 0.6 ms either way, within the noise (memory-bound). */
/* The work items of such a layout: `tile` made whole (0: all the rows), *items of them */
struct layout {
    long long tile, tiles, rb; /* rows per tile, tiles per matrix, 64-row spans per tile */
};
static inline struct layout layout_of(long long n, long long rows, long long tile,
                                      long long *items) {
    struct layout l;
    l.tile = tile <= 0 || tile > rows ? rows : tile;
    l.tiles = (rows + l.tile - 1) / l.tile;
    l.rb = (l.tile + 63) / 64;
    *items = n * l.tiles * l.rb;
    return l;
}
/* item w's matrix b, rows [*r0, *r1), and the offset in dst (row stride ld, cols rows) of
 * its tile's column 0 less its first row: row r's value c goes to dst[off + c · ld + r] */
static inline long long layout_item(const struct layout *l, long long w, long long rows,
                                    long long cols, long long ld, long long *b, long long *r0,
                                    long long *r1) {
    long long bt = w / l->rb, t0 = (bt % l->tiles) * l->tile;
    long long t1 = t0 + l->tile < rows ? t0 + l->tile : rows;
    *b = bt / l->tiles;
    *r0 = t0 + (w % l->rb) * 64;
    *r1 = *r0 + 64 < t1 ? *r0 + 64 : t1;
    return bt * ld * cols - t0;
}
void SUF(fl_transpose)(const TIN *src, TIN *dst, long long n, long long rows, long long cols,
                      long long ld, long long tile) {
    long long items;
    struct layout l = layout_of(n, rows, tile, &items);
#pragma omp parallel for schedule(static)
    for (long long w = 0; w < items; ++w) {
        long long b, r0, r1, off = layout_item(&l, w, rows, cols, ld, &b, &r0, &r1);
        transpose_span(src + b * rows * cols, cols, r0, r1, dst + off, ld);
    }
}


/* One pass's arguments. Layouts (row-major, contiguous), H = B·Hq query heads, head h
 * reading K/V head h / group. A pass runs a schedule: rows (the forward's query tiles, the
 * backward's key tiles), each a list of tiles, FL_TILE fields per tile (q0, q1, k0, k1,
 * partial, vis, vis_sn, vis_sg, term, ds, term_rs, term_heads, ds_rs, ds_heads): a partial
 * tile's visibility is its uint8 bytes (rows x cols) for head h at vis + (h / group) · vis_sn
 * + (h % group) · vis_sg (strides 0 where the mask broadcasts), or, with vis 0, the pass's
 * intervals (iv_lo, iv_hi).
 * A tile's term (or 0) is an additive term of its scores (a score_mod's, natural units), T
 * values (H, rows, cols) contiguous, or, with term_heads (an address of H offsets) not 0, read
 * where they lie: head h's row i (of the tile's rows) at term + term_heads[h] + i · term_rs,
 * its keys contiguous (a bias, no copy per tile); its ds (backward, or 0) where dS of the
 * final scores goes, (H, rows, cols) contiguous, or with ds_heads not 0 where it lies as a
 * term does (a bias's gradient; the pass writes the positions it computes). */
struct fl_args {
    const TIN *q, *k, *kt, *v; /* (H, Lq, d), (Hk, Lk, d), (Hk, d, Lk) (the forward's; a
                                  backward's items lay out their key tiles'), (Hk, Lk, d_v), in
                                  the input dtype */
    T *o, *lse;               /* forward: O (S, H, Lq, d_v) and λ (S, H, Lq), S = splits */
    const TIN *dout;          /* backward: dO (H, Lq, d_v), in the input dtype */
    const T *lam, *dd;        /* backward: λ (+inf on empty rows), D (H, Lq) */
    T *dq, *dk, *dvo;         /* backward: dQ (S, H, Lq, d) (split s > 0: a part to add);
                                 dK (Hk, Lk, d), dV (Hk, Lk, d_v) */
    T *work;                  /* per thread, work_stride elements */
    const long long *iv_lo, *iv_hi; /* interval masks: row i of batch b sees keys
                                       [iv_lo, iv_hi)[b · iv_bstride + i] (local), or NULL */
    const unsigned short *k16, *v16; /* forward with keys in place (kt NULL): K, V in a half
                                        dtype (half = 1: bfloat16, 2: float16), or NULL */
    const unsigned short *q16; /* with a half K (keys in place): Q's rows in K's half dtype
                                  when they are exactly q's values (the call's q was that
                                  dtype), or NULL; q itself may then be NULL (the rows are
                                  widened as a work item starts) */
    const long long *tiles;     /* the schedule's tiles, FL_TILE fields each */
    const long long *row_start; /* row r's tiles are [row_start[r], row_start[r + 1]) */
    const long long *bounds;    /* row r covers [bounds[2r], bounds[2r + 1]): its queries
                                   (forward) or keys (backward), tiles or none */
    long long *seen;            /* per tile: visible dots of a partial tile, all heads */
    unsigned short *o16;        /* forward, one part (S = 1): O written in a half dtype instead
                                   of into o (the half builds': theirs; the float32 build's, keys
                                   in place: `half`; with parts and `merge`, there the merged O
                                   rounded into it), or NULL */
    long long *bad;             /* forward: set to 1 when a row's λ or O is not finite, or NULL */
    const TIN *kp, *vp;         /* forward with `amx`: K and V in AMX's pair layout (fl_pack_amx) */
    T *mx;                      /* forward: each row's final running max m (S, H, Lq), natural
                                   units (-inf where a part saw no key), or NULL */
    const T *al_slope;          /* ALiBi (alibi > 0): each row's slope (H, Lq) */
    const long long *al_center; /* and the local key its distances are measured from (H, Lq) */
    unsigned short *dk16, *dv16; /* backward: dK and dV written in a half dtype instead of into
                                    dk, dvo (the half builds': theirs; the float32 build's:
                                    `half`), rounded as PyTorch's conversion rounds, or NULL */
    const unsigned short *dout16; /* the float32 build's backward with half inputs widened as
                                     read (q, k, v, dout NULL; q16, k16, v16, dout16 in `half`),
                                     or NULL */
    long long heads, group, lq, lk, d, dv, work_stride;
    long long hq, iv_bstride; /* query heads per batch; the intervals' batch stride (0: shared) */
    long long rows;           /* rows of the schedule */
    long long chunk;          /* forward: query rows per work item */
    long long splits;         /* forward and backward: parts of each row's tiles (S) */
    long long stacked;        /* forward: a group's query heads as one block of rows */
    long long half;           /* 0, or the half dtype of k16, v16 (1: bfloat16, 2: float16) */
    long long amx;            /* forward, bfloat16 step: S and P V on AMX's tiles (kp, vp) */
    long long alibi;          /* float builds: 0, or ALiBi's form (1: -slope · |c - j|, 2:
                                 slope · (j - c), flash-attn 2's causal form; add_alibi) */
    long long kt_tile;        /* kt: 0, laid out (Hk, d, padded(Lk)), or per tile of
                                 kt_tile keys, (Hk, tiles, d, padded(kt_tile)) (t_at) */
    long long amx_dot;        /* float32 build, a bfloat16 cache read in place with q16: S on
                                 AMX's tiles (amx_dot_scores) where the build has them */
    long long merge;          /* forward with splits > 1: the parts merged into part 0 after
                                 the items (merge_states), and with `bad` the merged O and
                                 λ checked */
    long long dot_scores;     /* backward, float builds: S formed as a forward with keys in
                                 place formed it (dot_t_scores: the sums in its order) */
    double scale;
    long long scale_exact; /* scale is a power of two: exact as the matmul's alpha */
    double softcap;        /* float builds: 0, or c of a softcap, s = c · tanh(s / c) */
};
#define FL_TILE 14
/* below this many FLOPs a pass runs on the calling thread only */
#define FL_SERIAL_FLOPS 4e6

/* Rows per block inside a partial tile: small, so that each block's visible span (a
 * causal or banded diagonal) is narrow. */
#define FL_PARTIAL_ROWS 64

/* A block of nr query rows of one K/V head: rows r = 0..nr-1 are head h0 + (r0 + r) / lrows,
 * query position (r0 + r) % lrows, with lrows = Lq when a group's heads are stacked (the
 * rows then run on across heads, one block of memory) and lrows = "infinite" otherwise
 * (head h0, positions r0..). */
struct rows {
    long long h0, r0, lrows;
    int nr;
    const T *q; /* the block's Q rows (nr x d) when not read from a->q (widened), or NULL */
    const TIN *kt, *vt; /* backward: the key tile's Kᵀ_j, Vᵀ_j (d x ld, d_v x ld; key k0 at
                           column 0), laid out by its item; NULL in the forward (a->kt) */
    long long k0, ld;
};
static inline long long row_head(const struct rows *b, int r) { return b->h0 + (b->r0 + r) / b->lrows; }
static inline long long row_pos(const struct rows *b, int r) { return (b->r0 + r) % b->lrows; }
/* offset of row 0 in a (H, Lq, ·) tensor, in rows */
static inline long long row_base(const struct fl_args *a, const struct rows *b) {
    return b->h0 * a->lq + b->r0;
}

/* Offset of block row r, key k0, in values of tile t: laid out (H, rows, cols), or, with
 * heads (the address of H offsets) not 0, where they lie, rows rs apart. */
static inline long long tile_at(const long long *t, const struct rows *b, int r, long long k0,
                                long long rs, long long heads) {
    long long i = row_pos(b, r) - t[0], j = k0 - t[2];
    if (heads) return ((const long long *)(size_t)heads)[row_head(b, r)] + i * rs + j;
    return (row_head(b, r) * (t[1] - t[0]) + i) * (t[3] - t[2]) + j;
}
/* ... in tile t's term (fields term_rs, term_heads) and its ds (ds_rs, ds_heads) */
static inline long long term_at(const long long *t, const struct rows *b, int r, long long k0) {
    return tile_at(t, b, r, k0, t[10], t[11]);
}
static inline long long ds_at(const long long *t, const struct rows *b, int r, long long k0) {
    return tile_at(t, b, r, k0, t[12], t[13]);
}

/* row += f · x over n values: how a term is added to the scores (f = 1, or log2 e in the
 * forward's base-2 units), laid out (add_term) or formed in the pass (add_alibi) alike. */
static inline void add_row(T *row, const T *x, int n, T f) {
    if (f == (T)1)
        for (int j = 0; j < n; ++j) row[j] += x[j];
    else
        for (int j = 0; j < n; ++j) row[j] += f * x[j];
}

/* ALiBi's term at keys j0 .. j0 + n - 1 of a row (slope sl, center c): x[j] = -(sl · |c - j|)
 * (form 1) or sl · (j - c) (form 2), each product rounded on its own as the PyTorch step's
 * slopes · distance is: written to x, apart from the add that follows (fused into it, a
 * product would skip that rounding; tests/test_native_scored.py holds the scores to the
 * laid-out term's bit for bit). */
static inline void alibi_terms(T sl, int c, int j0, int n, long long form, T *x) {
    if (form == 1)
        for (int j = 0; j < n; ++j) x[j] = -(sl * (T)abs(c - j0 - j));
    else
        for (int j = 0; j < n; ++j) x[j] = sl * (T)(j0 + j - c);
}

#if !FL_HALF /* ALiBi and the softcap: the float builds' only (fl_args.alibi, .softcap) */
/* S += f · ALiBi's term on a block's rows and keys [k0, k0 + nc) (S's row stride ls): row
 * i's slope and center (local keys) from al_slope, al_center; the term formed as the
 * PyTorch step forms it (alibi_terms) and added by add_row, as add_term adds a laid-out
 * term: the scores are bit for bit those of the term laid out, and none is. */
static void add_alibi(const struct fl_args *a, const struct rows *b, long long k0, int nc, T *s,
                      long long ls, T f) {
    T x[256];
    for (int r = 0; r < b->nr; ++r) {
        long long i = row_head(b, r) * a->lq + row_pos(b, r);
        T sl = a->al_slope[i], *row = s + (long long)r * ls;
        int c = (int)(a->al_center[i] - k0); /* |c| <= Lq + Lk */
        for (int j0 = 0; j0 < nc; j0 += 256) {
            int n = nc - j0 < 256 ? nc - j0 : 256;
            alibi_terms(sl, c, j0, n, a->alibi, x);
            add_row(row + j0, x, n, f);
        }
    }
}

/* A softcap on a block's scores S (nr rows of nc, row stride ls; natural units, as the
 * PyTorch step forms them): t = tanh(s / c), then s = (c · t) · f (f = log2 e in the
 * forward's base-2 units, 1 in the backward, which keeps t in tb, same layout, for the
 * gradient's 1 - t²). */
static void softcap_rows(int nr, int nc, T *s, long long ls, T c, T f, T *tb) {
    VT cv = splat(c), fv = splat(f);
    for (int r = 0; r < nr; ++r) {
        T *row = s + (long long)r * ls, *trow = tb ? tb + (long long)r * ls : NULL;
        int j = 0;
        for (; j + W <= nc; j += W) {
            VT t = vtanh(loadv(row + j) / cv), x = t * cv;
            if (trow) storev(trow + j, t);
            storev(row + j, f == (T)1 ? x : x * fv);
        }
        for (; j < nc; ++j) {
            T t = vtanh(splat(row[j] / c))[0], x = t * c;
            if (trow) trow[j] = t;
            row[j] = f == (T)1 ? x : x * f;
        }
    }
}

#endif

/* S += f · term on a block's rows and keys [k0, k0 + nc) of tile t (S's row stride ls):
 * the score after an additive score_mod, as the PyTorch step adds it (f = 1), or in the
 * forward's base-2 units (f = log2 e). */
static void add_term(const long long *t, const struct rows *b, long long k0, int nc, T *s,
                     long long ls, T f) {
    const T *term = (const T *)(size_t)t[8];
    for (int r = 0; r < b->nr; ++r) add_row(s + (long long)r * ls, term + term_at(t, b, r, k0), nc, f);
}

/* Offset, in values, of key k of K/V head kh in the forward's Kᵀ (n = d rows):
 * (Hk, n, padded(Lk)), or with kt_tile per tile of kt_tile keys, (Hk, tiles, n,
 * padded(kt_tile)), each tile a matrix of its own. *ld: the row stride there. A tile's rows
 * a short stride apart, a product's row block of Kᵀ reads the first- and second-level
 * caches better than when they lie a key length apart (S = Q Kᵀ at 84-86 % of the one-core
 * peak instead of 82-83; the float32 forward 2.3 % faster at L = 4096, 1.4 % at 8192, on
 * AMD EPYC family 25 model 1). Every tile of a pass lies within one tile of the layout. */
static inline long long t_at(const struct fl_args *a, long long kh, long long n, long long k,
                             long long *ld) {
    if (!a->kt_tile) {
        *ld = padded(a->lk);
        return kh * n * *ld + k;
    }
    long long tiles = (a->lk + a->kt_tile - 1) / a->kt_tile, j = k / a->kt_tile;
    *ld = padded(a->kt_tile);
    return (kh * tiles + j) * n * *ld + (k - j * a->kt_tile);
}

/* 1 where x is a power of two (times it, every product is exact) */
static inline int pow2(T x) {
    int e;
    return fabs((double)frexp(x, &e)) == 0.5;
}

/* S = factor · Q Kᵀ for a block of rows and keys [k0, k0 + nc), the factor riding on the
 * matmul, or, with `after`, (Q Kᵀ) · factor as the reference rounds it. Either way each
 * score is the factor times the rounded sum, rounded once: the own kernel's alpha is that
 * product; a BLAS's need not be (MKL scales an operand as it packs it: with alpha =
 * scale · log2 e most of S rounded apart, with a power of two none, on Intel Xeon model
 * 207), so on a BLAS a factor that is not a power of two goes after the matmul. The two
 * passes then form the same S from the same sums whichever back end runs each, and the
 * backward's P = 2^(S - λ log2 e) sees no key's score rounded apart (see the header).
 * With cm (and the factor on the matmul), each row's maximum so far, W lanes a row,
 * merged with the row's scores as the product writes them back; returns 1 when it was
 * (the own kernel), else 0. */
static int scores(const struct fl_args *a, const struct rows *b, long long k0, int nc, T *s,
                  long long ls, double factor, int after, T *cm) {
    const TIN *qh = a->q + row_base(a, b) * a->d;
#if !FL_HALF
    if (b->q) qh = b->q; /* rows widened from a half dtype */
#endif
    long long lt;
    const TIN *kt;
    if (b->kt) { /* the backward item's Kᵀ_j */
        kt = b->kt + (k0 - b->k0);
        lt = b->ld;
    } else
        kt = a->kt + t_at(a, b->h0 / a->group, a->d, k0, &lt);
    /* S (nr x nc, row-major, row stride ls) = Q_i K_jᵀ, formed as Sᵀ = (Kᵀ_j)ᵀ-columns
     * times Q's rows */
    T f = (T)factor;
    if (!after && !pow2(f) && !mm_own(nc, b->nr, a->d)) after = 1; /* a BLAS: see above */
    int tops = mm(nc, b->nr, (int)a->d, after ? (T)1 : f, kt, lt, qh, 1, a->d, 0, s, ls,
                  after ? NULL : cm);
    if (after) {
        VT fv = splat(f);
        for (int r = 0; r < b->nr; ++r) {
            T *row = s + (long long)r * ls;
            int j = 0;
            for (; j + W <= nc; j += W) storev(row + j, loadv(row + j) * fv);
            for (; j < nc; ++j) row[j] *= f;
        }
    }
    return tops;
}

/* The row's maximum; with f != 1 the row is first scaled by f in place (each product
 * rounded and stored: the softmax then subtracts the maximum from exactly the values it
 * was taken over, so the maximum's own weight is exactly 1). */
static T row_max(T *row, int nc, T f) {
    VT t0 = splat(-INFINITY), t1 = t0, t2 = t0, t3 = t0; /* four chains hide the latency */
    int j = 0;
    if (f != (T)1) {
        VT fv = splat(f);
        for (; j + 2 * W <= nc; j += 2 * W) {
            VT x0 = loadv(row + j) * fv, x1 = loadv(row + j + W) * fv;
            storev(row + j, x0);
            storev(row + j + W, x1);
            t0 = vmax(t0, x0);
            t1 = vmax(t1, x1);
        }
        for (; j + W <= nc; j += W) {
            VT x = loadv(row + j) * fv;
            storev(row + j, x);
            t0 = vmax(t0, x);
        }
        for (int i = j; i < nc; ++i) row[i] *= f;
    }
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

/* The largest of a row's W lane maxima: what row_max gives for the row where no score is
 * NaN (a maximum is exact in any order) */
static inline T lanes_max(const T *v) {
    T t = -INFINITY;
    for (int i = 0; i < W; ++i) t = v[i] > t ? v[i] : t;
    return t;
}

/* P = 2^x (vexp2: 0, normal, inf or NaN) stored in the input dtype (store_in). For
 * bfloat16 where vcvtneps2bf16 is built in, that instruction: on such values it rounds as
 * store_in's integer rule does (its one departure, subnormal inputs read as 0, never
 * arises). */
static inline void store_p(TIN *p, VT v) {
#if FL_HALF == 1 && defined(__AVX512BF16__) && VBYTES == 64
    __m256bh h = _mm512_cvtneps_pbh((__m512)v);
    memcpy(p, &h, sizeof h);
#else
    store_in(p, v);
#endif
}

/* P = 2^(row - shift) into `out`, in the input dtype (float builds: out = row, in place);
 * returns the row sum, of P before that rounding. shift is at least every value of the
 * row (its max, or a larger running max), so each exponent is <= 0 or NaN. */
static T exp_row(const T *row, TIN *out, int nc, T shift) {
    VT sh = splat(shift), s0 = splat(0), s1 = s0;
    int j = 0;
    for (; j + 2 * W <= nc; j += 2 * W) {
        VT x0 = loadv(row + j) - sh, x1 = loadv(row + j + W) - sh;
        VT p0 = vexp2_nonpos(x0), p1 = vexp2_nonpos(x1);
        store_p(out + j, p0);
        store_p(out + j + W, p1);
        s0 += p0;
        s1 += p1;
    }
    for (; j + W <= nc; j += W) {
        VT x = loadv(row + j) - sh, p = vexp2_nonpos(x);
        store_p(out + j, p);
        s0 += p;
    }
    s0 += s1;
    T s = 0;
    for (int i = 0; i < W; ++i) s += s0[i];
    for (; j < nc; ++j) {
        T p = exp2s(row[j] - shift);
        out[j] = to_in(p);
        s += p;
    }
    return s;
}

/* Zero a row's columns outside [c0, c1) of [0, w). */
static inline void zero_outside(TIN *row, int c0, int c1, int w) {
    if (c0 > 0) memset(row, 0, (size_t)c0 * sizeof(TIN));
    if (c1 < w) memset(row + c1, 0, (size_t)(w - c1) * sizeof(TIN));
}

/* The next n elements of es bytes from a thread's scratch at *p, 64-byte aligned. */
static inline void *carve(char **p, long long n, size_t es) {
    char *x = (char *)(((size_t)*p + 63) & ~(size_t)63);
    *p = x + n * (long long)es;
    return x;
}

/* Row r's visibility bytes in a partial tile (t: its fields) whose rows start at q0. */
static inline const unsigned char *vis_row(const struct fl_args *a, const long long *t,
                                           long long h, long long q) {
    const unsigned char *vis = (const unsigned char *)(size_t)t[5];
    return vis + (h / a->group) * t[6] + (h % a->group) * t[7] + (q - t[0]) * (t[3] - t[2]);
}

/* The first nonzero byte of v[x, n), or n; eight bytes at a time where they are zero. */
static inline long long first_set(const unsigned char *v, long long x, long long n) {
    unsigned long long w8;
    for (; x + 8 <= n; x += 8) {
        memcpy(&w8, v + x, 8);
        if (w8) break;
    }
    while (x < n && !v[x]) ++x;
    return x;
}

/* One past the last nonzero byte of v[x, y), or x; eight bytes at a time likewise. */
static inline long long last_set(const unsigned char *v, long long x, long long y) {
    unsigned long long w8;
    for (; y - 8 >= x; y -= 8) {
        memcpy(&w8, v + y - 8, 8);
        if (w8) break;
    }
    while (y > x && !v[y - 1]) --y;
    return y;
}

/* Which columns of the tile t (keys [k0, k0 + nc)) a block of rows computes: each row's
 * visible columns [ca[r], cb[r]) (a full tile: all), and the block's span [*lo, *hi) that
 * holds them (lo = hi: nothing visible). Columns outside a row's range add exact zeros
 * to every sum, so a step leaves them out of its matmuls and zeroes them in P. With a
 * byte mask, gap[r] says whether the row hides a column inside its range (when it does
 * not, as on every row of a causal, windowed or packed-document tile, ``mask_bytes`` has
 * nothing to do there). Returns the visible dots of the rows (0 for a full tile). */
static long long row_ranges(const struct fl_args *a, const long long *t, const struct rows *b,
                            int *ca, int *cb, unsigned char *gap, int *lo, int *hi) {
    long long k0 = t[2], seen = 0;
    int nc = (int)(t[3] - k0), mn = nc, mx = 0;
    for (int r = 0; r < b->nr; ++r) {
        long long x = 0, y = nc;
        gap[r] = 0;
        if (t[4]) {
            long long h = row_head(b, r), q = row_pos(b, r);
            if (t[5]) { /* bytes: the first and last visible column, and a hidden one between */
                const unsigned char *vr = vis_row(a, t, h, q);
                x = first_set(vr, 0, nc);
                y = last_set(vr, x, nc);
                gap[r] = y > x && memchr(vr + x, 0, (size_t)(y - x)) != NULL;
                if (gap[r]) {
                    for (long long c = x; c < y; ++c) seen += vr[c] != 0;
                } else {
                    seen += y - x;
                }
            } else { /* intervals */
                long long off = (h / a->hq) * a->iv_bstride + q;
                x = a->iv_lo[off] - k0;
                y = a->iv_hi[off] - k0;
                x = x < 0 ? 0 : x > nc ? nc : x;
                y = y < x ? x : y > nc ? nc : y;
                seen += y - x;
            }
        }
        ca[r] = (int)x;
        cb[r] = (int)y;
        if (x < y) {
            mn = (int)x < mn ? (int)x : mn;
            mx = (int)y > mx ? (int)y : mx;
        }
    }
    *lo = mn < mx ? mn : 0;
    *hi = mn < mx ? mx : 0;
    for (int r = 0; r < b->nr; ++r) { /* relative to lo; an empty row runs over nothing */
        int e = ca[r] >= cb[r];
        ca[r] = e ? 0 : ca[r] - *lo;
        cb[r] = e ? 0 : cb[r] - *lo;
    }
    return seen;
}

/* S[r][c] = -inf where a byte mask hides (row r, column lo + c); within [ca, cb), on the
 * rows with a hidden column there (gap). */
static void mask_bytes(const struct fl_args *a, const long long *t, const struct rows *b, T *s,
                       long long ls, int lo, const int *ca, const int *cb,
                       const unsigned char *gap) {
    if (!t[4] || !t[5]) return;
    for (int r = 0; r < b->nr; ++r) {
        if (!gap[r]) continue;
        const unsigned char *vr = vis_row(a, t, row_head(b, r), row_pos(b, r)) + lo;
        T *row = s + (long long)r * ls;
        for (int c = ca[r]; c < cb[r]; ++c)
            if (!vr[c]) row[c] = -INFINITY;
    }
}

/* -- forward ------------------------------------------------------------------------------ */

/* Keys read in place (decode). With a->kt NULL the forward forms S = Q K_jᵀ from K as it is
 * laid out (no Kᵀ: laying it out would read and write the whole cache once more per call,
 * as much memory traffic as the attention itself when a few rows meet many keys): the
 * item lays out its rows' Qᵀ once, S comes as Sᵀ-columns (nr x w, column-major: B = K_j
 * read along its rows) and is transposed in cache. K and V in a half dtype are widened to
 * T in registers as the dot products and the P V sums read them (each byte of the cache
 * is read once, nothing written back). Only the float builds read keys in place: a
 * decode step with half inputs runs on the float32 build. */
struct keys {
    int on;      /* K read in place (a->kt NULL) */
    TIN *stage;  /* AMX: a 16 x d stage for a ragged row block's Q rows */
    T *vw;       /* float32 build, V in a half dtype with Kᵀ laid out: a tile's V rows widened
                    here (bk x d_v), or NULL */
    T *cm;       /* the item's rows' score maxima, W lanes a row (nr x W), or NULL (AMX) */
    const unsigned int *qt; /* float32 build, `amx_dot`: the item's q16 rows as B operands
                               (amx_dot_pairs), or NULL */
    T *cbuf;                /* and a 32 x 16 stage for Sᵀ's tiles */
    long long qr0;          /* the item's first row (qt's row 0) */
};

/* The lanes' sum, in lane order (a shuffle tree, tried, moved a float64 decode
 * forward's scores a few units in the last place further from the backward's matmul
 * scores, and P = exp(S - λ) on a row that sees one key further from 1). */
static inline T hsum(VT v) {
    T x = 0;
    for (int i = 0; i < W; ++i) x += v[i];
    return x;
}

/* The lane sums of 16 vectors at once, each in lane order (x = ((v[0] + v[1]) + v[2]) + …,
 * as hsum), bit for bit hsum's: the vectors are transposed in registers in groups of
 * LANES (log2(LANES) rounds of two-source shuffles that swap off-diagonal blocks), then
 * added lane-wise in order, a few dozen instructions where 16 hsum calls take hundreds.
 * out[i] = hsum(v[i]). */
#if FL_DOUBLE
#define LANES (VBYTES / 8)
#else
#define LANES (VBYTES / 4)
#endif
#define FL_LO(b, i) (((i) & (b)) == 0 ? (i) : (i) - (b) + LANES)
#define FL_HI(b, i) (((i) & (b)) == 0 ? (i) + (b) : (i) + LANES)
#if LANES == 16
#define FL_MASK(F, b)                                                                        \
    (VI){F(b, 0), F(b, 1), F(b, 2),  F(b, 3),  F(b, 4),  F(b, 5),  F(b, 6),  F(b, 7),       \
         F(b, 8), F(b, 9), F(b, 10), F(b, 11), F(b, 12), F(b, 13), F(b, 14), F(b, 15)}
#elif LANES == 8
#define FL_MASK(F, b) (VI){F(b, 0), F(b, 1), F(b, 2), F(b, 3), F(b, 4), F(b, 5), F(b, 6), F(b, 7)}
#elif LANES == 4
#define FL_MASK(F, b) (VI){F(b, 0), F(b, 1), F(b, 2), F(b, 3)}
#else
#define FL_MASK(F, b) (VI){F(b, 0), F(b, 1)}
#endif
static inline void swap_blocks(VT *v, int b) {
    VI lo, hi;
    switch (b) {
#if LANES >= 16
    case 8: lo = FL_MASK(FL_LO, 8), hi = FL_MASK(FL_HI, 8); break;
#endif
#if LANES >= 8
    case 4: lo = FL_MASK(FL_LO, 4), hi = FL_MASK(FL_HI, 4); break;
#endif
#if LANES >= 4
    case 2: lo = FL_MASK(FL_LO, 2), hi = FL_MASK(FL_HI, 2); break;
#endif
    default: lo = FL_MASK(FL_LO, 1), hi = FL_MASK(FL_HI, 1); break;
    }
    for (int r = 0; r < LANES; ++r)
        if (!(r & b)) {
            VT a = v[r], c = v[r + b];
            v[r] = __builtin_shuffle(a, c, lo);
            v[r + b] = __builtin_shuffle(a, c, hi);
        }
}
static inline __attribute__((always_inline)) void hsum16(const VT *v, T *out) {
    for (int g = 0; g < 16; g += LANES) {
        VT t[LANES];
        for (int i = 0; i < LANES && g + i < 16; ++i) t[i] = v[g + i];
        for (int b = LANES / 2; b >= 1; b /= 2) swap_blocks(t, b); /* t[i][j] = v[g + j][i] */
        VT sum = splat(0) + t[0]; /* 0 + v[0], as hsum starts (a -0 becomes +0) */
        for (int i = 1; i < LANES; ++i) sum += t[i];
        for (int j = 0; j < LANES && g + j < 16; ++j) out[g + j] = sum[j];
    }
}

/* One block of S = alpha · Q K_jᵀ with K read along its rows: RN rows x JN keys, each a
 * dot product over d in vectors (the rows and keys of the block in registers), reduced
 * across the vector at the end; K's elements of type KE read by LOADK (a vector) and
 * ONEK (one: the tail), so that a half cache is widened as it is read, with the same
 * sums in the same order as on K widened first. NAME##_scores runs every row and key. */
#define FL_DOT(NAME, KE, LOADK, ONEK, RN, JN)                                               \
    static void NAME##_##RN##_##JN(const T *q, const KE *k, int d, T alpha, T *s,          \
                                   long long ls) {                                          \
        VT acc[RN][JN], zero = {0};                                                         \
        for (int r = 0; r < RN; ++r)                                                        \
            for (int j = 0; j < JN; ++j) acc[r][j] = zero;                                  \
        int c = 0;                                                                          \
        for (; c + W <= d; c += W) {                                                        \
            VT qv[RN], kv[JN];                                                              \
            for (int r = 0; r < RN; ++r) qv[r] = loadv(q + (long long)r * d + c);           \
            for (int j = 0; j < JN; ++j) kv[j] = LOADK(k + (long long)j * d + c);           \
            for (int r = 0; r < RN; ++r)                                                    \
                for (int j = 0; j < JN; ++j) acc[r][j] += qv[r] * kv[j];                    \
        }                                                                                   \
        T sums[RN * JN];                                                                    \
        if (RN * JN == 16 && LANES <= 16)                                                   \
            hsum16(&acc[0][0], sums);                                                       \
        else                                                                                \
            for (int i = 0; i < RN * JN; ++i) sums[i] = hsum(acc[i / JN][i % JN]);          \
        if (c == d) { /* d in whole vectors: the sums scaled at once, a row's JN stored */  \
            for (int i = 0; i < RN * JN; ++i) sums[i] *= alpha;                             \
            for (int r = 0; r < RN; ++r)                                                    \
                memcpy(s + (long long)r * ls, sums + r * JN, sizeof(T) * JN);               \
            return;                                                                         \
        }                                                                                   \
        for (int r = 0; r < RN; ++r)                                                        \
            for (int j = 0; j < JN; ++j) {                                                  \
                T x = sums[r * JN + j];                                                     \
                for (int e = c; e < d; ++e)                                                 \
                    x += q[(long long)r * d + e] * ONEK(k[(long long)j * d + e]);           \
                s[(long long)r * ls + j] = alpha * x;                                       \
            }                                                                               \
    }
#define FL_DOT_DRIVER(NAME, QE, KE)                                                          \
    static void NAME##_scores(const QE *q, int nr, const KE *k, int w, int d, T alpha, T *s, \
                              long long ls) {                                               \
        int r = 0;                                                                          \
        for (; r + 4 <= nr; r += 4) {                                                       \
            int j = 0;                                                                      \
            for (; j + 4 <= w; j += 4)                                                      \
                NAME##_4_4(q + (long long)r * d, k + (long long)j * d, d, alpha, s + r * ls + j, ls); \
            for (; j < w; ++j)                                                              \
                NAME##_4_1(q + (long long)r * d, k + (long long)j * d, d, alpha, s + r * ls + j, ls); \
        }                                                                                   \
        for (; r < nr; ++r) {                                                               \
            int j = 0;                                                                      \
            for (; j + 4 <= w; j += 4)                                                      \
                NAME##_1_4(q + (long long)r * d, k + (long long)j * d, d, alpha, s + r * ls + j, ls); \
            for (; j < w; ++j)                                                              \
                NAME##_1_1(q + (long long)r * d, k + (long long)j * d, d, alpha, s + r * ls + j, ls); \
        }                                                                                   \
    }
#define FL_DOT_ROWS(NAME, KE, LOADK, ONEK)                                                   \
    FL_DOT(NAME, KE, LOADK, ONEK, 4, 4)                                                     \
    FL_DOT(NAME, KE, LOADK, ONEK, 1, 4)                                                     \
    FL_DOT(NAME, KE, LOADK, ONEK, 4, 1)                                                     \
    FL_DOT(NAME, KE, LOADK, ONEK, 1, 1)                                                     \
    FL_DOT_DRIVER(NAME, T, KE)


/* acc (nr x dv, row stride dv) += P (nr x w, row stride ls) V (w x dv, row stride dv),
 * V's elements of type VE read by LOADV (a half cache widened as it is read): blocks of
 * RN rows x CN vectors of columns in registers, each entry summed over the keys in order;
 * NAME##_rows runs every row and column. */
#define FL_PV(NAME, VE, LOADV, RN, CN)                                                      \
    static void NAME##_##RN##_##CN(const T *p, long long ls, const VE *v, int w,            \
                                   int dv, T *acc, int c) {                                 \
        VT a[RN][CN];                                                                       \
        for (int r = 0; r < RN; ++r)                                                        \
            for (int i = 0; i < CN; ++i) a[r][i] = loadv(acc + (long long)r * dv + c + i * W); \
        for (int j = 0; j < w; ++j) {                                                       \
            VT vv[CN];                                                                      \
            for (int i = 0; i < CN; ++i) vv[i] = LOADV(v + (long long)j * dv + c + i * W);  \
            for (int r = 0; r < RN; ++r) {                                                  \
                VT pr = splat(p[(long long)r * ls + j]);                                    \
                for (int i = 0; i < CN; ++i) a[r][i] += pr * vv[i];                         \
            }                                                                               \
        }                                                                                   \
        for (int r = 0; r < RN; ++r)                                                        \
            for (int i = 0; i < CN; ++i) storev(acc + (long long)r * dv + c + i * W, a[r][i]); \
    }
#define FL_PV_ROWS(NAME, VE, ONEV)                                                           \
    static void NAME##_rows(const T *p, long long ls, int nr, const VE *v, int w,           \
                            int dv, T *acc) {                                               \
        int r = 0, cv = dv / W * W; /* the columns in whole vectors */                      \
        for (; r + 4 <= nr; r += 4) {                                                       \
            const T *pr = p + (long long)r * ls;                                            \
            T *ar = acc + (long long)r * dv;                                                \
            int c = 0;                                                                      \
            for (; c + 4 * W <= dv; c += 4 * W) NAME##_4_4(pr, ls, v, w, dv, ar, c);          \
            for (; c + W <= dv; c += W) NAME##_4_1(pr, ls, v, w, dv, ar, c);                  \
        }                                                                                   \
        for (; r < nr; ++r) {                                                               \
            const T *pr = p + (long long)r * ls;                                            \
            T *ar = acc + (long long)r * dv;                                                \
            int c = 0;                                                                      \
            for (; c + 4 * W <= dv; c += 4 * W) NAME##_1_4(pr, ls, v, w, dv, ar, c);          \
            for (; c + W <= dv; c += W) NAME##_1_1(pr, ls, v, w, dv, ar, c);                  \
        }                                                                                   \
        for (r = 0; r < nr; ++r) /* the columns past the last whole vector */               \
            for (int c = cv; c < dv; ++c) {                                                 \
                T x = acc[(long long)r * dv + c];                                           \
                for (int j = 0; j < w; ++j)                                                 \
                    x += p[(long long)r * ls + j] * ONEV(v[(long long)j * dv + c]);         \
                acc[(long long)r * dv + c] = x;                                             \
            }                                                                               \
    }
#if !FL_HALF
/* S and P V with K and V as they lie (keys in place, decode: a few rows, where a matmul
 * laid out for many rows would run its vectors a few lanes wide, and a BLAS call per tile
 * costs more than its arithmetic): each key is read once, every vector lane busy */
static inline T one_t(T x) { return x; }
FL_DOT_ROWS(dot_t, T, loadv, one_t)
FL_PV(pv_t, T, loadv, 4, 4)
FL_PV(pv_t, T, loadv, 1, 4)
FL_PV(pv_t, T, loadv, 4, 1)
FL_PV(pv_t, T, loadv, 1, 1)
FL_PV_ROWS(pv_t, T, one_t)
#endif

#if !FL_DOUBLE && !FL_HALF
/* A half cache read in place (the float32 build): W bfloat16 or float16 values widened
 * to a float vector in registers (exact), or one of them. */
typedef unsigned short VHU __attribute__((vector_size(VBYTES / 2)));
typedef unsigned int VU32 __attribute__((vector_size(VBYTES)));
typedef _Float16 VF16 __attribute__((vector_size(VBYTES / 2)));
static inline VT load_bf16(const unsigned short *p) {
#if defined(__AVX512F__) && VBYTES == 64
    __m256i h;
    memcpy(&h, p, sizeof h);
    return (VT)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#elif defined(__AVX2__) && VBYTES == 32
    __m128i h;
    memcpy(&h, p, sizeof h);
    return (VT)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
#else /* (GCC 12 splits this widening into halves) */
    VHU h;
    memcpy(&h, p, sizeof h);
    VU32 u = __builtin_convertvector(h, VU32) << 16;
    VT f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}
static inline T one_bf16(unsigned short x) {
    unsigned int u = (unsigned int)x << 16;
    T f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline VT load_f16(const unsigned short *p) {
#if defined(__AVX512F__) && VBYTES == 64
    __m256i h;
    memcpy(&h, p, sizeof h);
    return (VT)_mm512_cvtph_ps(h);
#elif defined(__F16C__) && VBYTES == 32
    __m128i h;
    memcpy(&h, p, sizeof h);
    return (VT)_mm256_cvtph_ps(h);
#else /* (GCC 12 converts a _Float16 vector one lane at a time) */
    VF16 h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, VT);
#endif
}
static inline T one_f16(unsigned short x) {
    _Float16 h;
    memcpy(&h, &x, sizeof h);
    return (T)h;
}

/* n values of a half dtype (half = 1: bfloat16, 2: float16) widened into dst (exact) */
static void widen_n(const unsigned short *src, long long n, T *dst, long long half) {
    long long i = 0;
    if (half == 1) {
        for (; i + W <= n; i += W) storev(dst + i, load_bf16(src + i));
        for (; i < n; ++i) dst[i] = one_bf16(src[i]);
    } else {
        for (; i + W <= n; i += W) storev(dst + i, load_f16(src + i));
        for (; i < n; ++i) dst[i] = one_f16(src[i]);
    }
}

/* Rows [r0, r1) of src (a half dtype, cols values a row) widened and transposed into dst,
 * row r's value c at dst[c · ld + r]: 8 rows (of at most FL_WIDE_COLS columns) at a time
 * widened into a stack buffer, then transposed as transpose_span transposes (the same
 * values: the widening is exact). */
#define FL_WIDE_COLS 256
static void widen_t(const unsigned short *src, long long cols, long long r0, long long r1, T *dst,
                    long long ld, long long half) {
    T buf[8 * FL_WIDE_COLS];
    for (long long c0 = 0; c0 < cols; c0 += FL_WIDE_COLS) {
        long long nc = cols - c0 < FL_WIDE_COLS ? cols - c0 : FL_WIDE_COLS;
        for (long long r = r0; r < r1; r += 8) {
            long long nr = r1 - r < 8 ? r1 - r : 8;
            for (long long i = 0; i < nr; ++i)
                widen_n(src + (r + i) * cols + c0, nc, buf + i * nc, half);
            transpose_span(buf, nc, 0, nr, dst + c0 * ld + r, ld);
        }
    }
}

/* fl_transpose's layout of src in a half dtype (half = 1: bfloat16, 2: float16), widened:
 * Kᵀ as the float32 step's forward reads it, with no float32 copy of K. Work items as
 * fl_transpose's, each a widen_t. */
void SUF(fl_transpose_wide)(const unsigned short *src, T *dst, long long n, long long rows,
                            long long cols, long long ld, long long tile, long long half) {
    long long items;
    struct layout l = layout_of(n, rows, tile, &items);
#pragma omp parallel for schedule(static)
    for (long long w = 0; w < items; ++w) {
        long long b, r0, r1, off = layout_item(&l, w, rows, cols, ld, &b, &r0, &r1);
        widen_t(src + b * rows * cols, cols, r0, r1, dst + off, ld, half);
    }
}

FL_DOT_ROWS(dot_bf16, unsigned short, load_bf16, one_bf16)
#if defined(__AVX512BF16__) && VBYTES == 64
#define FL_BF16_PAIRS 1
/* S with a bfloat16 cache and the call's bfloat16 q rows (a->q16: exactly the float32
 * q's values): AVX512-BF16's pair dot products, 32 elements of d per instruction and no
 * widening (each lane adds its two exact products to its sum, rounding after each, as
 * the instruction defines; its inputs' and sums' subnormals read and written as zero,
 * below any score that moves a softmax); d a multiple of 32. */
#define FL_DOT_PAIRS(RN, JN)                                                                 \
    static void dotp_##RN##_##JN(const unsigned short *q, const unsigned short *k, int d,  \
                                 T alpha, T *s, long long ls) {                             \
        VT acc[RN][JN], zero = {0};                                                         \
        for (int r = 0; r < RN; ++r)                                                        \
            for (int j = 0; j < JN; ++j) acc[r][j] = zero;                                  \
        for (int c = 0; c < d; c += 2 * W) {                                                \
            __m512bh qv[RN], kv[JN];                                                        \
            for (int r = 0; r < RN; ++r) memcpy(&qv[r], q + (long long)r * d + c, 64);      \
            for (int j = 0; j < JN; ++j) memcpy(&kv[j], k + (long long)j * d + c, 64);      \
            for (int r = 0; r < RN; ++r)                                                    \
                for (int j = 0; j < JN; ++j)                                                \
                    acc[r][j] = (VT)_mm512_dpbf16_ps((__m512)acc[r][j], qv[r], kv[j]);      \
        }                                                                                   \
        T sums[RN * JN];                                                                    \
        if (RN * JN == 16)                                                                  \
            hsum16(&acc[0][0], sums);                                                       \
        else                                                                                \
            for (int i = 0; i < RN * JN; ++i) sums[i] = hsum(acc[i / JN][i % JN]);          \
        for (int i = 0; i < RN * JN; ++i) sums[i] *= alpha;                                 \
        for (int r = 0; r < RN; ++r)                                                        \
            memcpy(s + (long long)r * ls, sums + r * JN, sizeof(T) * JN);                   \
    }
FL_DOT_PAIRS(4, 4)
FL_DOT_PAIRS(1, 4)
FL_DOT_PAIRS(4, 1)
FL_DOT_PAIRS(1, 1)
FL_DOT_DRIVER(dotp, unsigned short, unsigned short)
#else
#define FL_BF16_PAIRS 0
#endif
FL_DOT_ROWS(dot_f16, unsigned short, load_f16, one_f16)

FL_PV(pv_bf16, unsigned short, load_bf16, 4, 4)
FL_PV(pv_bf16, unsigned short, load_bf16, 1, 4)
FL_PV(pv_bf16, unsigned short, load_bf16, 4, 1)
FL_PV(pv_bf16, unsigned short, load_bf16, 1, 1)
FL_PV(pv_f16, unsigned short, load_f16, 4, 4)
FL_PV(pv_f16, unsigned short, load_f16, 1, 4)
FL_PV(pv_f16, unsigned short, load_f16, 4, 1)
FL_PV(pv_f16, unsigned short, load_f16, 1, 1)

FL_PV_ROWS(pv_bf16, unsigned short, one_bf16)
FL_PV_ROWS(pv_f16, unsigned short, one_f16)
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && (FL_HALF == 1 || FL_BF16_PAIRS)
#define FL_TILES 1
#include <sys/syscall.h>
#include <unistd.h>
/* AMX (Intel's tile matrix unit, bfloat16): the bfloat16 step's forward products on it,
 * and the float32 build's scores of a bfloat16 cache read in place (amx_dot_scores).
 * Eight tile registers of 16 rows x 64 bytes; _tile_dpbf16ps(C, A, B) adds to C (16 x 16
 * float) A (16 x 32 bfloat16) times B (32 x 16, stored as 16 rows of 16 pairs: B's rows
 * 2i and 2i + 1 interleaved), each lane's pair of exact products summed into it in float.
 * Linux hands a process the tile registers on request. */
int SUF(fl_amx_on)(void) {
    static int state = -1;
    if (state < 0) /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
        state = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return state;
}
struct amx_config {
    unsigned char palette, start;
    unsigned char reserved[14];
    unsigned short colsb[16];
    unsigned char rows[16];
};
static void amx_begin(void) {
    struct amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; ++i) {
        c.rows[i] = 16;
        c.colsb[i] = 64;
    }
    _tile_loadconfig(&c);
}
#else
#define FL_TILES 0
#endif

#if FL_HALF == 1 && FL_TILES
#define FL_AMX 1
/* The bfloat16 step's forward on AMX: K and V are laid out in the pair layout once per
 * pass (fl_pack_amx); Q's rows and P's are A operands as they lie. */
static inline long long amx_keys(long long lk) { return (lk + 31) / 32 * 32; }

/* K (Hk, Lk, d) and V (Hk, Lk, d_v) in the pair layout, keys padded with zeros to a
 * multiple of 32 (L32): kp (Hk, L32 / 16, d / 2, 16, 2), kp[h][j][i][n][e] = K[h][16j +
 * n][2i + e] (a 16-key block's B operands, one per 32 columns of d, 1 KiB each); vp (Hk,
 * L32 / 2, d_v, 2), vp[h][p][c][e] = V[h][2p + e][c] (a 32-key chunk's B operands, 16
 * columns each, row stride 4 d_v bytes). d a multiple of 32, d_v of 16. */
void SUF(fl_pack_amx)(const TIN *k, const TIN *v, TIN *kp, TIN *vp, long long hk, long long lk,
                      long long d, long long dv) {
    long long l32 = amx_keys(lk), nb = l32 / 16;
#pragma omp parallel for schedule(static)
    for (long long w = 0; w < hk * nb; ++w) {
        long long h = w / nb, j = w % nb;
        const unsigned int *kh = (const unsigned int *)(k + h * lk * d); /* key rows, pairs */
        unsigned int *kd = (unsigned int *)(kp + (h * nb + j) * 16 * d);
        for (int n = 0; n < 16; ++n) {
            long long key = 16 * j + n;
            for (long long i = 0; i < d / 2; ++i)
                kd[i * 16 + n] = key < lk ? kh[key * (d / 2) + i] : 0;
        }
        const TIN *vh = v + h * lk * dv;
        unsigned int *vd = (unsigned int *)(vp + h * (l32 / 2) * dv * 2);
        for (long long pr = 8 * j; pr < 8 * j + 8; ++pr) { /* the block's 16 keys, 8 pairs */
            const TIN *v0 = vh + 2 * pr * dv, *v1 = v0 + dv; /* keys 2pr, 2pr + 1 */
            unsigned int *out = vd + pr * dv;
            if (2 * pr + 1 < lk)
                for (long long c = 0; c < dv; ++c) out[c] = v0[c] | (unsigned int)v1[c] << 16;
            else if (2 * pr < lk)
                for (long long c = 0; c < dv; ++c) out[c] = v0[c];
            else
                memset(out, 0, (size_t)dv * sizeof *out);
        }
    }
}

/* S = Q Kᵀ (unscaled) for nr rows (q: row stride d) against the keys [ka, ka + cw) of K/V
 * head kh (ka and cw multiples of 32), into s with row stride ls, key ka at column -off.
 * Blocks of 32 rows (two A operands, tiles 4 and 5; a ragged last 16 through the 16 x d
 * stage, zero-padded; S is written for whole 16-row blocks) by 32 keys (two B operands,
 * tiles 6 and 7; K's 16-key blocks): four products per pair of loads into tiles 0-3, each
 * of K's blocks read once per 32 rows. */
static void amx_scores(const struct fl_args *a, const TIN *q, int nr, long long kh, long long ka,
                       int cw, int off, T *s, long long ls, TIN *stage) {
    int d = (int)a->d;
    const TIN *kb = a->kp + (kh * (amx_keys(a->lk) / 16) + ka / 16) * 16 * d;
    long long st = ls * 4;
    for (int r0 = 0; r0 < nr; r0 += 32) {
        const TIN *q0 = q + (long long)r0 * d, *q1 = q0 + 16 * d;
        int two = nr - r0 > 16; /* a second 16-row block */
        int rag = nr - r0 - (two ? 16 : 0); /* rows of the last block */
        if (rag < 16) {
            memset(stage, 0, (size_t)(16 * d) * sizeof(TIN));
            memcpy(stage, two ? q1 : q0, (size_t)(rag * d) * sizeof(TIN));
            if (two) q1 = stage; else q0 = stage;
        }
        T *s0 = s + (long long)r0 * ls - off, *s1 = s0 + 16 * ls;
        for (int j = 0; j < cw / 16; j += 2) { /* cw / 16 is even */
            const TIN *k0 = kb + (long long)j * 16 * d, *k1 = k0 + 16 * d;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int c = 0; c < d; c += 32) {
                _tile_loadd(4, q0 + c, d * 2);
                _tile_loadd(6, k0 + c * 16, 64);
                _tile_loadd(7, k1 + c * 16, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (two) {
                    _tile_loadd(5, q1 + c, d * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, s0 + j * 16, st);
            _tile_stored(1, s0 + j * 16 + 16, st);
            if (two) {
                _tile_stored(2, s1 + j * 16, st);
                _tile_stored(3, s1 + j * 16 + 16, st);
            }
        }
    }
}

/* acc (rows of d_v, a multiple of 16 of them: nr rounded up) += P V for P (bfloat16, row
 * stride ls, key ka at column -off, cw columns, zero where a row sees no key) against the
 * keys [ka, ka + cw) of K/V head kh. Blocks of 32 rows (P's two 16-row operands, tiles 4
 * and 5) by 32 columns of acc (V's two 16-column operands, tiles 6 and 7; acc's four
 * blocks in tiles 0-3), 32 keys at a time: V read once per 32 rows; d_v a multiple of 16
 * (an odd 16-column block last, alone). */
static void amx_pv(const struct fl_args *a, const TIN *p, long long ls, int nr, long long kh,
                   long long ka, int cw, int off, T *acc) {
    int dv = (int)a->dv;
    const TIN *vb = a->vp + (kh * (amx_keys(a->lk) / 2) + ka / 2) * dv * 2;
    long long sp = ls * 2, sa = dv * 4;
    for (int r0 = 0; r0 < nr; r0 += 32) {
        int two = nr - r0 > 16;
        const TIN *p0 = p + (long long)r0 * ls - off, *p1 = p0 + 16 * ls;
        for (int c0 = 0; c0 < dv; c0 += 32) {
            int pair = dv - c0 >= 32; /* a second 16-column block */
            T *a0 = acc + (long long)r0 * dv + c0, *a1 = a0 + 16 * dv;
            _tile_loadd(0, a0, sa);
            if (pair) _tile_loadd(1, a0 + 16, sa);
            if (two) {
                _tile_loadd(2, a1, sa);
                if (pair) _tile_loadd(3, a1 + 16, sa);
            }
            for (int kc = 0; kc < cw; kc += 32) {
                const TIN *vk = vb + ((long long)(kc / 2) * dv + c0) * 2;
                _tile_loadd(4, p0 + kc, sp);
                _tile_loadd(6, vk, sa);
                _tile_dpbf16ps(0, 4, 6);
                if (pair) {
                    _tile_loadd(7, vk + 32, sa);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (two) {
                    _tile_loadd(5, p1 + kc, sp);
                    _tile_dpbf16ps(2, 5, 6);
                    if (pair) _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, a0, sa);
            if (pair) _tile_stored(1, a0 + 16, sa);
            if (two) {
                _tile_stored(2, a1, sa);
                if (pair) _tile_stored(3, a1 + 16, sa);
            }
        }
    }
}
#else
#define FL_AMX 0
#if !FL_TILES
int SUF(fl_amx_on)(void) { return 0; }
#endif
void SUF(fl_pack_amx)(const TIN *k, const TIN *v, TIN *kp, TIN *vp, long long hk, long long lk,
                      long long d, long long dv) {
    (void)k, (void)v, (void)kp, (void)vp, (void)hk, (void)lk, (void)d, (void)dv;
}
#endif

#if FL_TILES && !FL_HALF
#define FL_AMX_DOT 1
/* A bfloat16 cache read in place (decode), on AMX (the float32 build): Sᵀ = K Qᵀ, K's
 * rows A operands as they lie (16 keys x 32 of d, no layout of the cache), Q's rows B
 * operands in the pair layout, laid out once per work item. */

/* qt: nr rows of q (bfloat16, row stride d) as B operands: per 16 rows (the last zero-
 * padded), d / 32 blocks of 16 x 16 pairs, qt[g][c][i][n] = (q[16g + n][32c + 2i],
 * q[16g + n][32c + 2i + 1]). d a multiple of 32. */
static void amx_dot_pairs(const unsigned short *q, int nr, int d, unsigned int *qt) {
    int groups = (nr + 15) / 16;
    memset(qt, 0, (size_t)groups * 16 * d * sizeof(unsigned short)); /* the padding rows */
    for (int r = 0; r < nr; ++r) {
        const unsigned short *qr = q + (long long)r * d;
        unsigned int *b = qt + (long long)(r / 16) * 8 * d + r % 16; /* 16 x d / 2 a group */
        for (int p = 0; p < d / 2; ++p) /* pair p: block p / 16, its row p % 16 */
            memcpy(b + p * 16, qr + 2 * p, 4);
    }
}

/* S = alpha · Q K_jᵀ for nr rows (qt: their B operands; q: the rows, for the tail) against
 * w keys of K read in place (k: row stride d), into s (row stride ls): 32 keys at a time,
 * two C tiles (Sᵀ, 16 keys x 16 rows each) summed over d in blocks of 32 and stored in
 * cbuf (32 x 16), then written scaled into S's rows; the last w % 32 keys on the pair dot
 * products. Each score a sum of exact products in float, as dotp's (another order). */
static void amx_dot_scores(const unsigned short *q, const unsigned int *qt, int nr,
                           const unsigned short *k, int w, int d, T alpha, T *s, long long ls,
                           T *cbuf) {
    int blocks = d / 32, whole = w / 32 * 32;
    if (whole) {
        amx_begin();
        for (int g = 0; 16 * g < nr; ++g) {
            int ng = nr - 16 * g < 16 ? nr - 16 * g : 16;
            const unsigned int *qg = qt + (long long)g * blocks * 256;
            T *sg = s + 16LL * g * ls;
            for (int j = 0; j < whole; j += 32) {
                const unsigned short *k0 = k + (long long)j * d, *k1 = k0 + 16LL * d;
                _tile_zero(0);
                _tile_zero(1);
                for (int c = 0; c < blocks; ++c) {
                    _tile_loadd(4, qg + c * 256, 64);
                    _tile_loadd(6, k0 + 32 * c, d * 2);
                    _tile_loadd(7, k1 + 32 * c, d * 2);
                    _tile_dpbf16ps(0, 6, 4);
                    _tile_dpbf16ps(1, 7, 4);
                }
                _tile_stored(0, cbuf, 64);
                _tile_stored(1, cbuf + 256, 64);
                for (int r = 0; r < ng; ++r) {
                    T *row = sg + (long long)r * ls + j;
                    for (int x = 0; x < 32; ++x) row[x] = alpha * cbuf[x * 16 + r];
                }
            }
        }
        _tile_release();
    }
    if (whole < w)
        dotp_scores(q, nr, k + (long long)whole * d, w - whole, d, alpha, s + whole, ls);
}
#else
#define FL_AMX_DOT 0
#endif

/* The online update of a block of rows (at most FL_PARTIAL_ROWS rows of a partial tile, or
 * any number of a full one) against tile t: m (base-2 units), ℓ, acc (nr x d_v) of the
 * rows; s: nr · ls + nr scratch (ls = padded(nc)); ps: P in the input dtype (nr · ls; s
 * itself in the float builds). Returns the visible dots of a partial tile. */
static long long forward_block(const struct fl_args *a, const long long *t, const struct rows *b,
                               const struct keys *ks, T *m, T *ell, T *acc, T *s, TIN *ps) {
    int nr = b->nr, idv = (int)a->dv, lo = 0, hi = (int)(t[3] - t[2]);
    int ca[FL_PARTIAL_ROWS], cb[FL_PARTIAL_ROWS];
    unsigned char gap[FL_PARTIAL_ROWS];
    long long seen = 0, kh = b->h0 / a->group;
    if (t[4]) {
        seen = row_ranges(a, t, b, ca, cb, gap, &lo, &hi);
        if (lo == hi) return seen; /* nothing visible: m, ℓ and acc stay as they are */
    }
    int w = hi - lo;
    long long ls = padded(w); /* S's (and P's) row stride */
    long long vo = (kh * a->lk + t[2] + lo) * a->dv; /* V_j's first row */
    const TIN *vh;
#if !FL_DOUBLE && !FL_HALF
    if (ks->vw) { /* the tile's V rows, widened from the half dtype (exact) */
        widen_n(a->v16 + vo, (long long)w * a->dv, ks->vw, a->half);
        vh = ks->vw;
    } else
#endif
        vh = a->v + vo;
    int nrs = nr; /* rows of S written */
    T fs = 1;     /* S's factor still to apply (the AMX products are unscaled) */
    int tops = 0; /* 1: each row's maximum is in ks->cm (W lanes a row), from the product */
#if FL_AMX
    /* AMX: the keys [ka, ka + cw) around [k0, k0 + w), 32-aligned, key k0 at column 0 */
    long long k0 = t[2] + lo, ka = k0 / 32 * 32;
    int off = (int)(k0 - ka), cw = (off + w + 31) / 32 * 32;
    if (a->amx) {
        nrs = (nr + 15) / 16 * 16;
        ls = padded(cw);
        amx_scores(a, a->q + row_base(a, b) * a->d, nr, kh, ka, cw, off, s, ls, ks->stage);
        fs = (T)(a->scale * LOG2E); /* applied by the row max, on the columns it reads */
        if (!(fs > 0)) { /* a zero or negative scale: before the mask's -inf, not after */
            for (int r = 0; r < nr; ++r)
                for (int j = 0; j < w; ++j) s[(long long)r * ls + j] *= fs;
            fs = 1;
        }
    } else
#endif
#if !FL_HALF
    long long ko = (kh * a->lk + t[2] + lo) * a->d; /* K_j's first row, keys in place */
    const T *qr = b->q ? b->q : a->q + row_base(a, b) * a->d;
    /* base-2 units on the products, or with a softcap natural ones (softcap_rows converts) */
    T alpha2 = (T)(a->softcap > 0 ? a->scale : a->scale * LOG2E);
#if !FL_DOUBLE
#if FL_BF16_PAIRS
    if (ks->on && a->half == 1 && a->q16 && a->d % (2 * W) == 0) { /* bfloat16 q and cache */
        const unsigned short *q16 = a->q16 + row_base(a, b) * a->d;
#if FL_AMX_DOT
        if (ks->qt && (b->r0 - ks->qr0) % 16 == 0) /* (the item's rows: one block, at qr0) */
            amx_dot_scores(q16, ks->qt + (b->r0 - ks->qr0) / 16 * (a->d / 32) * 256, nr,
                           a->k16 + ko, w, (int)a->d, alpha2, s, ls, ks->cbuf);
        else
#endif
            dotp_scores(q16, nr, a->k16 + ko, w, (int)a->d, alpha2, s, ls);
    } else
#endif
    if (ks->on && a->half == 1) /* a bfloat16 cache, widened as it is read */
        dot_bf16_scores(qr, nr, a->k16 + ko, w, (int)a->d, alpha2, s, ls);
    else if (ks->on && a->half == 2) /* float16 */
        dot_f16_scores(qr, nr, a->k16 + ko, w, (int)a->d, alpha2, s, ls);
    else
#endif
    if (ks->on) /* keys in place: dot products of Q's rows with K_j's */
        dot_t_scores(qr, nr, a->k + ko, w, (int)a->d, alpha2, s, ls);
    else
#endif
    {
        (void)ks;
        if (a->softcap > 0) { /* the scores the backward forms, then capped */
            scores(a, b, t[2] + lo, w, s, ls, a->scale, !a->scale_exact, NULL);
        } else {
            /* a full tile's plain scores: their row maxima come with the product, where
             * the own kernel forms it (no pass over S for them) */
            int plain = !t[4] && !t[8] && !a->alibi && ks->cm;
            if (plain)
                for (int r = 0; r < nr; ++r) storev(ks->cm + (long long)r * W, splat(-INFINITY));
            tops = scores(a, b, t[2] + lo, w, s, ls, a->scale * LOG2E, 0, plain ? ks->cm : NULL);
            if (tops) {
#pragma omp atomic
                ++product_maxima_blocks;
            }
        }
    }
#if !FL_HALF
    if (a->softcap > 0) softcap_rows(nr, w, s, ls, (T)a->softcap, (T)LOG2E, NULL);
#endif
    if (t[8]) add_term(t, b, t[2] + lo, w, s, ls, (T)LOG2E);
#if !FL_HALF
    if (a->alibi) add_alibi(a, b, t[2] + lo, w, s, ls, (T)LOG2E);
#endif
    if (t[4]) mask_bytes(a, t, b, s, ls, lo, ca, cb, gap);
    T *alpha = s + (long long)nrs * ls; /* α per row */
    for (int r = 0; r < nr; ++r) {
        T *row = s + (long long)r * ls;
        int c0r = t[4] ? ca[r] : 0, c1r = t[4] ? cb[r] : w; /* the row's columns */
        T m_old = m[r], top = tops ? lanes_max(ks->cm + (long long)r * W)
                                   : row_max(row + c0r, c1r - c0r, fs);
        T m_new = m_old > top ? m_old : top, m_sub = m_new == -INFINITY ? 0 : m_new;
        alpha[r] = m_old == m_sub ? 1 : exp2s(m_old - m_sub); /* 1: the max did not move */
        TIN *prow = ps + (long long)r * ls;
        T sum = exp_row(row + c0r, prow + c0r, c1r - c0r, m_sub);
        zero_outside(prow, c0r, c1r, w); /* P = 0 where the row cannot see */
        m[r] = m_new;
        ell[r] = sum + alpha[r] * ell[r];
    }
    for (int r = 0; r < nr; ++r) {
        if (alpha[r] == (T)1) continue; /* its max did not move: acc · 1 is acc */
        T *ar = acc + (long long)r * idv;
        for (int c = 0; c < idv; ++c) ar[c] *= alpha[r];
    }
    /* acc (nr x d_v) += P (nr x w) V_j (w x d_v), formed as accᵀ += V_jᵀ Pᵀ */
#if FL_AMX
    if (a->amx) { /* P's columns around [0, w), and the rows past nr, are zeros */
        for (int r = 0; r < nrs; ++r) {
            TIN *prow = ps + (long long)r * ls;
            if (r >= nr) {
                memset(prow - off, 0, (size_t)cw * sizeof(TIN));
                continue;
            }
            if (off) memset(prow - off, 0, (size_t)off * sizeof(TIN));
            if (cw - off > w) memset(prow + w, 0, (size_t)(cw - off - w) * sizeof(TIN));
        }
        amx_pv(a, ps, ls, nr, kh, ka, cw, off, acc);
        return seen;
    }
#endif
#if !FL_DOUBLE && !FL_HALF
    const unsigned short *v16 = a->v16 + (kh * a->lk + t[2] + lo) * a->dv;
    if (ks->on && a->half == 1)
        pv_bf16_rows(ps, ls, nr, v16, w, idv, acc);
    else if (ks->on && a->half == 2)
        pv_f16_rows(ps, ls, nr, v16, w, idv, acc);
    else
#endif
#if !FL_HALF
    if (ks->on)
        pv_t_rows(ps, ls, nr, vh, w, idv, acc);
    else
#endif
        mm(idv, nr, w, 1, vh, idv, ps, 1, ls, 1, acc, idv, NULL);
    return seen;
}

/* One forward work item: rows [r0, r0 + nr) of head (or stacked group) h0 against the
 * tiles [t0, t1) of the schedule, in order; then O = acc / ℓ and λ = m · ln 2 + log ℓ
 * (natural units; an empty row, ℓ = 0, gives O = 0 and λ = -inf, as online.finalize does)
 * into split s's O and λ, and with ml (parts to merge in the pass) the row's final m (base
 * 2) and ℓ into ml (S, H·Lq, 2) for merge_states. The state stays in the thread's
 * scratch: no other item touches these rows, so the items need no barrier between tiles.
 * Scratch: m, ℓ (nr each), acc (nr · d_v), S/P and α (nr · padded(bk) + nr); then in the
 * half builds P in the input dtype (nr · padded(bk), 64-byte aligned). */
static void forward_item(const struct fl_args *a, long long h0, long long r0, int nr, long long t0,
                         long long t1, long long split, T *ml) {
    in_forward = 1; /* the products below run on the forward's back end */
    long long dv = a->dv, bk = 0;
    for (long long ti = t0; ti < t1; ++ti) {
        long long w = a->tiles[ti * FL_TILE + 3] - a->tiles[ti * FL_TILE + 2];
        bk = w > bk ? w : bk;
    }
    T *m = a->work + omp_get_thread_num() * a->work_stride, *ell = m + nr, *acc = ell + nr;
    /* AMX writes whole 16-row blocks, and columns up to 31 before and after a tile's */
    long long nrs = a->amx ? (nr + 15) / 16 * 16 : nr, lb = padded(a->amx ? bk + 64 : bk);
    T *s = acc + nrs * dv + (a->amx ? 32 : 0);
    char *more = (char *)(s + nrs * lb + nrs);
    TIN *ps = FL_HALF ? (TIN *)carve(&more, nrs * lb + 64, sizeof(TIN)) + (a->amx ? 32 : 0)
                      : (TIN *)s;
    /* keys in place (the half builds never read them so) */
    struct keys ks = {!a->kt, NULL, NULL, NULL, NULL, NULL, 0};
#if FL_AMX
    if (a->amx) {
        ks.stage = carve(&more, 16 * a->d, sizeof(TIN));
        amx_begin();
    }
#endif
    struct rows b = {h0, r0, a->stacked ? a->lq : (1LL << 62), nr, NULL};
#if !FL_DOUBLE && !FL_HALF
    if (!a->q) { /* Q's rows only in q16, K's half dtype: widened here (exact) */
        T *qw = carve(&more, nr * a->d, sizeof(T));
        widen_n(a->q16 + row_base(a, &b) * a->d, nr * a->d, qw, a->half);
        b.q = qw;
    }
    if (!ks.on && a->v16) /* V in the half dtype, Kᵀ laid out widened: each tile's V widened */
        ks.vw = carve(&more, bk * dv, sizeof(T));
#endif
#if FL_AMX_DOT
    if (ks.on && a->amx_dot && a->half == 1 && a->q16 && a->d % 32 == 0) {
        unsigned int *qt = carve(&more, (nr + 15) / 16 * 16 * a->d / 2, sizeof(unsigned int));
        amx_dot_pairs(a->q16 + row_base(a, &b) * a->d, nr, (int)a->d, qt);
        ks.qt = qt;
        ks.cbuf = carve(&more, 512, sizeof(T));
        ks.qr0 = r0;
    }
#endif
#if FL_OWN
    if (!ks.on && !a->amx && product_maxima) ks.cm = carve(&more, (long long)nr * W, sizeof(T));
#endif

    for (int r = 0; r < nr; ++r) {
        m[r] = -INFINITY;
        ell[r] = 0;
    }
    memset(acc, 0, (size_t)(nrs * dv) * sizeof(T));
    for (long long ti = t0; ti < t1; ++ti) {
        const long long *t = a->tiles + ti * FL_TILE;
        long long seen = 0;
        /* partial tiles in narrow row blocks; on AMX every tile in blocks of 32 rows, whose S
         * and P stay near (the first- and second-level caches) between the products and
         * the softmax */
        int step = a->amx ? 32 : t[4] ? FL_PARTIAL_ROWS : nr;
        for (int c = 0; c < nr; c += step) {
            struct rows sub = {h0, r0 + c, b.lrows, nr - c < step ? nr - c : step,
                               b.q ? b.q + c * a->d : NULL};
            seen += forward_block(a, t, &sub, &ks, m + c, ell + c, acc + c * dv, s, ps);
        }
        if (seen) {
#pragma omp atomic
            a->seen[ti] += seen;
        }
    }
    long long base = split * a->heads * a->lq + row_base(a, &b);
    T *lse = a->lse + base;
    if (ml)
        for (int r = 0; r < nr; ++r) {
            ml[2 * (base + r)] = m[r];
            ml[2 * (base + r) + 1] = ell[r];
        }
    if (a->mx) /* the largest score of the row, as the loop's max saw it, back in natural units */
        for (int r = 0; r < nr; ++r) a->mx[base + r] = m[r] == -INFINITY ? m[r] : m[r] * (T)LN2;
    int finite = 1;
    for (int r = 0; r < nr; ++r) {
        T l = ell[r], *arow = acc + r * dv;
        int empty = l == 0;
        lse[r] = empty ? -INFINITY : m[r] * (T)LN2 + LOG(l);
        finite &= isfinite(lse[r]);
#if !FL_DOUBLE
        if (a->o16 && a->splits == 1) { /* rounded as PyTorch's conversion rounds */
            unsigned short *orow = a->o16 + (base + r) * dv;
            for (long long c = 0; c < dv; ++c) {
                T x = empty ? 0 : arow[c] / l;
                finite &= isfinite(x);
#if FL_HALF
                orow[c] = to_in(x); /* the build's own half dtype */
#else
                orow[c] = a->half == 1 ? bf16_bits(x) : f16_bits(x);
#endif
            }
            continue;
        }
#endif
        T *orow = a->o + (base + r) * dv;
        for (long long c = 0; c < dv; ++c) {
            orow[c] = empty ? 0 : arow[c] / l;
            finite &= isfinite(orow[c]);
        }
    }
    if (!finite && a->bad && a->splits == 1) { /* (parts: checked once merged, fl_forward) */
#pragma omp atomic write
        *a->bad = 1;
    }
    in_forward = 0;
#if FL_AMX
    if (a->amx) _tile_release();
#endif
}

/* The tiles [*t0, *t1) of part `s` of `n` of a row's tiles [a0, a1): contiguous, as even as
 * the count allows. */
static inline void part_of(long long a0, long long a1, long long s, long long n, long long *t0,
                           long long *t1) {
    long long len = a1 - a0;
    *t0 = a0 + len * s / n;
    *t1 = a0 + len * (s + 1) / n;
}

void SUF(fl_merge_splits)(T *o, T *lse, long long n, long long dv, long long splits);
int SUF(fl_all_finite)(const T *x, long long n);

/* A pass's key splits merged into split 0's O and λ from each part's final state (ml:
 * m in base-2 units and ℓ, per part and row): M = the largest m of the parts that saw a
 * key, w = ℓ · 2^(m - M), O = Σ w O_s / Σ w, λ = M · ln 2 + log Σ w, as one pass over
 * all the row's tiles rescales and finishes (online.merge_partials's rule, with the parts'
 * λ unrounded). The merge from the parts' λ (fl_merge_splits) weighs each part by exp of
 * λ_s's rounding, a few units in the last place of |λ|: at |λ| ~ 1e3 in float32 a
 * relative 1e-4 that differs from part to part, as no pass over the tiles in one part
 * would, and that the backward's rebuilt P (from the merged λ, one constant per row)
 * cannot follow. A row that no part saw keeps O = 0 and λ = -inf. With base2 = 0, m is
 * in natural units (w = ℓ · exp(m - M), λ = M + log Σ w): fl_merge_splits's parts, each
 * its λ with ℓ = 1, by the same body. */
static void merge_states(T *o, T *lse, const T *ml, long long n, long long dv, long long splits,
                         int base2) {
#pragma omp parallel for schedule(static) if (n * splits * dv > (1LL << 16))
    for (long long i = 0; i < n; ++i) {
        T mx = -INFINITY, w[FL_MAX_SPLITS], ell = 0;
        for (long long s = 0; s < splits; ++s) {
            const T *x = ml + 2 * (s * n + i);
            if (x[1] > 0 && x[0] > mx) mx = x[0];
        }
        T *oi = o + i * dv;
        if (mx == -INFINITY) {
            for (long long c = 0; c < dv; ++c) oi[c] = 0;
            lse[i] = -INFINITY;
            continue;
        }
        for (long long s = 0; s < splits; ++s) {
            const T *x = ml + 2 * (s * n + i);
            double d = (double)(x[0] - mx);
            w[s] = x[1] > 0 ? x[1] * (T)(base2 ? exp2(d) : exp(d)) : 0;
            ell += w[s];
        }
        for (long long c = 0; c < dv; ++c) {
            T acc = 0;
            for (long long s = 0; s < splits; ++s) acc += w[s] * o[(s * n + i) * dv + c];
            oi[c] = acc / ell;
        }
        lse[i] = (base2 ? mx * (T)LN2 : mx) + LOG(ell);
    }
}

/* The whole forward pass, one parallel region. Work items are (query tile, split, unit,
 * chunk of `chunk` rows), unit a query head, or with `stacked` a K/V head whose group's
 * rows run on as one block (one query tile covering Lq). Items are handed out as threads
 * free up (a thread slowed by another process does fewer of them), the longest rows
 * first. */
void SUF(fl_forward)(const struct fl_args *a) {
    long long rows = a->rows, units = a->stacked ? a->heads / a->group : a->heads;
    long long *buf = malloc((size_t)(4 * rows + 1) * sizeof(long long));
    if (!buf) return;
    /* the parts' final m and ℓ, for merge_states */
    T *ml = NULL;
    if (a->merge && a->splits > 1) {
        ml = malloc((size_t)(2 * a->splits * a->heads * a->lq) * sizeof(T));
        if (!ml) {
            free(buf);
            return;
        }
    }
    long long *order = buf, *cost = buf + rows, *chunks = cost + rows, *first = chunks + rows;
    for (long long i = 0; i < rows; ++i) {
        order[i] = i;
        cost[i] = 0;
        for (long long t = a->row_start[i]; t < a->row_start[i + 1]; ++t)
            cost[i] += a->tiles[t * FL_TILE + 3] - a->tiles[t * FL_TILE + 2];
    }
    for (long long i = 1; i < rows; ++i) { /* longest rows first (an insertion sort: few) */
        long long x = order[i], j = i;
        for (; j > 0 && cost[order[j - 1]] < cost[x]; --j) order[j] = order[j - 1];
        order[j] = x;
    }
    long long items = 0;
    double flops = 0;
    for (long long n = 0; n < rows; ++n) {
        long long i = order[n], len = a->stacked ? a->group * a->lq : a->bounds[2 * i + 1] - a->bounds[2 * i];
        chunks[n] = (len + a->chunk - 1) / a->chunk;
        first[n] = items;
        items += chunks[n] * a->splits * units;
        flops += 2.0 * (double)(len * units) * (double)cost[i] * (double)(a->d + a->dv);
    }
    first[rows] = items;
    /* a pass of a few microseconds of work runs on this thread alone: waking the team
     * would cost more than it saves */
#pragma omp parallel for schedule(dynamic, 1) if (flops > FL_SERIAL_FLOPS)
    for (long long w = 0; w < items; ++w) {
        long long n = 0;
        while (first[n + 1] <= w) ++n;
        long long i = order[n], x = w - first[n], c = x % chunks[n], rest = x / chunks[n];
        long long unit = rest % units, split = rest / units, t0, t1;
        part_of(a->row_start[i], a->row_start[i + 1], split, a->splits, &t0, &t1);
        long long q0 = a->bounds[2 * i], len = a->stacked ? a->group * a->lq : a->bounds[2 * i + 1] - q0;
        long long r0 = (a->stacked ? 0 : q0) + c * a->chunk;
        long long nr = a->chunk < len - c * a->chunk ? a->chunk : len - c * a->chunk;
        long long h0 = a->stacked ? unit * a->group : unit;
        forward_item(a, h0, r0, (int)nr, t0, t1, split, ml);
    }
    free(buf);
    if (ml) { /* one call where a merge and a check were three more */
        long long n = a->heads * a->lq;
        merge_states(a->o, a->lse, ml, n, a->dv, a->splits, 1);
        free(ml);
        if (a->bad && !(SUF(fl_all_finite)(a->o, n * a->dv) && SUF(fl_all_finite)(a->lse, n)))
            *a->bad = 1;
#if !FL_DOUBLE && !FL_HALF
        if (a->o16) /* a half cache's merged O in its dtype, rounded as PyTorch's conversion */
            for (long long i = 0; i < n * a->dv; ++i)
                a->o16[i] = a->half == 1 ? bf16_bits(a->o[i]) : f16_bits(a->o[i]);
#endif
    }
}

/* The key splits' partial results (O (S, n, d_v), λ (S, n), n = H·Lq rows) merged into
 * split 0's, row by row, by the rule of online.merge_partials (the one merge, here
 * without a tensor operation per step): m = the largest λ, each part weighted by
 * w = exp(λ_s - m) (0 for a part that saw no key), O = Σ w O_s / Σ w, λ = m + log Σ w;
 * a row that no part saw keeps O = 0 and λ = -inf. */
void SUF(fl_merge_splits)(T *o, T *lse, long long n, long long dv, long long splits) {
    T *ml = malloc((size_t)(2 * splits * n) * sizeof(T)); /* each part's (λ, 1), or (-inf, 0) */
    if (!ml) return;
    for (long long i = 0; i < splits * n; ++i) {
        ml[2 * i] = lse[i];
        ml[2 * i + 1] = lse[i] == -INFINITY ? 0 : 1;
    }
    merge_states(o, lse, ml, n, dv, splits, 0); /* λ in natural units: w = exp(λ_s - m) */
    free(ml);
}

/* 1 when none of the n values is NaN or infinite, else 0 (x · 0 is 0 exactly for the
 * finite ones and NaN for the others; the sum stays 0 or turns NaN). */
int SUF(fl_all_finite)(const T *x, long long n) {
    VT acc = splat(0);
    long long i = 0;
    for (; i + W <= n; i += W) acc += loadv(x + i) * splat(0);
    T t = 0;
    for (int j = 0; j < W; ++j) t += acc[j];
    for (; i < n; ++i) t += x[i] * (T)0;
    return t == 0;
}

/* D = rowsum(x ⊙ y) of two (rows x n) arrays (dO and O) into out (rows), the rows in
 * parallel on the step's threads: a row's products summed in W lanes, then the lanes in
 * order. x and y in T, or in the float32 build both in a half dtype (half = 1 bfloat16, 2
 * float16), widened as read (exact). One pass over both, where the tensor form
 * (x * y).sum(-1) writes and reads the product once more (1.1 against 0.2 ms at 4 x 4096
 * rows of 64 float32, 2 threads). */
#if !FL_DOUBLE && !FL_HALF
/* W values (one) at element i of p: T, or with half 1/2 bfloat16/float16 widened */
static inline VT load_as(const void *p, long long i, long long half) {
    const unsigned short *h = (const unsigned short *)p + i;
    return half == 1 ? load_bf16(h) : half == 2 ? load_f16(h) : loadv((const T *)p + i);
}
static inline T one_as(const void *p, long long i, long long half) {
    const unsigned short *h = (const unsigned short *)p + i;
    return half == 1 ? one_bf16(*h) : half == 2 ? one_f16(*h) : ((const T *)p)[i];
}
#else
static inline VT load_as(const void *p, long long i, long long half) {
    (void)half;
    return loadv((const T *)p + i);
}
static inline T one_as(const void *p, long long i, long long half) {
    (void)half;
    return ((const T *)p)[i];
}
#endif
void SUF(fl_row_dots)(const void *x, const void *y, T *out, long long rows, long long n,
                      long long half) {
    size_t es = half ? 2 : sizeof(T);
#pragma omp parallel for schedule(static) if (rows * n > (1LL << 15))
    for (long long r = 0; r < rows; ++r) {
        const char *xr = (const char *)x + r * n * es, *yr = (const char *)y + r * n * es;
        VT acc = splat(0);
        long long c = 0;
        for (; c + W <= n; c += W) acc += load_as(xr, c, half) * load_as(yr, c, half);
        T t = 0;
        for (int j = 0; j < W; ++j) t += acc[j];
        for (; c < n; ++c) t += one_as(xr, c, half) * one_as(yr, c, half);
        out[r] = t;
    }
}

/* -- backward ----------------------------------------------------------------------------- */

/* The gradient of a block of rows (at most FL_PARTIAL_ROWS of a partial tile, or any number
 * of a full one) of head h against tile t: dK_jᵀ, dV_jᵀ (d x bk, d_v x bk, the tile's
 * columns) accumulate in dkt, dvt; dQ in dq (rows of the block, (·, d)). s: 2 · nr ·
 * padded(bk) scratch (S, dP; with a softcap 3, its t after them), in the half builds
 * followed by P and dS in the input dtype (nr · padded(bk) each, 64-byte aligned), in the
 * float builds on the own kernel by Qᵀ and dOᵀ of the block ((d + d_v) · padded(nr), 64-byte
 * aligned). Half inputs on the float32 build (a->dout16): kw, K_j's rows widened from key
 * t[2] on, dw, the block's dO rows widened, b->q its Q rows, b->kt, b->vt the key tile's
 * Kᵀ_j, Vᵀ_j; else kw and dw NULL. Returns the visible dots of a partial tile. */
static long long backward_block(const struct fl_args *a, const long long *t, const struct rows *b,
                                T *dkt, T *dvt, T *dq, T *s, const T *kw, const T *dw) {
    int nr = b->nr, id = (int)a->d, idv = (int)a->dv, nc = (int)(t[3] - t[2]), lo = 0, hi = nc;
    int ca[FL_PARTIAL_ROWS], cb[FL_PARTIAL_ROWS];
    unsigned char gap[FL_PARTIAL_ROWS];
    long long seen = 0;
    (void)kw;
    (void)dw;
    if (t[4]) {
        seen = row_ranges(a, t, b, ca, cb, gap, &lo, &hi);
        if (lo == hi) return seen; /* every P is 0: no contribution */
    }
    int w = hi - lo;
    long long ls = padded(w), lt, ldt = padded(nc); /* row strides (lt: vt's, below) */
    T *dp = s + (long long)nr * ls;
    /* past S and dP (and a softcap's t): the half builds' P and dS, the float builds' Qᵀ, dOᵀ */
    char *more = (char *)(dp + (long long)(FL_HALF || !(a->softcap > 0) ? 1 : 2) * nr * ls);
    TIN *ps = FL_HALF ? carve(&more, (long long)nr * ls, sizeof(TIN)) : (TIN *)s;   /* P */
    TIN *dss = FL_HALF ? carve(&more, (long long)nr * ls, sizeof(TIN)) : (TIN *)dp; /* dS */
    /* the scores the forward formed, in its base-2 units, by the same calls (forward_block):
     * scale · log2 e on the matmul, or with a softcap the natural scores capped and then
     * converted; the terms added times log2 e. P = 2^(S - λ log2 e) is then the forward's
     * P over one row's keys but for one factor per row (λ log2 e's rounding), which dS's
     * D cancels; scores formed in other units would round each key apart (see the header) */
    in_scores = scores_own; /* S and dP (below) on the own kernel, where so chosen */
    long long base = row_base(a, b);
    const TIN *kh;
#if !FL_HALF
    if (kw)
        kh = kw + (long long)lo * a->d; /* K_j's rows widened by the item, key t[2] first */
    else
#endif
        kh = a->k + ((b->h0 / a->group) * a->lk + t[2] + lo) * a->d;
#if !FL_HALF
    if (a->dot_scores) /* the forward read K in place: its dot products, summed alike */
        dot_t_scores(b->q ? b->q : a->q + base * a->d, nr, kh, w, (int)a->d,
                     (T)(a->softcap > 0 ? a->scale : a->scale * LOG2E), s, ls);
    else
#endif
    if (a->softcap > 0)
        scores(a, b, t[2] + lo, w, s, ls, a->scale, !a->scale_exact, NULL);
    else
        scores(a, b, t[2] + lo, w, s, ls, a->scale * LOG2E, 0, NULL);
    T *tb = NULL; /* a softcap's t = tanh(s / c), for dS's 1 - t² */
#if !FL_HALF
    if (a->softcap > 0) {
        tb = dp + (long long)nr * ls;
        softcap_rows(nr, w, s, ls, (T)a->softcap, (T)LOG2E, tb);
    }
#endif
    if (t[8]) add_term(t, b, t[2] + lo, w, s, ls, (T)LOG2E);
#if !FL_HALF
    if (a->alibi) add_alibi(a, b, t[2] + lo, w, s, ls, (T)LOG2E);
#endif
    if (t[4]) mask_bytes(a, t, b, s, ls, lo, ca, cb, gap);
    const TIN *doh, *qh, *vt = b->vt + (t[2] + lo - b->k0); /* the item's Vᵀ_j */
    lt = b->ld;
#if !FL_HALF
    if (dw) { /* rows widened from a half dtype by the item */
        doh = dw;
        qh = b->q;
    } else
#endif
    {
        doh = a->dout + base * a->dv;
        qh = a->q + base * a->d;
    }
    T sc = (T)a->scale;
    /* dP (nr x w) = dO V_jᵀ */
    mm(w, nr, idv, 1, vt, lt, doh, 1, idv, 0, dp, ls, NULL);
    in_scores = 0;
    const T *lam = a->lam + base, *dd = a->dd + base;
    for (int r = 0; r < nr; ++r) {
        const T *pr = s + (long long)r * ls, *dr = dp + (long long)r * ls;
        TIN *po = ps + (long long)r * ls, *so = dss + (long long)r * ls; /* P, dS (rounded) */
        T lam2 = lam[r] * (T)LOG2E; /* λ in base-2 units: one rounding, the row's alone */
        VT sh = splat(lam2), dv_ = splat(dd[r]);
        int c0 = t[4] ? ca[r] : 0, c1 = t[4] ? cb[r] : w, j = c0;
        zero_outside(po, c0, c1, w); /* P = dS = 0 where the row cannot see */
        zero_outside(so, c0, c1, w);
        const T *tr = tb ? tb + (long long)r * ls : NULL;
        /* dS of the final scores goes to the tile's ds (the gradient of its term: a
         * score_mod's captured tensors, a bias), before a softcap's derivative */
        T *dsr = NULL;
#if !FL_HALF
        if (t[9]) dsr = (T *)(size_t)t[9] + ds_at(t, b, r, t[2] + lo);
#endif
        for (; j + W <= c1; j += W) { /* dS from P before its rounding */
            VT p = vexp2(loadv(pr + j) - sh), ds = p * (loadv(dr + j) - dv_);
            if (dsr) storev(dsr + j, ds);
            if (tr) { /* through the softcap: dS · (1 - t²) (the scale rides on the matmuls) */
                VT tt = loadv(tr + j);
                ds = ds * (splat(1) - tt * tt);
            }
            store_in(po + j, p);
            store_in(so + j, ds);
        }
        for (; j < c1; ++j) {
            T p = exp2s(pr[j] - lam2), ds = p * (dr[j] - dd[r]);
            if (dsr) dsr[j] = ds;
            if (tr) ds = ds * (1 - tr[j] * tr[j]);
            po[j] = to_in(p);
            so[j] = to_in(ds);
        }
    }
    /* dV_jᵀ (d_v x w) += dOᵀ P;  dK_jᵀ (d x w) += scale Qᵀ dS;  dQ (nr x d) += scale dS K_j */
    /* B of the first two: dO and Q, row r at r · d_v and r · d (column stride 1), or their
     * transposes (row r at r, column stride sbn) */
    const TIN *dob = doh, *qb = qh;
    long long dsk = idv, qsk = id, sbn = 1;
#if FL_OWN
    if (use_own && nr > 1) {
        /* the own kernel broadcasts B(kk, j) along kk: read down dO's and Q's columns, each
         * kk a new cache line of which one block uses 6 values; transposed, each column is a
         * stream of whole lines. A copy per block (nr x (d + d_v), against the block's
         * 10 · nr · w · d flops); the sums are the same products in the same order. dV_jᵀ's
         * product ran at 83 % of the register FMA peak instead of 64 (512 x 512 tile,
         * float32, one thread, AMD EPYC family 25 model 1), float64 at 75 % instead of 63;
         * a float32 backward pass at L = 4096 (2 threads, interleaved with the copy off) in
         * 1.02, 0.89 and 0.95 x the time in three runs, float64 in 0.99. */
        sbn = padded(nr);
        T *qt = (T *)carve(&more, (id + idv) * sbn + W, sizeof(T)), *dot = qt + id * sbn;
        transpose_span(qh, id, 0, nr, qt, sbn); /* Qᵀ, dOᵀ: (d x nr), (d_v x nr) */
        transpose_span(doh, idv, 0, nr, dot, sbn);
        qb = qt;
        dob = dot;
        dsk = qsk = 1;
    }
#endif
    mm(w, idv, nr, 1, ps, ls, dob, dsk, sbn, 1, dvt + lo, ldt, NULL);
    mm(w, id, nr, sc, dss, ls, qb, qsk, sbn, 1, dkt + lo, ldt, NULL);
    mm(id, nr, w, sc, kh, id, dss, 1, ls, 1, dq, id, NULL);
    return seen;
}

#if !FL_DOUBLE
/* x (n x nc, row stride ldx: a key tile's dK_jᵀ or dV_jᵀ) transposed into out (nc x n) in a
 * half dtype (the half builds': theirs; the float32 build's: half, 1 bfloat16, 2 float16),
 * rounded to nearest even as PyTorch's conversion rounds (a value past the dtype's range
 * becomes inf, which the caller's check of the gradients names). */
static void half_rows(const T *x, long long ldx, long long nc, long long n, unsigned short *out,
                      long long half) {
    (void)half;
    for (long long c = 0; c < nc; ++c)
        for (long long e = 0; e < n; ++e) {
#if FL_HALF
            out[c * n + e] = to_in(x[e * ldx + c]);
#else
            out[c * n + e] = half == 1 ? bf16_bits(x[e * ldx + c]) : f16_bits(x[e * ldx + c]);
#endif
        }
}
#endif

/* One backward work item: K/V head kh against the key tiles of rows (key tiles) [j0, j1):
 * for each, dK_j and dV_j accumulate over every query tile and every query head of the
 * group in the thread's scratch, then go to rows [k0, k1) of dK, dV; dQ accumulates in
 * split s's part. No other item writes these dK/dV rows or this part's dQ rows. */
static void backward_item(const struct fl_args *a, long long kh, long long j0, long long j1,
                          long long split) {
    long long id = a->d, idv = a->dv, G = a->group;
    T *dq = a->dq + split * a->heads * a->lq * id;
    for (long long j = j0; j < j1; ++j) {
        long long ta = a->row_start[j], tb = a->row_start[j + 1];
        long long k0 = a->bounds[2 * j], nc = a->bounds[2 * j + 1] - k0;
        long long ko = (kh * a->lk + k0) * id, vo = (kh * a->lk + k0) * idv;
        if (ta == tb) { /* a key tile no query sees: dK_j = dV_j = 0, no scratch needed */
#if !FL_DOUBLE
            if (a->dk16) { /* zero's bits are 0 in every half dtype */
                memset(a->dk16 + ko, 0, (size_t)(nc * id) * sizeof(unsigned short));
                memset(a->dv16 + vo, 0, (size_t)(nc * idv) * sizeof(unsigned short));
                continue;
            }
#endif
            memset(a->dk + ko, 0, (size_t)(nc * id) * sizeof(T));
            memset(a->dvo + vo, 0, (size_t)(nc * idv) * sizeof(T));
            continue;
        }
        const long long *t;
        /* scratch: dK_jᵀ, dV_jᵀ of the key tile (its width: some tile of this row runs, so
         * the pass's widest run tile bounds it), then P and dP/dS */
        long long ldt = padded(nc); /* dK_jᵀ, dV_jᵀ row stride */
        T *dkt = a->work + omp_get_thread_num() * a->work_stride, *dvt = dkt + id * ldt;
        T *s = dvt + idv * ldt;
        memset(dkt, 0, (size_t)((id + idv) * ldt) * sizeof(T));
        /* Kᵀ_j and Vᵀ_j laid out by the item (no Kᵀ, Vᵀ of the whole sequence), once per
         * key tile, at the end of the thread's scratch (the caller sized
         * it); with half inputs on the float32 build (dout16) widened as they are laid out,
         * and K_j's rows widened too, a block's Q and dO rows per block (below): no float32
         * copy of Q, K, V or dO */
        T *kw = NULL, *end = dkt + a->work_stride;
#if !FL_DOUBLE && !FL_HALF
        if (a->dout16) {
            kw = end - nc * id;
            end = kw;
        }
#endif
        TIN *ktw = (TIN *)end - (id + idv) * ldt, *vtw = ktw + id * ldt;
#if !FL_DOUBLE && !FL_HALF
        if (kw) {
            widen_n(a->k16 + ko, nc * id, kw, a->half);
            widen_t(a->k16 + ko, id, 0, nc, ktw, ldt, a->half);
            widen_t(a->v16 + vo, idv, 0, nc, vtw, ldt, a->half);
        } else
#endif
        {
            transpose_span(a->k + ko, id, 0, nc, ktw, ldt);
            transpose_span(a->v + vo, idv, 0, nc, vtw, ldt);
        }
        for (long long ti = ta; ti < tb; ++ti) {
            t = a->tiles + ti * FL_TILE;
            long long q0 = t[0], nrows = t[1] - t[0], seen = 0;
            const T *krow = kw ? kw + (t[2] - k0) * id : NULL; /* key t[2]'s row of K_j */
            for (long long g = 0; g < G; ++g) {
                long long h = kh * G + g;
                int step = t[4] ? FL_PARTIAL_ROWS : (int)nrows;
                for (long long c = 0; c < nrows; c += step) {
                    int nr = (int)(nrows - c < step ? nrows - c : step);
                    struct rows b = {h, q0 + c, 1LL << 62, nr, NULL, ktw, vtw, k0, ldt};
                    T *dw = NULL;
#if !FL_DOUBLE && !FL_HALF
                    if (kw) { /* Q's and dO's rows of the block */
                        long long at = h * a->lq + q0 + c;
                        T *qw = (T *)ktw - (long long)b.nr * (id + idv);
                        dw = qw + (long long)b.nr * id;
                        widen_n(a->q16 + at * id, b.nr * id, qw, a->half);
                        widen_n(a->dout16 + at * idv, b.nr * idv, dw, a->half);
                        b.q = qw;
                    }
#endif
                    seen += backward_block(a, t, &b, dkt, dvt, dq + (h * a->lq + q0 + c) * id, s,
                                           krow, dw);
                }
            }
            if (seen) {
#pragma omp atomic
                a->seen[ti] += seen;
            }
        }
#if !FL_DOUBLE
        if (a->dk16) { /* in the half dtype: no float32 dK, dV and no conversion after */
            half_rows(dkt, ldt, nc, id, a->dk16 + ko, a->half);
            half_rows(dvt, ldt, nc, idv, a->dv16 + vo, a->half);
            continue;
        }
#endif
        T *dk = a->dk + ko, *dv = a->dvo + vo;
        for (long long c = 0; c < nc; ++c) {
            for (long long e = 0; e < id; ++e) dk[c * id + e] = dkt[e * ldt + c];
            for (long long e = 0; e < idv; ++e) dv[c * idv + e] = dvt[e * ldt + c];
        }
    }
}

/* The whole backward pass, one parallel region. Work items are (K/V head, split of the key
 * tiles), handed out as threads free up; with more than one split each keeps its dQ in a
 * part of its own (a->dq + s · H·Lq·d, zeroed by the caller), added up in split order
 * after the items, so the result does not depend on which thread ran what. A key tile no
 * query sees gets dK_j = dV_j = 0. */
void SUF(fl_backward)(const struct fl_args *a) {
    long long hk = a->heads / a->group, S = a->splits, items = hk * S;
    long long n = a->heads * a->lq * a->d;
#pragma omp parallel
    {
#pragma omp for schedule(dynamic, 1)
        for (long long w = 0; w < items; ++w) {
            long long s = w / hk, kh = w % hk, j0, j1;
            part_of(0, a->rows, s, S, &j0, &j1);
            backward_item(a, kh, j0, j1, s);
        }
        if (S > 1) {
#pragma omp for schedule(static)
            for (long long e = 0; e < n; ++e) {
                T x = a->dq[e];
                for (long long s = 1; s < S; ++s) x += a->dq[s * n + e];
                a->dq[e] = x;
            }
        }
    }
}

/* -- the machine's peak ---------------------------------------------------------------- */
#if !FL_HALF

/* Fused multiply-adds on registers only, every thread, `reps` x 1024 rounds of 12
 * independent vector chains (enough to cover the FMA latency on every port): the rate no
 * kernel can beat. Returns a value depending on the results, so nothing is optimised
 * away (without -ffast-math the compiler may not fold c·x + y chains). */
double SUF(fl_fma_peak)(long long reps) {
    double sink = 0;
#pragma omp parallel reduction(+ : sink)
    {
        VT x = splat((T)1.0000001), y = splat((T)-0.0000001), c[12];
        for (int i = 0; i < 12; ++i) c[i] = splat((T)i);
        for (long long r = 0; r < reps; ++r)
            for (int it = 0; it < 1024; ++it) /* the chains stay in registers: no barrier */
                for (int i = 0; i < 12; ++i) c[i] = c[i] * x + y;
        for (int i = 0; i < 12; ++i) sink += (double)c[i][0];
    }
    return sink;
}

/* FLOPs of one fl_fma_peak rep on one thread */
double SUF(fl_fma_flops_per_rep)(void) { return 1024.0 * 12 * 2 * W; }

/* -- a score_mod's table reads: gather, and its gradient's scatter-add ----------------------
 *
 * src[i_0, i_1, ...] with one integer index tensor (int64 or int32) per indexed dim of src,
 * broadcast together to the output's shape (n0, n1, n2, n3): out[p] = src[flat(p)],
 * flat(p) = base + Σ_t wrap(i_t[p]) · stride_t, a negative index wrapped once (i + size),
 * as Python and PyTorch wrap it. No flat index is stored: each output row's indices are
 * read where they lie (strides 0 along the dims an index broadcasts over), a row's flat
 * indices formed in a small buffer. (_gather.py.) */
#define FL_GATHER_DIMS 8
#define FL_GATHER_RUN 512
struct fl_gather {
    long long n[4];                  /* the output's shape (the indices' broadcast), 4 dims */
    long long dims;                  /* index tensors, at most FL_GATHER_DIMS */
    long long base;                  /* the Python ints' part of the flat index */
    const void *idx[FL_GATHER_DIMS]; /* each index tensor's data */
    long long is32[FL_GATHER_DIMS];  /* 1: int32, 0: int64 */
    long long st[FL_GATHER_DIMS][4]; /* its strides along the output's dims, in elements */
    long long size[FL_GATHER_DIMS];  /* the size of the dim of src it indexes */
    long long stride[FL_GATHER_DIMS]; /* that dim's stride in src (or in the gradient) */
};

/* Rows are visited with dim 1 (the heads, over which a position's index typically
 * broadcasts) innermost: visit r is row (i0, i1, i2) = (r / (n1 n2), r % n1, r / n1 % n2),
 * so the heads of one query row read the same index row while it is in cache. Returns the
 * row's offset in the output (n0, n1, n2, n3). */
static inline long long gather_row(const struct fl_gather *g, long long r, long long *i) {
    i[1] = r % g->n[1];
    i[2] = r / g->n[1] % g->n[2];
    i[0] = r / (g->n[1] * g->n[2]);
    return ((i[0] * g->n[1] + i[1]) * g->n[2] + i[2]) * g->n[3];
}

/* The flat indices of row i's elements [j0, j0 + nj) into fl; 1 when one is out of range. */
static int gather_run(const struct fl_gather *g, const long long *i, long long j0, int nj,
                      long long *fl) {
    long long i0 = i[0], i1 = i[1], i2 = i[2];
    long long bad = 0, base = g->base;
    for (int t = 0; t < g->dims; ++t) { /* indices constant along the row first */
        const long long *st = g->st[t];
        if (st[3]) continue;
        long long at = i0 * st[0] + i1 * st[1] + i2 * st[2], size = g->size[t];
        long long v = g->is32[t] ? ((const int *)g->idx[t])[at] : ((const long long *)g->idx[t])[at];
        v += v < 0 ? size : 0;
        bad |= (unsigned long long)v >= (unsigned long long)size;
        base += v * g->stride[t];
    }
    for (int j = 0; j < nj; ++j) fl[j] = base;
    for (int t = 0; t < g->dims; ++t) {
        const long long *st = g->st[t];
        long long s3 = st[3], size = g->size[t], ts = g->stride[t];
        if (!s3) continue;
        long long at = i0 * st[0] + i1 * st[1] + i2 * st[2] + j0 * s3;
        if (s3 == 1 && !g->is32[t]) { /* the common case, contiguous along the row: vectors */
            const long long *p = (const long long *)g->idx[t] + at;
            for (int j = 0; j < nj; ++j) {
                long long v = p[j];
                v += v < 0 ? size : 0;
                bad |= (unsigned long long)v >= (unsigned long long)size;
                fl[j] += v * ts;
            }
        } else if (g->is32[t]) {
            const int *p = (const int *)g->idx[t] + at;
            for (int j = 0; j < nj; ++j) {
                long long v = p[j * s3];
                v += v < 0 ? size : 0;
                bad |= (unsigned long long)v >= (unsigned long long)size;
                fl[j] += v * ts;
            }
        } else {
            const long long *p = (const long long *)g->idx[t] + at;
            for (int j = 0; j < nj; ++j) {
                long long v = p[j * s3];
                v += v < 0 ? size : 0;
                bad |= (unsigned long long)v >= (unsigned long long)size;
                fl[j] += v * ts;
            }
        }
    }
    return bad != 0;
}

/* out (n0 · n1 · n2 · n3, contiguous) = src at the flat indices; returns 1 (out then
 * partly written, src never read out of range) when an index is out of range. */
int SUF(fl_gather)(const T *src, T *out, const struct fl_gather *g) {
    long long rows = g->n[0] * g->n[1] * g->n[2], n3 = g->n[3];
    int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad) if (rows * n3 >= (1 << 16))
    for (long long r = 0; r < rows; ++r) {
        long long fl[FL_GATHER_RUN], i[3], at = gather_row(g, r, i);
        for (long long j0 = 0; j0 < n3 && !bad; j0 += FL_GATHER_RUN) {
            int nj = (int)(n3 - j0 < FL_GATHER_RUN ? n3 - j0 : FL_GATHER_RUN);
            if (gather_run(g, i, j0, nj, fl)) {
                bad = 1;
                break;
            }
            T *o = out + at + j0;
            for (int j = 0; j < nj; ++j) o[j] = src[fl[j]];
        }
    }
    return bad;
}

/* dst (n_dst, zeros or a sum to add to) += grad (the output's shape, contiguous) at the flat
 * indices (strides: dst's). Rows are split among the threads in a fixed order, each summing
 * into a private copy of dst, the copies then added in thread order: the same sums for the
 * same thread count. One thread when dst is large beside the work (the copies would cost
 * more than the sums). Returns 1 when an index is out of range (dst then unspecified). */
int SUF(fl_scatter_add)(T *dst, long long n_dst, const T *grad, const struct fl_gather *g) {
    long long rows = g->n[0] * g->n[1] * g->n[2], n3 = g->n[3];
    int threads = omp_get_max_threads(), bad = 0;
    if (threads > 1 && rows * n3 >= (1 << 16) && n_dst * threads <= rows * n3 / 4) {
        T *priv = calloc((size_t)(n_dst * threads), sizeof(T));
        if (priv) {
#pragma omp parallel num_threads(threads) reduction(| : bad)
            {
                int id = omp_get_thread_num(), nt = omp_get_num_threads();
                T *mine = priv + (long long)id * n_dst;
                long long fl[FL_GATHER_RUN];
                long long r0 = rows * id / nt, r1 = rows * (id + 1) / nt;
                for (long long r = r0; r < r1 && !bad; ++r) {
                    long long i[3], at = gather_row(g, r, i);
                    for (long long j0 = 0; j0 < n3; j0 += FL_GATHER_RUN) {
                        int nj = (int)(n3 - j0 < FL_GATHER_RUN ? n3 - j0 : FL_GATHER_RUN);
                        if (gather_run(g, i, j0, nj, fl)) {
                            bad = 1;
                            break;
                        }
                        const T *gr = grad + at + j0;
                        for (int j = 0; j < nj; ++j) mine[fl[j]] += gr[j];
                    }
                }
#pragma omp barrier
#pragma omp for schedule(static)
                for (long long i = 0; i < n_dst; ++i) {
                    T sum = dst[i];
                    for (int t = 0; t < nt; ++t) sum += priv[(long long)t * n_dst + i];
                    dst[i] = sum;
                }
            }
            free(priv);
            return bad;
        }
    }
    long long fl[FL_GATHER_RUN];
    for (long long r = 0; r < rows; ++r) {
        long long i[3], at = gather_row(g, r, i);
        for (long long j0 = 0; j0 < n3; j0 += FL_GATHER_RUN) {
            int nj = (int)(n3 - j0 < FL_GATHER_RUN ? n3 - j0 : FL_GATHER_RUN);
            if (gather_run(g, i, j0, nj, fl)) return 1;
            const T *gr = grad + at + j0;
            for (int j = 0; j < nj; ++j) dst[fl[j]] += gr[j];
        }
    }
    return 0;
}

/* out = 2^x, n values, as the step's softmax computes it (vexp2; the tail one value at a
 * time through the same code): on its own, for the tests of its accuracy. */
void SUF(fl_exp2)(const T *x, T *out, long long n) {
    long long i = 0;
    for (; i + W <= n; i += W) storev(out + i, vexp2(loadv(x + i)));
    for (; i < n; ++i) out[i] = exp2s(x[i]);
}

/* out = tanh(x), n values, as a softcap computes it (vtanh; the tail one value at a time
 * through the same code): on its own, for the tests of its accuracy. */
void SUF(fl_tanh)(const T *x, T *out, long long n) {
    long long i = 0;
    for (; i + W <= n; i += W) storev(out + i, vtanh(loadv(x + i)));
    for (; i < n; ++i) out[i] = vtanh(splat(x[i]))[0];
}
#else
/* -- the rounding to the input dtype, on its own (tests) ------------------------------------ */

/* dst = src rounded to the input dtype, n values: vectors through store_in, the tail
 * through to_in, as the step rounds P and dS. */
void SUF(fl_round)(const T *src, TIN *dst, long long n) {
    long long i = 0;
    for (; i + W <= n; i += W) store_in(dst + i, loadv(src + i));
    for (; i < n; ++i) dst[i] = to_in(src[i]);
}
#endif
