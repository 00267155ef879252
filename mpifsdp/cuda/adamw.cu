/* AdamW's update of every group in one launch (decay, gradient scale, moments, casts): launched by
   cuda/adamw.py, which defines PIECE and CAST before it. */
struct Hyper {  /* one group's step: adamw_step's scalars, the 9 of a row of adamw_groups' hyper */
    ACC decay, grad_scale, beta1, one_minus_beta1, beta2, one_minus_beta2, lr_over_bias1, bias2, eps;
};
__device__ __forceinline__ void adamw_values(ACC& gi, ACC& pi, ACC& mi, ACC& vi, const int decays,
                                             const Hyper& h) {
    /* one element's step on its loaded values: the gradient scaled (rounded to ELEM, as stored and
       read back), `decays` decoupled decays (one a segment holding it), the moments (rounded when
       stored), the new value from them (rounded to ELEM) */
    if (h.grad_scale != (ACC)1) gi = (ACC)(ELEM)(gi * h.grad_scale);
    for (int d = 0; d < decays; ++d) pi = pi * h.decay;
    mi = mi * h.beta1 + gi * h.one_minus_beta1;
    vi = vi * h.beta2 + (gi * gi) * h.one_minus_beta2;
    pi = (ACC)(ELEM)(pi - mi / (sqrt(vi) / h.bias2 + h.eps) * h.lr_over_bias1);
}
__device__ __forceinline__ void cast_value(CAST* cast, int* flag, const long long i, const ACC pn,
                                           const int token) {
    /* the new value cast to CAST (what the next gather sends), flag[0] = token if that overflows */
    const CAST c = (CAST)pn;
    cast[i] = c;
    if (!isfinite((ACC)c)) flag[0] = token;
}
__device__ __forceinline__ void adamw_at(ELEM* p, ELEM* g, ELEM* m, ELEM* v, const long long i,
                                         const int decays, const Hyper& h, CAST* cast, int* flag,
                                         const int token) {
    /* element i's step, and where cast is given its new value cast */
    ACC gi = (ACC)g[i], pi = (ACC)p[i], mi = (ACC)m[i], vi = (ACC)v[i];
    adamw_values(gi, pi, mi, vi, decays, h);
    if (h.grad_scale != (ACC)1) g[i] = (ELEM)gi;
    p[i] = (ELEM)pi;
    m[i] = (ELEM)mi;
    v[i] = (ELEM)vi;
    if (cast) cast_value(cast, flag, i, pi, token);
}
template <typename T> struct FourAtOnce { static const bool value = false; };
template <> struct FourAtOnce<float> { static const bool value = true; };
__device__ __forceinline__ int decays_at(const long long i, const long long* segments,
                                         const long long first, const long long last) {
    /* how many of the decay segments first..last (start, stop pairs) hold element i */
    int decays = 0;
    for (long long s = first; s < last; ++s) decays += i >= segments[2 * s] && i < segments[2 * s + 1];
    return decays;
}
extern "C" __global__ void adamw_step(ELEM* p, ELEM* g, ELEM* m, ELEM* v, const long long* decay_from,
                                      const long long* decay_to, const int segments, const long long n,
                                      const ACC decay, const ACC grad_scale, const ACC beta1,
                                      const ACC one_minus_beta1, const ACC beta2,
                                      const ACC one_minus_beta2, const ACC lr_over_bias1,
                                      const ACC bias2, const ACC eps) {
    const Hyper h = {decay, grad_scale, beta1, one_minus_beta1, beta2, one_minus_beta2, lr_over_bias1,
                     bias2, eps};
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        int decays = 0;
        for (int k = 0; k < segments; ++k) decays += i >= decay_from[k] && i < decay_to[k];
        adamw_at(p, g, m, v, i, decays, h, (CAST*)0, (int*)0, 0);
    }
}
extern "C" __global__ void adamw_groups(const long long* table, const int groups,
                                        const long long* segments, const ACC* hyper,
                                        const int* tokens, const int* skip) {
    /* Every group's AdamW step in one launch. table: the groups' p, g, m, v addresses, their
       lengths, their first blocks (groups + 1), their first decay segments (groups + 1), their
       casts' and flags' addresses (0: no cast), then the casts' dtype and the groups' (for the
       twin); segments: (start, stop) pairs; hyper: 9 values a group, adamw_step's; tokens: one a
       group, what its flag is set to where its cast overflows; skip: nothing is done where skip[0]
       is set (a whole-step graph's verdict: cuda/step.cu).
       Block b updates piece b - first[k] (PIECE elements) of group k, first[k] <= b < first[k + 1]. */
    const long long* n = table + 4 * groups;
    const long long* first = table + 5 * groups;
    const long long* first_segment = table + 6 * groups + 1;
    const long long* casts = table + 7 * groups + 2;
    if (skip[0]) return;
    int k = 0;
    while (blockIdx.x >= first[k + 1]) ++k;
    ELEM* p = (ELEM*)table[k];
    ELEM* g = (ELEM*)table[groups + k];
    ELEM* m = (ELEM*)table[2 * groups + k];
    ELEM* v = (ELEM*)table[3 * groups + k];
    CAST* cast = (CAST*)casts[k];
    int* flag = (int*)casts[groups + k];
    const ACC* x = hyper + 9 * k;
    const Hyper h = {x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], x[8]};
    const long long start = (blockIdx.x - first[k]) * (long long)PIECE;
    const long long stop = min(start + (long long)PIECE, n[k]);
    const long long s0 = first_segment[k], s1 = first_segment[k + 1];
    long long rest = start;  /* where the one-at-a-time loop begins */
    if (FourAtOnce<ELEM>::value && packs_fit(p) && packs_fit(g) && packs_fit(m) && packs_fit(v)) {
        /* float32 masters: four elements a thread at a time, 16-byte loads and stores (a piece
           starts at a multiple of PIECE, so every quad is aligned); the last < 4 one at a time */
        rest = start + (stop - start) / 4 * 4;
        for (long long q = start + 4 * (long long)threadIdx.x; q < rest; q += 4 * (long long)blockDim.x) {
            const float4 g4 = *(const float4*)(g + q), p4 = *(const float4*)(p + q);
            const float4 m4 = *(const float4*)(m + q), v4 = *(const float4*)(v + q);
            ACC gs[4] = {g4.x, g4.y, g4.z, g4.w}, ps[4] = {p4.x, p4.y, p4.z, p4.w};
            ACC ms[4] = {m4.x, m4.y, m4.z, m4.w}, vs[4] = {v4.x, v4.y, v4.z, v4.w};
            #pragma unroll
            for (int e = 0; e < 4; ++e)
                adamw_values(gs[e], ps[e], ms[e], vs[e], decays_at(q + e, segments, s0, s1), h);
            if (h.grad_scale != (ACC)1) *(float4*)(g + q) = make_float4(gs[0], gs[1], gs[2], gs[3]);
            *(float4*)(p + q) = make_float4(ps[0], ps[1], ps[2], ps[3]);
            *(float4*)(m + q) = make_float4(ms[0], ms[1], ms[2], ms[3]);
            *(float4*)(v + q) = make_float4(vs[0], vs[1], vs[2], vs[3]);
            if (cast) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) cast_value(cast, flag, q + e, ps[e], tokens[k]);
            }
        }
    }
    for (long long i = rest + threadIdx.x; i < stop; i += blockDim.x)
        adamw_at(p, g, m, v, i, decays_at(i, segments, s0, s1), h, cast, flag, tokens[k]);
}
