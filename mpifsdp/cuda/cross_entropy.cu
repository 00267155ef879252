/* Softmax cross-entropy, forward and backward: launched by cuda/cross_entropy.py. */
template <int V>
__device__ void row_max_and_sum(const ELEM* row, const int classes, ACC& m, ACC& s) {
    /* this thread's packs of the row, read once: their max m and sum of exp(x - m), the sum
       rescaled whenever the max grows (online softmax) */
    typedef Pack<V> P;
    m = -(ACC)__int_as_float(0x7f800000);
    s = 0;
    for (int j = threadIdx.x * V; j < classes; j += blockDim.x * V) {
        const P p = *(const P*)(row + j);
        ACC top = (ACC)p.v[0];
        #pragma unroll
        for (int k = 1; k < V; ++k) top = max(top, (ACC)p.v[k]);
        if (top > m) {
            s *= exp(m - top);
            m = top;
        }
        #pragma unroll
        for (int k = 0; k < V; ++k) s += exp((ACC)p.v[k] - m);
    }
}
extern "C" __global__ void cross_entropy_forward(const ELEM* logits, const long long* targets,
                                                 ACC* lse, ACC* loss, const int classes,
                                                 const long long ignore_index, const int packed) {
    /* per row: lse = log sum exp(logits), loss = lse - logits[target] (0 where ignored; NaN for a
       target outside [0, classes), which the caller has refused already). The row read once, in
       16-byte packs where `packed` (classes a multiple of PACK, logits 16-byte aligned: the
       launcher's choice) */
    const ELEM* row = logits + (size_t)blockIdx.x * classes;
    ACC m, s;
    if (packed) row_max_and_sum<PACK>(row, classes, m, s);
    else row_max_and_sum<1>(row, classes, m, s);
    const ACC top = block_reduce(m, true);
    s = block_reduce(m == top ? s : s * exp(m - top), false);  /* an empty thread: s = 0 */
    if (threadIdx.x == 0) {
        const ACC l = top + log(s);
        const long long t = targets[blockIdx.x];
        lse[blockIdx.x] = l;
        if (t == ignore_index) loss[blockIdx.x] = 0;
        else if (t < 0 || t >= classes) loss[blockIdx.x] = (ACC)__int_as_float(0x7fc00000);
        else loss[blockIdx.x] = l - (ACC)row[t];
    }
}
template <int V>
__device__ void gradient_row(const ELEM* row, ELEM* out, const int classes, const long long t,
                             const ACC l, const ACC w) {
    typedef Pack<V> P;
    for (int j = threadIdx.x * V; j < classes; j += blockDim.x * V) {
        const P p = *(const P*)(row + j);
        P d;
        #pragma unroll
        for (int k = 0; k < V; ++k)
            d.v[k] = (ELEM)((exp((ACC)p.v[k] - l) - (j + k == t ? (ACC)1 : (ACC)0)) * w);
        *(P*)(out + j) = d;
    }
}
extern "C" __global__ void cross_entropy_backward(const ELEM* logits, const long long* targets,
                                                  const ACC* lse, const ACC* upstream, ELEM* grad,
                                                  const int classes, const long long ignore_index,
                                                  const double* count, const int packed) {
    /* d loss / d logits = (softmax - one-hot) * upstream / count, 0 on an ignored row; the count
       read on the device (it changes with the batch: a captured launch must not hold it); in
       packs as the forward */
    const size_t r = blockIdx.x;
    const long long t = targets[r];
    const ACC w = (t == ignore_index) ? (ACC)0 : upstream[0] * (ACC)(1.0 / count[0]);
    if (packed) gradient_row<PACK>(logits + r * classes, grad + r * classes, classes, t, lse[r], w);
    else gradient_row<1>(logits + r * classes, grad + r * classes, classes, t, lse[r], w);
}
