/* The step's verdict on the device, for a CUDA graph holding the whole step (fsdp/graphed.py):
   launched by cuda/step.py, which defines the state's places (S_*, optim/device_step.py PLACES)
   and the stops (STOP_*). One thread each: a few dozen scalars, read by no host until the step is
   over. */
extern "C" __global__ void verdict_sums(const ACC* sums, const int groups, const bool* refused,
                                        double* reduced) {
    /* reduced[0]: the groups' sums of squares added in order in double, as the host adds them;
       reduced[1]: 1 where a check of this rank's step failed (an input, a gather's cast), else 0.
       Summed over the ranks next: a norm and a count every rank then reads alike. */
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double s = 0;
    for (int k = 0; k < groups; ++k) s += (double)sums[k];
    reduced[0] = s;
    reduced[1] = refused[0] ? 1.0 : 0.0;
}
__device__ void hyper_rows(double* state, ACC* hyper, const int groups, const double factor) {
    /* each group's adamw_groups row at its own step (its step when the state was given, plus the
       steps taken since): what cuda/adamw.py hyperparameters() makes on the host, in double (its
       roundings one by one: no contracted multiply-add; CUDA's pow within 2 ulp of the host's), cast
       to ACC once */
    const double lr = state[S_LR], b1 = state[S_BETA1], b2 = state[S_BETA2];
    for (int k = 0; k < groups; ++k) {
        const double step = state[S_GROUPS + k] + state[S_TAKEN];
        const double bias1 = 1.0 - pow(b1, step), bias2 = sqrt(1.0 - pow(b2, step));
        const double row[9] = {__dsub_rn(1.0, __dmul_rn(lr, state[S_WEIGHT_DECAY])), factor, b1, 1.0 - b1, b2, 1.0 - b2,
                               lr / bias1, bias2, state[S_EPS]};
        for (int j = 0; j < 9; ++j) hyper[9 * k + j] = (ACC)row[j];
    }
}
__device__ bool overflowed(double* state) {
    /* a step whose norm is not finite, as LossScaler.step (scaled) or FlatOptimizer.step decide it:
       skipped and counted, the scale halved; true where the job must stop instead (sticky) */
    if (state[S_SCALED] == 0.0) {
        if (state[S_RAISE] != 0.0) return true;
        state[S_SKIPPED] += 1;
        return false;
    }
    if (state[S_SCALE] <= state[S_MIN_SCALE] || state[S_SKIPS_IN_A_ROW] + 1 >= state[S_MAX_SKIPS])
        return true;
    state[S_SKIPPED] += 1;
    state[S_SKIPS_IN_A_ROW] += 1;
    state[S_GOOD] = 0;
    state[S_SCALE] = fmax(state[S_MIN_SCALE], state[S_SCALE] / 2);
    return false;
}
extern "C" __global__ void step_verdict(const double* reduced, double* state, ACC* hyper, int* skip,
                                        const int groups) {
    /* The verdict of a step whose sums `reduced` holds (over every rank): skip[0] set where the update
       must not run (the capture's dry check, a failed check, a norm not finite), else the factor the
       gradients are scaled by (the loss scale's unscale and the clip) and every group's row; the
       loss scale and the counts moved on as LossScaler and FlatOptimizer move them; a stop noted
       (the host reads it a step late, raises, and replays nothing after it). */
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    skip[0] = 1;
    if (state[S_DRY] != 0.0) return;
    if (reduced[1] != 0.0) { state[S_STOP] = STOP_REFUSED; return; }
    const bool scaled = state[S_SCALED] != 0.0;
    double norm = sqrt(reduced[0]);
    if (scaled) norm = norm / state[S_SCALE];
    state[S_NORM] = norm;
    if (!isfinite(norm)) {
        if (overflowed(state)) state[S_STOP] = scaled ? STOP_SCALE : STOP_NONFINITE;
        return;
    }
    double factor = 1.0;
    if (scaled) { state[S_SKIPS_IN_A_ROW] = 0; factor = 1.0 / state[S_SCALE]; }
    if (state[S_MAX_NORM] > 0.0) factor *= fmin(1.0, state[S_MAX_NORM] / (norm + 1e-6));
    state[S_FACTOR] = factor;
    state[S_TAKEN] += 1;
    hyper_rows(state, hyper, groups, factor);
    if (scaled) {
        state[S_GOOD] += 1;
        if (fmod(state[S_GOOD], state[S_GROWTH]) == 0.0) state[S_SCALE] *= 2;
    }
    skip[0] = 0;
}
