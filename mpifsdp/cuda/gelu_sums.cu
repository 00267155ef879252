/* GELU's backward with its gradient's column sums, and GELU with its bias by rows: launched by
   cuda/kernels.py, which defines A (ACC), GELU_COLUMNS, GELU_PACKS, GELU_SUMS_THREADS,
   GELU_SUMS_AN_SM and the GELU_SIGMOID and GELU_SLOPE macros before it. */
#define ROWS_AHEAD 2
template <int V>
__device__ void gelu_sums_rows(const ELEM* __restrict__ x, const ELEM* __restrict__ bias,
                               ELEM* __restrict__ h, ELEM* __restrict__ gh, ACC* __restrict__ mine,
                               const int first, const int last, const int C, const int flags) {
    /* rows first..last-1: h, gh, and mine[j] = the sum of gh's column j over them, in row order */
    typedef Pack<V> P;
    for (int j = threadIdx.x * V; j < C; j += blockDim.x * V) {
        A b[V];
        ACC sum[V];
        const P bias_pack = (flags & GELU_BIAS) ? *(const P*)(bias + j) : P();
        #pragma unroll
        for (int k = 0; k < V; ++k) {
            b[k] = (flags & GELU_BIAS) ? (A)bias_pack.v[k] : (A)0;
            sum[k] = 0;
        }
        for (int r = first; r < last; r += ROWS_AHEAD) {
            const int rows = min(ROWS_AHEAD, last - r);
            P xs[ROWS_AHEAD], gs[ROWS_AHEAD];
            #pragma unroll
            for (int u = 0; u < ROWS_AHEAD; ++u) {
                if (u < rows) {
                    const size_t at = (size_t)(r + u) * C + j;
                    xs[u] = *(const P*)(x + at);
                    gs[u] = *(const P*)(gh + at);
                }
            }
            #pragma unroll
            for (int u = 0; u < ROWS_AHEAD; ++u) {
                if (u < rows) {
                    P hs, os;
                    #pragma unroll
                    for (int k = 0; k < V; ++k) {
                        const A a = (flags & GELU_BIAS) ? (A)(ELEM)((A)xs[u].v[k] + b[k]) : (A)xs[u].v[k];
                        const A s = GELU_SIGMOID(a);
                        hs.v[k] = (ELEM)(a * s);
                        os.v[k] = (ELEM)((A)gs[u].v[k] * GELU_SLOPE(a, s));
                        sum[k] += (ACC)os.v[k];
                    }
                    const size_t at = (size_t)(r + u) * C + j;
                    *(P*)(h + at) = hs;
                    *(P*)(gh + at) = os;
                }
            }
        }
        #pragma unroll
        for (int k = 0; k < V; ++k) mine[j + k] = sum[k];
    }
}
/* registers for GELU_SUMS_AN_SM blocks of GELU_SUMS_THREADS resident an SM (85 a thread for 3 of 256) */
extern "C" __global__ void __launch_bounds__(GELU_SUMS_THREADS, GELU_SUMS_AN_SM)
gelu_and_grad_sums(const ELEM* x, const ELEM* bias, ELEM* h, ELEM* gh, ACC* partial, ACC* sums,
                   unsigned int* done, const int n, const int C, const int rows_per_block,
                   const int flags) {
    /* partial: (gridDim.x, C); done: column_sums_done's counters;
       flags: GELU_BIAS = bias (C) added to x first, rounded to ELEM as cuda/fused.py gelu_array's */
    const int first = blockIdx.x * rows_per_block, last = min(n, first + rows_per_block);
    ACC* mine = partial + (size_t)blockIdx.x * C;
    const bool packed = C % PACK == 0 && packs_fit(x) && packs_fit(h) && packs_fit(gh) &&
                        (!(flags & GELU_BIAS) || packs_fit(bias));
    if (packed) gelu_sums_rows<PACK>(x, bias, h, gh, mine, first, last, C, flags);
    else gelu_sums_rows<1>(x, bias, h, gh, mine, first, last, C, flags);
    if (!column_sums_done(partial, 1, C, done)) return;
    sum_over_groups(partial, sums, C);
}
template <int V, int K>
__device__ void gelu_bias_tile(const ELEM* x, const ELEM* bias, ELEM* y, const int n, const int C) {
    /* Block (i, r) takes columns from i * K * V * blockDim.x of rows r, r + gridDim.y, ...: K packs
       of V columns a thread, V * blockDim.x apart (every load coalesced, all of a row's in flight at
       once), the bias read once a block, no index division. */
    typedef Pack<V> P;
    const int base = (blockIdx.x * K * blockDim.x + threadIdx.x) * V;
    P b[K];
    #pragma unroll
    for (int k = 0; k < K; ++k) {
        const int j = base + k * V * blockDim.x;
        if (j < C) b[k] = *(const P*)(bias + j);
    }
    for (size_t r = blockIdx.y; r < (size_t)n; r += gridDim.y) {
        const ELEM* row = x + r * C;
        ELEM* out = y + r * C;
        P v[K];
        #pragma unroll
        for (int k = 0; k < K; ++k) {
            const int j = base + k * V * blockDim.x;
            if (j < C) v[k] = *(const P*)(row + j);
        }
        #pragma unroll
        for (int k = 0; k < K; ++k) {
            const int j = base + k * V * blockDim.x;
            if (j < C) {
                P o;
                #pragma unroll
                for (int e = 0; e < V; ++e) {
                    const A a = (A)(ELEM)((A)v[k].v[e] + (A)b[k].v[e]);
                    o.v[e] = (ELEM)(a * GELU_SIGMOID(a));
                }
                *(P*)(out + j) = o;
            }
        }
    }
}
extern "C" __global__ void gelu_bias_rows(const ELEM* x, const ELEM* bias, ELEM* y, const int n,
                                          const int C, const int packed) {
    /* y = gelu(x + bias) over n rows of C, x + bias rounded to ELEM first (as the elementwise
       gelu_bias); packed: C a multiple of PACK and every pointer 16-byte aligned (the launcher's
       choice), GELU_PACKS packs of PACK columns a thread, else GELU_COLUMNS columns */
    if (packed) gelu_bias_tile<PACK, GELU_PACKS>(x, bias, y, n, C);
    else gelu_bias_tile<1, GELU_COLUMNS>(x, bias, y, n, C);
}
