/* LayerNorm forward (a warp a row) and backward (column sums in two levels): launched by
   cuda/layer_norm.py. Each row's mean and 1/std are kept in ACC (float for float16 and bfloat16). */
template <int V>
__device__ void finish_row(ELEM* o, ACC* mean, ACC* rstd, ELEM* biased, const ELEM* next_bias,
                           const ACC m, const ACC rs, const int C, const int N, const int flags,
                           const size_t r) {
    /* row r's statistics, its ones column (FWD_ONES_COLUMN) and its row of the next GEMM's bias
       (FWD_NEXT_BIAS) */
    typedef Pack<V> P;
    const int lane = threadIdx.x & 31;
    if (lane == 0) {
        mean[r] = m;  /* the statistics in ACC: float for 16-bit rows, as PyTorch and llm.c keep them */
        rstd[r] = rs;
        if (flags & FWD_ONES_COLUMN) o[C] = (ELEM)1;
    }
    if (flags & FWD_NEXT_BIAS) {
        ELEM* row_of_biased = biased + r * N;
        for (int j = lane * V; j < N; j += 32 * V) *(P*)(row_of_biased + j) = *(const P*)(next_bias + j);
    }
}
template <int V> __device__ __forceinline__ void add_pack(ACC& s, const Pack<V>& p) {
    #pragma unroll
    for (int k = 0; k < V; ++k) s += (ACC)p.v[k];
}
template <int V> __device__ __forceinline__ void add_squares_about(ACC& q, const Pack<V>& p, const ACC m) {
    #pragma unroll
    for (int k = 0; k < V; ++k) {
        const ACC d = (ACC)p.v[k] - m;
        q += d * d;
    }
}
template <int V>
__device__ __forceinline__ void write_normalized(const Pack<V>& p, const int j, const ELEM* w,
                                                 const ELEM* b, const ELEM* seed_bias, ELEM* o,
                                                 ELEM* seeded, const ACC m, const ACC rs,
                                                 const int flags) {
    /* columns j.. of a row: the output ((x - m) rs w (+ b)) and, with FWD_SEED, the seed x + seed_bias */
    typedef Pack<V> P;
    const P wp = *(const P*)(w + j);
    const P bp = (flags & FWD_BIAS) ? *(const P*)(b + j) : P();
    P y;
    #pragma unroll
    for (int k = 0; k < V; ++k) {
        const ACC v = ((ACC)p.v[k] - m) * rs * (ACC)wp.v[k];
        y.v[k] = (ELEM)((flags & FWD_BIAS) ? v + (ACC)bp.v[k] : v);
    }
    *(P*)(o + j) = y;
    if (flags & FWD_SEED) {
        const P sp = *(const P*)(seed_bias + j);
        P sum;
        #pragma unroll
        for (int k = 0; k < V; ++k) sum.v[k] = (ELEM)((ACC)p.v[k] + (ACC)sp.v[k]);
        *(P*)(seeded + j) = sum;
    }
}
template <int V>
__device__ void forward_row(const ELEM* x, const ELEM* w, const ELEM* b, ELEM* out, ACC* mean,
                            ACC* rstd, ELEM* seed, const ELEM* seed_bias, ELEM* biased,
                            const ELEM* next_bias, const int C, const int ld, const int N, const ACC eps,
                            const int flags, const size_t r) {
    /* row r by this warp, V columns a lane at a time (Pack<V>) */
    typedef Pack<V> P;
    const int lane = threadIdx.x & 31;
    const ELEM* row = x + r * C;
    ACC s = 0;
    for (int j = lane * V; j < C; j += 32 * V) add_pack(s, *(const P*)(row + j));
    const ACC m = warp_sum(s) / (ACC)C;
    ACC q = 0;
    for (int j = lane * V; j < C; j += 32 * V) add_squares_about(q, *(const P*)(row + j), m);
    const ACC rs = (ACC)1 / sqrt(warp_sum(q) / (ACC)C + eps);
    ELEM* o = out + r * ld;
    ELEM* seeded = seed + r * C;
    for (int j = lane * V; j < C; j += 32 * V)
        write_normalized(*(const P*)(row + j), j, w, b, seed_bias, o, seeded, m, rs, flags);
    finish_row<V>(o, mean, rstd, biased, next_bias, m, rs, C, N, flags, r);
}
#define ROW_PACKS 8
__device__ void forward_row_held(const ELEM* x, const ELEM* w, const ELEM* b, ELEM* out, ACC* mean,
                                 ACC* rstd, ELEM* seed, const ELEM* seed_bias, ELEM* biased,
                                 const ELEM* next_bias, const int C, const int ld, const int N,
                                 const ACC eps, const int flags, const size_t r) {
    /* forward_row<PACK> for rows of at most 32 * PACK * ROW_PACKS: the row read once, every
       lane's packs loaded at once and held in registers for its three passes */
    typedef Pack<PACK> P;
    const int lane = threadIdx.x & 31;
    const ELEM* row = x + r * C;
    P held[ROW_PACKS];
    #pragma unroll
    for (int i = 0; i < ROW_PACKS; ++i) {
        const int j = (lane + 32 * i) * PACK;
        if (j < C) held[i] = *(const P*)(row + j);
    }
    ACC s = 0;
    #pragma unroll
    for (int i = 0; i < ROW_PACKS; ++i)
        if ((lane + 32 * i) * PACK < C) add_pack(s, held[i]);
    const ACC m = warp_sum(s) / (ACC)C;
    ACC q = 0;
    #pragma unroll
    for (int i = 0; i < ROW_PACKS; ++i)
        if ((lane + 32 * i) * PACK < C) add_squares_about(q, held[i], m);
    const ACC rs = (ACC)1 / sqrt(warp_sum(q) / (ACC)C + eps);
    ELEM* o = out + r * ld;
    ELEM* seeded = seed + r * C;
    #pragma unroll
    for (int i = 0; i < ROW_PACKS; ++i) {
        const int j = (lane + 32 * i) * PACK;
        if (j < C) write_normalized(held[i], j, w, b, seed_bias, o, seeded, m, rs, flags);
    }
    finish_row<PACK>(o, mean, rstd, biased, next_bias, m, rs, C, N, flags, r);
}
extern "C" __global__ void layer_norm_forward(const ELEM* x, const ELEM* w, const ELEM* b, ELEM* out,
                                              ACC* mean, ACC* rstd, ELEM* seed, const ELEM* seed_bias,
                                              ELEM* biased, const ELEM* next_bias, const int C,
                                              const int ld, const int N, const ACC eps, const int flags,
                                              const int n) {
    /* One warp a row (row blockIdx.x * warps a block + this warp, of n): its sums by shuffles
       alone, no block barrier. flags (their bits named by layer_norm.py, defined before this
       source): FWD_BIAS = has a bias; FWD_ONES_COLUMN = out[C] = 1 in every row (out's rows are
       ld apart: the weight gradient's GEMM reads C + 1 columns, giving the next linear's bias
       gradient as one more row); FWD_SEED = seed = x + seed_bias (the residual plus the bias of
       the projection that closes the branch: cuda/fused.py Seed); FWD_NEXT_BIAS = each row of
       biased (N wide) = next_bias (the next GEMM adds to it); FWD_PACKED = in packs (C, ld and N
       multiples of PACK, every pointer 16-byte aligned: the launcher's choice), the row held in
       registers where it fits */
    const size_t r = (size_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= (size_t)n) return;
    if ((flags & FWD_PACKED) && C <= 32 * PACK * ROW_PACKS)
        forward_row_held(x, w, b, out, mean, rstd, seed, seed_bias, biased, next_bias, C, ld, N, eps,
                         flags, r);
    else if (flags & FWD_PACKED)
        forward_row<PACK>(x, w, b, out, mean, rstd, seed, seed_bias, biased, next_bias, C, ld, N, eps,
                          flags, r);
    else
        forward_row<1>(x, w, b, out, mean, rstd, seed, seed_bias, biased, next_bias, C, ld, N, eps,
                       flags, r);
}
#define ROWS_AHEAD 2
template <int V> struct BackwardRows {
    /* ROWS_AHEAD rows' packs of one thread's columns, and their statistics */
    Pack<V> g[ROWS_AHEAD], x[ROWS_AHEAD], add[ROWS_AHEAD];
    ACC m[ROWS_AHEAD], rs[ROWS_AHEAD];
    __device__ void load(const ELEM* g_, const ELEM* x_, const ELEM* add_, const ACC* mean,
                         const ACC* rstd, const int r, const int rows, const int C, const int j,
                         const int flags) {
        #pragma unroll
        for (int u = 0; u < ROWS_AHEAD; ++u) {
            if (u < rows) {
                const size_t at = (size_t)(r + u) * C + j;
                g[u] = *(const Pack<V>*)(g_ + at);
                x[u] = *(const Pack<V>*)(x_ + at);
                if (flags & BWD_ADD) add[u] = *(const Pack<V>*)(add_ + at);
                m[u] = (ACC)mean[r + u];
                rs[u] = (ACC)rstd[r + u];
            }
        }
    }
};
template <int V>
__device__ void backward_packs(const ELEM* __restrict__ g, const ELEM* __restrict__ x,
                               const ELEM* __restrict__ w, const ACC* __restrict__ mean,
                               const ACC* __restrict__ rstd, ELEM* __restrict__ gx,
                               const ELEM* __restrict__ add, ACC* __restrict__ mine, const size_t plane,
                               const int first, const int last, const int C, const int flags) {
    /* blockDim.x * V == C: a thread takes one pack of V columns of every row, ROWS_AHEAD rows at a
       time, the next ROWS_AHEAD rows' loads in flight while it works on these (their barriers
       included), its columns' partial sums in registers, every row's two sums at one exchange
       (block_sums) */
    typedef Pack<V> P;
    const int j = threadIdx.x * V;
    const P wp = *(const P*)(w + j);
    ACC sw[V], sb[V], ss[V];
    #pragma unroll
    for (int k = 0; k < V; ++k) sw[k] = sb[k] = ss[k] = 0;
    BackwardRows<V> now, next;
    now.load(g, x, add, mean, rstd, first, min(ROWS_AHEAD, last - first), C, j, flags);
    for (int r = first; r < last; r += ROWS_AHEAD) {
        const int rows = min(ROWS_AHEAD, last - r);
        const int after = r + ROWS_AHEAD;
        if (after < last) next.load(g, x, add, mean, rstd, after, min(ROWS_AHEAD, last - after), C, j, flags);
        ACC sums[2 * ROWS_AHEAD];
        #pragma unroll
        for (int u = 0; u < ROWS_AHEAD; ++u) {
            ACC sum_gh = 0, sum_ghx = 0;
            if (u < rows) {
                #pragma unroll
                for (int k = 0; k < V; ++k) {
                    const ACC xh = ((ACC)now.x[u].v[k] - now.m[u]) * now.rs[u], gj = (ACC)now.g[u].v[k];
                    const ACC gh = gj * (ACC)wp.v[k];
                    sum_gh += gh;
                    sum_ghx += gh * xh;
                    sw[k] += gj * xh;
                    sb[k] += gj;
                }
            }
            sums[2 * u] = sum_gh;
            sums[2 * u + 1] = sum_ghx;
        }
        block_sums(sums);  /* every thread of the block, rows or not */
        #pragma unroll
        for (int u = 0; u < ROWS_AHEAD; ++u) {
            if (u < rows) {
                const ACC mean_gh = sums[2 * u] / (ACC)C, mean_ghx = sums[2 * u + 1] / (ACC)C;
                P out;
                #pragma unroll
                for (int k = 0; k < V; ++k) {
                    const ACC xh = ((ACC)now.x[u].v[k] - now.m[u]) * now.rs[u];
                    const ACC gh = (ACC)now.g[u].v[k] * (ACC)wp.v[k];
                    const ACC dx = (gh - mean_gh - xh * mean_ghx) * now.rs[u];
                    out.v[k] = (ELEM)((flags & BWD_ADD) ? dx + (ACC)now.add[u].v[k] : dx);
                    ss[k] += (ACC)out.v[k];
                }
                *(P*)(gx + (size_t)(r + u) * C + j) = out;
            }
        }
        now = next;
    }
    #pragma unroll
    for (int k = 0; k < V; ++k) {
        mine[j + k] = sw[k];
        mine[plane + j + k] = sb[k];
        if (flags & BWD_SUMS) mine[2 * plane + j + k] = ss[k];
    }
}
__device__ void backward_columns(const ELEM* g, const ELEM* x, const ELEM* w, const ACC* mean,
                                 const ACC* rstd, ELEM* gx, const ELEM* add, ACC* mine,
                                 const size_t plane, const int first, const int last, const int C,
                                 const int flags) {
    /* any C: threads step through a row's columns, their partial sums in shared memory (2 C ACC, 3 C
       with BWD_SUMS), each row read twice */
    extern __shared__ unsigned char shared_bytes[];
    ACC* gw = (ACC*)shared_bytes;
    ACC* gb = gw + C;
    ACC* gs = gb + C;  /* only with BWD_SUMS */
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
        gw[j] = 0;
        gb[j] = 0;
        if (flags & BWD_SUMS) gs[j] = 0;
    }
    for (int r = first; r < last; ++r) {
        const ELEM* gr = g + (size_t)r * C;
        const ELEM* xr = x + (size_t)r * C;
        const ACC m = (ACC)mean[r], rs = (ACC)rstd[r];
        ACC sums[2] = {0, 0};  /* of gh = g w and gh xhat: dx = rs (gh - mean(gh) - xhat mean(gh xhat)) */
        for (int j = threadIdx.x; j < C; j += blockDim.x) {
            const ACC xh = ((ACC)xr[j] - m) * rs, gj = (ACC)gr[j], gh = gj * (ACC)w[j];
            sums[0] += gh;
            sums[1] += gh * xh;
            gw[j] += gj * xh;
            gb[j] += gj;
        }
        block_sums(sums);
        const ACC mean_gh = sums[0] / (ACC)C, mean_ghx = sums[1] / (ACC)C;
        ELEM* out = gx + (size_t)r * C;
        for (int j = threadIdx.x; j < C; j += blockDim.x) {
            const ACC xh = ((ACC)xr[j] - m) * rs, gh = (ACC)gr[j] * (ACC)w[j];
            const ACC dx = (gh - mean_gh - xh * mean_ghx) * rs;
            const ELEM o = (ELEM)((flags & BWD_ADD) ? dx + (ACC)add[(size_t)r * C + j] : dx);
            out[j] = o;
            if (flags & BWD_SUMS) gs[j] += (ACC)o;
        }
    }
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
        mine[j] = gw[j];
        mine[plane + j] = gb[j];
        if (flags & BWD_SUMS) mine[2 * plane + j] = gs[j];
    }
}
extern "C" __global__ void layer_norm_backward(const ELEM* g, const ELEM* x, const ELEM* w,
                                               const ACC* mean, const ACC* rstd, ELEM* gx,
                                               const ELEM* add, ACC* partial, ACC* dw, ACC* db,
                                               ACC* ds, unsigned int* done, const int n, const int C,
                                               const int rows_per_block, const int flags) {
    /* partial: (3, gridDim.x, C): this block's column sums of g * xhat (for dw), of g (for db) and
       of gx as written (for ds); column_sums_done adds every block's partials, in a fixed order,
       into dw, db and ds (in ACC: parameter gradients are gathered in the arithmetic's
       type, float32 for 16-bit elements, and reduced with no cast). flags: BWD_ADD = gx = dx + add,
       the input's gradient from its other uses (the residual path); BWD_BIAS_GRAD = has a bias
       (db written); BWD_SUMS = ds written; BWD_PACKED = in packs (blockDim.x * PACK == C, every
       row pointer 16-byte aligned: the launcher's choice), else backward_columns with its shared
       memory. done: column_sums_done's counters */
    const int first = blockIdx.x * rows_per_block, last = min(n, first + rows_per_block);
    const size_t plane = (size_t)gridDim.x * C;
    ACC* mine = partial + (size_t)blockIdx.x * C;
    if (flags & BWD_PACKED) backward_packs<PACK>(g, x, w, mean, rstd, gx, add, mine, plane, first, last, C, flags);
    else backward_columns(g, x, w, mean, rstd, gx, add, mine, plane, first, last, C, flags);
    if (!column_sums_done(partial, (flags & BWD_SUMS) ? 3 : 2, C, done)) return;
    sum_over_groups(partial, dw, C);
    if (flags & BWD_BIAS_GRAD) sum_over_groups(partial + plane, db, C);
    if (flags & BWD_SUMS) sum_over_groups(partial + 2 * plane, ds, C);
}
