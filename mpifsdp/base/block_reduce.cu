/* What every raw kernel shares, put before its own source by base/kernels.py typed_source (after ELEM and
   ACC): block and warp sums, 16-byte packs, column sums across blocks in one launch; its group
   size is kernels.SUM_GROUP, written in where its placeholder stands. */
#include <cuda_fp16.h>
#include <cuda_bf16.h>
__device__ __forceinline__ ACC block_reduce(ACC v, bool is_max) {
    __shared__ ACC part[32];
    for (int o = 16; o > 0; o >>= 1) {
        ACC w = __shfl_xor_sync(0xffffffff, v, o);
        v = is_max ? max(v, w) : v + w;
    }
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    v = part[0];
    for (int k = 1; k < (int)(blockDim.x >> 5); ++k) v = is_max ? max(v, part[k]) : v + part[k];
    __syncthreads();
    return v;
}
__device__ __forceinline__ ACC warp_sum(ACC v) {
    /* the sum over a warp's 32 lanes, every lane gets it (the same order of additions in each) */
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}
template <int N> __device__ __forceinline__ void block_sums(ACC (&v)[N]) {
    /* the sums of N values a thread over a thread block, every thread gets them all: block_reduce's
       order of additions for each, at one exchange's barriers */
    __shared__ ACC parts[N][32];
    #pragma unroll
    for (int i = 0; i < N; ++i) {
        v[i] = warp_sum(v[i]);
        if ((threadIdx.x & 31) == 0) parts[i][threadIdx.x >> 5] = v[i];
    }
    __syncthreads();
    #pragma unroll
    for (int i = 0; i < N; ++i) {
        v[i] = parts[i][0];
        for (int k = 1; k < (int)(blockDim.x >> 5); ++k) v[i] += parts[i][k];
    }
    __syncthreads();
}
/* PACK elements in one 16-byte load or store (Pack<PACK>), where a row's length and its pointers
   allow (packs_fit); Pack<1>: one element, for any row. A thread that loads several rows' packs
   before using any keeps that many loads in flight (a GPU needs tens of KB in flight an SM). */
constexpr int PACK = 16 / sizeof(ELEM);
template <int V> struct alignas(sizeof(ELEM) * V) Pack { ELEM v[V]; };
__device__ __forceinline__ bool packs_fit(const void* p) { return ((size_t)p & 15) == 0; }
/* Whether this block is the last of `count` to get here, its writes before visible to every block
   after the fence. counter: back at 0 once all `count` came (atomicInc wraps). */
__device__ bool last_to_finish(unsigned int* counter, const unsigned int count) {
    __threadfence();
    __shared__ bool is_last;
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicInc(counter, count - 1) == count - 1;
    __syncthreads();
    return is_last;
}
/* V accumulators from p, read past L1 (other blocks wrote them): one 16-byte load for V > 1 */
template <int V> __device__ __forceinline__ void load_past_l1(const ACC* p, ACC (&v)[V]) {
    if constexpr (V == 1) {
        v[0] = __ldcg(p);
    } else if constexpr (sizeof(ACC) == 4) {
        const float4 t = __ldcg((const float4*)p);
        v[0] = t.x; v[1] = t.y; v[2] = t.z; v[3] = t.w;
    } else {
        const double2 t = __ldcg((const double2*)p);
        v[0] = t.x; v[1] = t.y;
    }
}
/* out[j] = column j of `count` rows of C, `step` rows apart, added in row order, for every column
   (out may be the first row). A thread takes V columns at a time, `ahead` rows' loads in flight
   before it adds them: one block adds a group's partials, so its loads in flight bound its time
   (one column of 16 rows a thread at a time, before: the two adding phases were an estimated
   half of layer_norm_backward's time, bench/HISTORY.md). */
template <int V>
__device__ void add_rows_by(const ACC* rows, ACC* out, const int C, const int count, const int step) {
    constexpr int ahead = 16;
    for (int j = threadIdx.x * V; j < C; j += blockDim.x * V) {
        ACC s[V];
        #pragma unroll
        for (int e = 0; e < V; ++e) s[e] = 0;
        int k = 0;
        for (; k + ahead <= count; k += ahead) {
            ACC loaded[ahead][V];
            #pragma unroll
            for (int u = 0; u < ahead; ++u) load_past_l1<V>(rows + (size_t)(k + u) * step * C + j, loaded[u]);
            #pragma unroll
            for (int u = 0; u < ahead; ++u) {
                #pragma unroll
                for (int e = 0; e < V; ++e) s[e] += loaded[u][e];
            }
        }
        for (; k < count; ++k) {
            ACC loaded[V];
            load_past_l1<V>(rows + (size_t)k * step * C + j, loaded);
            #pragma unroll
            for (int e = 0; e < V; ++e) s[e] += loaded[e];
        }
        #pragma unroll
        for (int e = 0; e < V; ++e) out[j + e] = s[e];
    }
}
__device__ void add_rows(const ACC* rows, ACC* out, const int C, const int count, const int step) {
    constexpr int V = 16 / sizeof(ACC);
    if (C % V == 0 && packs_fit(rows) && packs_fit(out)) add_rows_by<V>(rows, out, C, count, step);
    else add_rows_by<1>(rows, out, C, count, step);
}
/* Column sums across the grid's blocks, in two levels, so that no one block adds them all (one
   block adding 512 blocks' partials was the slowest kernel of the step, ~25 times its traffic's
   time: bench/HISTORY.md). Every block has written its partials: `planes`
   planes of (gridDim.x, C), one after another. Blocks form groups of SUM_GROUP, in block order; the
   last of a group to finish adds its group's rows, in block order, into the group's first row; the
   last group to finish returns true, and then writes the totals with sum_over_groups (the groups'
   rows in group order): the same order of additions whichever block finishes when. done:
   1 + ceil(gridDim.x / SUM_GROUP) counters (column_sum_counters), each back at 0 after a launch. */
#define SUM_GROUP @SUM_GROUP@
__device__ bool column_sums_done(ACC* partial, const int planes, const int C, unsigned int* done) {
    const int group = blockIdx.x / SUM_GROUP, first = group * SUM_GROUP;
    const int members = min(SUM_GROUP, (int)gridDim.x - first);
    if (!last_to_finish(done + 1 + group, members)) return false;
    for (int p = 0; p < planes; ++p) {
        ACC* rows = partial + ((size_t)p * gridDim.x + first) * C;
        add_rows(rows, rows, C, members, 1);
    }
    return last_to_finish(done, (gridDim.x + SUM_GROUP - 1) / SUM_GROUP);
}
__device__ void sum_over_groups(const ACC* plane, ACC* out, const int C) {
    add_rows(plane, out, C, ((int)gridDim.x + SUM_GROUP - 1) / SUM_GROUP, SUM_GROUP);
}
