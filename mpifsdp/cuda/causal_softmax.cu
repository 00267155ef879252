/* The causal softmax and its backward, a row a block: launched by cuda/kernels.py (ITEMS defined
   there). */
#define NEG_INF (-(ACC)__int_as_float(0x7f800000))
extern "C" __global__ void causal_softmax(ELEM* s, const int T, const ACC scale) {
    const int q = blockIdx.x % T;  /* this row's query position: keys after it are masked */
    ELEM* row = s + (size_t)blockIdx.x * T;
    ACC x[ITEMS];
    ACC m = NEG_INF;
    for (int i = 0; i < ITEMS; ++i) {
        int j = threadIdx.x + i * blockDim.x;
        x[i] = (j < T && j <= q) ? (ACC)row[j] * scale : NEG_INF;
        m = max(m, x[i]);
    }
    m = block_reduce(m, true);
    ACC l = 0;
    for (int i = 0; i < ITEMS; ++i) { x[i] = exp(x[i] - m); l += x[i]; }
    l = block_reduce(l, false);
    for (int i = 0; i < ITEMS; ++i) {
        int j = threadIdx.x + i * blockDim.x;
        if (j < T) row[j] = (ELEM)(x[i] / l);
    }
}
extern "C" __global__ void softmax_backward(ELEM* d, const ELEM* p, const int T, const ACC scale) {
    ELEM* drow = d + (size_t)blockIdx.x * T;
    const ELEM* prow = p + (size_t)blockIdx.x * T;
    ACC dot = 0;
    for (int j = threadIdx.x; j < T; j += blockDim.x) dot += (ACC)drow[j] * (ACC)prow[j];
    dot = block_reduce(dot, false);
    for (int j = threadIdx.x; j < T; j += blockDim.x)
        drow[j] = (ELEM)((ACC)prow[j] * ((ACC)drow[j] - dot) * scale);
}
