/* Every group's sum of squares for the step's gradient norm, in two launches: launched by
   cuda/norm.py (PIECE defined there). */
extern "C" __global__ void squares_by_piece(const long long* table, const int vectors, ACC* partial) {
    /* table: the vectors' addresses, their lengths, their first pieces (vectors + 1 of them), then
       their dtype (for the twin: its place in TABLE_DTYPES); block b sums the squares of piece
       b - first[v] of vector v, first[v] <= b < first[v + 1] */
    const long long* lengths = table + vectors;
    const long long* first = table + 2 * vectors;
    int v = 0;
    while (blockIdx.x >= first[v + 1]) ++v;
    const ELEM* x = (const ELEM*)table[v];
    const long long start = (blockIdx.x - first[v]) * (long long)PIECE;
    const long long stop = min(start + (long long)PIECE, lengths[v]);
    ACC s = 0;
    for (long long i = start + threadIdx.x; i < stop; i += blockDim.x) { ACC e = (ACC)x[i]; s += e * e; }
    s = block_reduce(s, false);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
extern "C" __global__ void sum_pieces(const ACC* partial, const long long* table, const int vectors,
                                      ACC* sums) {
    /* sums[v]: vector v's partials added by block v, each thread a fixed stride of them, then
       block_reduce (the same order on every run; one thread a vector added its thousands of
       partials one dependent load at a time, slower: bench/HISTORY.md) */
    const long long* first = table + 2 * vectors;
    const int v = blockIdx.x;
    ACC s = 0;
    for (long long b = first[v] + threadIdx.x; b < first[v + 1]; b += blockDim.x) s += partial[b];
    s = block_reduce(s, false);
    if (threadIdx.x == 0) sums[v] = s;
}
