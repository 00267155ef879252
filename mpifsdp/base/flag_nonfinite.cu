/* The non-finite flag (and the cast that sets it in the same pass): launched by base/kernels.py, used by
   shard/unit.py's gathers. */
extern "C" __global__ void flag_nonfinite(const ELEM* x, int* flag, const long long n, const int token) {
    /* flag[0] = token where x holds a NaN or an Inf (a plain store: any thread that finds one may) */
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        if (!isfinite((ACC)x[i])) { flag[0] = token; return; }
}
extern "C" __global__ void cast_flag_nonfinite(const float* x, ELEM* out, int* flag, const long long n,
                                               const int token) {
    /* out = (ELEM)x; flag[0] = token where out holds a NaN or an Inf. Four elements a thread at a
       time where x and out allow (a 16-byte load, one store of four), the last < 4 one at a time */
    const long long stride = (long long)blockDim.x * gridDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long rest = 0;
    bool bad = false;
    if (packs_fit(x) && ((size_t)out & (4 * sizeof(ELEM) - 1)) == 0) {
        rest = n / 4 * 4;
        for (long long q = first; q < n / 4; q += stride) {
            const float4 v = ((const float4*)x)[q];
            const float in[4] = {v.x, v.y, v.z, v.w};
            Pack<4> o;
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                o.v[e] = (ELEM)in[e];
                bad |= !isfinite((ACC)o.v[e]);
            }
            *(Pack<4>*)(out + 4 * q) = o;
        }
    }
    for (long long i = rest + first; i < n; i += stride) {
        const ELEM v = (ELEM)x[i];
        out[i] = v;
        bad |= !isfinite((ACC)v);
    }
    if (bad) flag[0] = token;
}
