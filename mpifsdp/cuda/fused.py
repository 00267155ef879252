"""The transformer's primitives on a GPU: ops/fused.py's and ops/primitives.py's embedding, each
registered for 'cuda' (autodiff/tensor.py's `implement`), its work in one kernel or GEMM where the
reference takes passes, and the fusions only a device that counts launches wants.

The fusions (none changes what is computed): a bias added inside the GELU's kernel (linear_add's
gelu_bias, offered as "gelu_bias"); a block's branch begun in its LayerNorm kernel, which also writes
residual + the closing projection's bias for that projection's GEMM to add into (Seed, offered as
"seed"); a linear's bias folded into its GEMM through a ones column; gradients written into zeroed
parameter gradients (tape.WROTE) in float32 for 16-bit operands; a gradient's column sums (the
producer's bias gradient) formed in the kernel that forms it (tape.SumsWritten), and the residual
stream's pending gradient added there too (tape.Summed). The LayerNorm's output is kept for
backward, not recomputed: a recompute is a launch, and launches bound the step (bench/HISTORY.md,
issue 30). Where a kernel cannot run (another dtype, a refused compile), the reference's passes run
over whole arrays (fused.whole_arrays).
"""

from __future__ import annotations

import numpy as np

from ..autodiff.tape import WROTE, Summed, SumsWritten
from ..autodiff.tensor import implement
from ..base.backend import array_module_of, onto
from ..base.kernels import accumulator, device_address
from ..ops import fused as reference
from ..ops.fused import _rows, check_linear, column_sums, split_ln_linear, whole_arrays, writable
from ..ops.primitives import check_indices
from . import cross_entropy, gemm, kernels, layer_norm


def _bias_is_input_2(settings, inputs: int):
    """A linear's bias: its third input, where it has one (tape.SumsWritten)."""
    return 2 if inputs > 2 else None


# -- GELU -----------------------------------------------------------------------------------------


def gelu_array(x, bias=None):
    """gelu(x (+ bias over x's rows)) in one kernel, the bias added inside it."""
    xp = array_module_of(x)
    out = xp.empty_like(x)
    if bias is not None and x.flags.c_contiguous:
        kernels.gelu_bias_into(out, x, bias)
        return out
    x = x if bias is None else x + bias
    kernels.gelu_into(_rows(out), _rows(x))
    return out


def _gelu_grad(g, x):
    out = array_module_of(x).empty_like(x)
    kernels.gelu_grad_into(_rows(out), _rows(array_module_of(g).ascontiguousarray(g)), _rows(x))
    return out


implement("gelu", "cuda", vjp=lambda g, _, x: (_gelu_grad(g, x),))(lambda x: (gelu_array(x), None))


# -- linear ---------------------------------------------------------------------------------------


def _written_types(dtype) -> tuple:
    """The dtypes a GEMM of `dtype` operands can write a weight gradient in: theirs, and their
    float32 accumulator where they are 16-bit (gemm.widening)."""
    acc = np.dtype(accumulator(dtype.type))
    return (dtype, acc) if gemm.widening(dtype, acc) else (dtype,)


def _weight_grad_into(a, c, target):
    """target = a @ c, in the operands' type or their float32 accumulator (cuBLAS's gemmEx: no
    16-bit temporary, no cast)."""
    if a.dtype == c.dtype and gemm.writes(a.dtype, target.dtype):
        gemm.gemm_into(a, c, target)
    else:
        array_module_of(a).matmul(a, c, out=target)


def _linear_vjp(
    g,
    _,
    x,
    w,
    b=None,
    transpose_w=False,
    gelu_input=False,
    needs=(True,) * 3,
    into=None,
    sums_into=None,
    gelu_bias=None,
):
    """ops/fused.py's linear VJP with the GPU's writes: sums_into[0] (with gelu_input) gets the
    column sums of x's gradient from the kernel that forms it (the MLP's first linear's bias)."""
    g2 = _rows(g)
    gx, gw, gb, g_gelu_bias = None, None, None, None
    h = x
    wants_bias = gelu_bias is not None and needs[3]
    if needs[0] or wants_bias:
        gx = gemm.matmul(g2, w.T if not transpose_w else w).reshape(x.shape)
    if gelu_input and (needs[0] or wants_bias):
        h, gx, g_gelu_bias = _gelu_backward(x, gx, (sums_into or (None,))[0], gelu_bias, into)
    elif gelu_input and needs[1]:
        h = gelu_array(x, gelu_bias)
    if needs[1]:
        h2 = _rows(h)
        a, c = (h2.T, g2) if not transpose_w else (g2.T, h2)
        gw = writable(into, 1, w.shape, *_written_types(g2.dtype))
        if gw is None:
            gw = gemm.matmul(a, c)
        else:
            _weight_grad_into(a, c, gw)
            gw = WROTE
    if b is not None and needs[2]:
        gb = column_sums(g2, writable(into, 2, b.shape, g2.dtype, accumulator(g2.dtype.type)))
    grads = (gx if needs[0] else None, gw) + (() if b is None else (gb,))
    return grads if gelu_bias is None else (*grads, g_gelu_bias if wants_bias else None)


def _gelu_backward(x, gx, sums, bias, into):
    """(gelu(x (+ bias)), gx * gelu'(x (+ bias)), the bias's gradient or None), gx scaled in place,
    in one kernel that also writes the column sums of the result: the bias's gradient (into[4]
    where it is a zeroed parameter gradient) or, with no bias, that of x's producer's (`sums`,
    tape.SumsWritten: the result is returned wrapped)."""
    xp = array_module_of(x)
    h, x2, gx2 = xp.empty_like(x), _rows(x), _rows(gx)
    h2 = _rows(h)
    if bias is not None:
        acc = accumulator(gx.dtype.type)
        target = writable(into, 4, bias.shape, acc)
        sums = target if target is not None else xp.empty(bias.shape, acc)
    if sums is not None and kernels.gelu_and_grad_sums_into(h2, gx2, x2, sums, bias):
        if bias is None:
            return h, SumsWritten(gx), None
        return h, gx, WROTE if sums is target else sums.astype(bias.dtype)
    if bias is not None:
        x2 = x2 + bias
    kernels.gelu_and_grad_into(h2, gx2, x2)
    return h, gx, None if bias is None else gx2.sum(axis=0)


def _linear(x, w, b=None, transpose_w=False, gelu_input=False):
    check_linear(x, w, transpose_w)
    h = gelu_array(x) if gelu_input else x
    out = gemm.matmul(_rows(h), w.T if transpose_w else w)
    if b is not None:
        out += b
    return out.reshape(*x.shape[:-1], out.shape[-1]), None


implement("linear", "cuda", _linear_vjp, gives_column_sums=True, bias_input=_bias_is_input_2)(_linear)


def _linear_add_vjp(
    g,
    _,
    x,
    w,
    b,
    residual,
    gelu_bias=None,
    transpose_w=False,
    gelu_input=False,
    needs=(True,) * 5,
    into=None,
    sums_into=None,
    seed=None,
):
    into, sums_into = into or (None,) * 5, (sums_into or (None,) * 5)[:3]
    lin_needs = needs[:3] + needs[4:5]
    gx, gw, gb, *g_bias = _linear_vjp(
        g, None, x, w, b, transpose_w, gelu_input, lin_needs, into, sums_into, gelu_bias
    )
    return (gx, gw, gb, g if needs[3] else None, *g_bias)


def _linear_add(x, w, b, residual, gelu_bias=None, transpose_w=False, gelu_input=False, seed=None):
    """residual + linear(x, w, b): the GEMM accumulates into residual + b where a LayerNorm kernel
    wrote that into `seed` (a Seed), else the bias and the residual are added in one kernel."""
    h = gelu_array(x, gelu_bias) if gelu_input else x
    seeded = None if seed is None else seed.take(residual, b)
    if seeded is not None:
        gemm.gemm_into(_rows(h), w.T if transpose_w else w, _rows(seeded), accumulate=True)
        return seeded, None
    out, _ = _linear(h, w, None, transpose_w)
    if out.shape != residual.shape:
        raise ValueError(f"linear_add: the residual {residual.shape} must match the output {out.shape}")
    if out.flags.c_contiguous and residual.flags.c_contiguous:
        kernels.add_bias_residual_(out, b, residual)
        return out, None
    out += b
    out += residual
    return out, None


class Seed:
    """linear_add's output begun early: the LayerNorm kernel that opens a block's branch reads the
    residual x anyway, and also writes x + bias (the bias of the projection that closes the branch);
    that projection's GEMM then accumulates into it (cuBLAS's beta = 1), so adding the bias and the
    residual is not a launch of its own. Of the bias only its address is kept; taken, the seed is
    empty again (a forward run again writes it afresh)."""

    def __init__(self, bias):
        self.bias = bias  # the closing linear's bias (a Param): its data is read when the kernel runs
        self._written = None  # (the array, the x it was written from, the bias's address)

    def target(self, x):
        """(an array for x + bias, the bias's array) for a kernel about to read x; None where they
        cannot go together (another width or type)."""
        bias = self.bias.data
        if bias.shape != x.shape[-1:] or bias.dtype != x.dtype:
            return None
        return array_module_of(x).empty_like(x), bias

    def written(self, array, x, bias):
        self._written = (array, x, device_address(bias))

    def take(self, residual, bias):
        """The array written residual + bias (from these very arrays), or None; empty afterwards."""
        written, self._written = self._written, None
        if written is None or written[1] is not residual or written[2] != device_address(bias):
            return None
        return written[0]


implement(
    "linear_add",
    "cuda",
    _linear_add_vjp,
    fusions={"gelu_bias": True, "seed": Seed},
    gives_column_sums=True,
    bias_input=_bias_is_input_2,
)(_linear_add)


# -- LayerNorm ------------------------------------------------------------------------------------


def _layer_norm_vjp(g, saved, x, w, b=None, eps=1e-5, into=None, pending=None, sums_into=None):
    """One kernel for the rows, d w and d b: it writes the weight and bias gradients into zeroed
    parameter gradients (into), adds x's pending gradient (the residual stream's) into its own
    (tape.Summed) and writes the column sums of x's whole gradient into sums_into[0] where offered
    (tape.SumsWritten). The reference's passes where it cannot run."""
    mean, rstd = saved
    if x.flags.c_contiguous:
        gx = array_module_of(x).empty_like(x)
        given = (pending or (None,))[0]
        add = given if given is not None and given.shape == x.shape and given.flags.c_contiguous else None
        # x's whole gradient is this one only with the pending one in it
        sums = (sums_into or (None,))[0] if add is not None or given is None else None
        params = _layer_norm_kernel_vjp(_rows(g), _rows(x), w, b, mean, rstd, _rows(gx), into, add, sums)
        if params is not None:
            wrote_sums, params = params
            gx = gx if add is None else Summed(gx)
            gx = SumsWritten(gx) if wrote_sums else gx
            return (gx, params[0]) if b is None else (gx, *params)
    with whole_arrays():  # the reference keeps the statistics in x's dtype
        return reference._layer_norm_vjp(g, tuple(s.astype(x.dtype, copy=False) for s in saved), x, w, b, eps)


def _layer_norm_kernel_vjp(g2, x2, w, b, mean, rstd, gx2, into, add, sums):
    """(whether `sums` got gx2's column sums, (d w, d b)) from the kernel, which writes gx2 too
    (plus `add`, where given); each WROTE where it went straight into a zeroed parameter gradient
    (`into`); None where it cannot run."""
    xp = array_module_of(x2)
    params, acc = (w, b), accumulator(w.dtype.type)  # the kernel writes them in its arithmetic's type
    targets = [None if a is None else writable(into, k, a.shape, acc) for k, a in enumerate(params, 1)]
    outs = [t if t is not None or a is None else xp.empty(a.shape, acc) for t, a in zip(targets, params)]
    add2 = None if add is None else _rows(add)
    wrote_sums = layer_norm.backward(g2, x2, w, mean, rstd, gx2, *outs, add2, sums)
    if wrote_sums is None:
        return None
    own = (
        WROTE if t is not None else None if a is None else out.astype(a.dtype, copy=False)
        for t, out, a in zip(targets, outs, params)
    )
    return wrote_sums, tuple(own)


def _layer_norm(x, w, b=None, eps=1e-5):
    xp = array_module_of(x)
    n, C = _rows(x).shape
    out = xp.empty_like(x)
    mean, rstd = (xp.empty((n, 1), accumulator(x.dtype.type)) for _ in range(2))  # float32 for 16-bit x
    if x.flags.c_contiguous and layer_norm.forward(_rows(x), w, b, eps, _rows(out), mean, rstd):
        return out, (mean, rstd)
    with whole_arrays():
        return reference._layer_norm.forward(x, w, b, eps)


LN_FLAGS = dict(takes_into=True, takes_pending=True, gives_column_sums=True)
implement("layer_norm", "cuda", _layer_norm_vjp, **LN_FLAGS)(_layer_norm)


# -- LayerNorm into a linear ----------------------------------------------------------------------


def _layer_norm_linear_vjp(
    g,
    saved,
    *arrays,
    ln_bias=True,
    bias=True,
    eps=1e-5,
    transpose_w=False,
    needs=None,
    into=None,
    pending=None,
    sums_into=None,
    seed=None,
):
    """From the kept output; where the forward folded the bias into its GEMM (the output padded
    with a ones column), one GEMM each writes the weight's and the bias's gradients (_folded_grads)."""
    x, ln_w, ln_b, w, b = split_ln_linear(arrays, ln_bias, bias)
    needs = needs or (True,) * len(arrays)
    into = into or (None,) * len(arrays)
    n_ln = 2 + ln_bias
    mean, rstd, kept = saved
    C = x.shape[-1]
    y = _rows(kept)[:, :C]
    linear_needs = (any(needs[:n_ln]), *needs[n_ln:])
    lin_into = (None, *into[n_ln:])
    if kept.shape[-1] > C and _folded_grads(kept, g, lin_into, linear_needs):
        gy, _ = _linear_vjp(g, None, y, w, None, transpose_w, needs=(linear_needs[0], False))
        lin = [WROTE, WROTE]
    else:
        gy, *lin = _linear_vjp(g, None, y, w, b, transpose_w, needs=linear_needs, into=lin_into)
    del y
    if gy is None:
        return (None,) * n_ln + tuple(lin)
    ln = _layer_norm_vjp(gy, (mean, rstd), x, ln_w, ln_b, eps, into[:n_ln], pending, sums_into)
    return (*ln, *lin)


def _layer_norm_linear(*arrays, ln_bias=True, bias=True, eps=1e-5, transpose_w=False, seed=None):
    """linear(layer_norm(x)), the LayerNorm's output kept; its kernel also writes seed's x + bias."""
    x, ln_w, ln_b, w, b = split_ln_linear(arrays, ln_bias, bias)
    if x.flags.c_contiguous:
        done = _kernel_layer_norm_linear(x, ln_w, ln_b, w, b, eps, transpose_w, seed)
        if done is not None:
            return done
    y, stats = _layer_norm(x, ln_w, ln_b, eps)
    out, _ = _linear(y, w, b, transpose_w)
    return out, (*stats, y)


def folded_row_length(C: int) -> int:
    """A LayerNorm output's row padded with a ones column: C + 1 elements rounded up to 8 (rows 16
    bytes apart in 16-bit types, as cuBLAS's fastest kernels read them)."""
    return -(-(C + 1) // 8) * 8


def _kernel_layer_norm_linear(x, ln_w, ln_b, w, b, eps, transpose_w, seed):
    """(out, saved) through the LayerNorm kernel, or None where it cannot run. With a bias, it costs
    no launch of its own: the kernel writes it into every row of the GEMM's output, to which the
    GEMM (K = C) adds its product, and pads its own output with a ones column, from which backward
    has the bias's gradient as a GEMM (_folded_grads; K = C + 1 in the forward GEMM ran at a third
    of the speed: bench/HISTORY.md)."""
    xp, x2 = array_module_of(x), _rows(x)
    n, C = x2.shape
    folded = b is not None and not transpose_w and gemm.writes(x.dtype, x.dtype)
    padded = xp.empty((n, folded_row_length(C) if folded else C), x.dtype)
    mean, rstd = (xp.empty((n, 1), accumulator(x.dtype.type)) for _ in range(2))  # float32 for 16-bit x
    seeded, seed_bias = (None if seed is None else seed.target(x)) or (None, None)
    rows_seeded = None if seeded is None else _rows(seeded)
    out = xp.empty((n, w.shape[1]), x.dtype) if folded else None
    biases = (out, b) if folded else (None, None)
    if not layer_norm.forward(
        x2, ln_w, ln_b, eps, padded, mean, rstd, folded, rows_seeded, seed_bias, *biases
    ):
        return None
    if seeded is not None:
        seed.written(seeded, x, seed_bias)
    if folded:
        gemm.gemm_into(padded[:, :C], w, out, accumulate=True)
    else:
        out, _ = _linear(padded, w, b, transpose_w)
    return out.reshape(*x.shape[:-1], out.shape[-1]), (mean, rstd, padded)


def _folded_grads(padded, g, into, needs) -> bool:
    """Whether the weight's and the bias's gradients were written from the padded output's ones
    column (the forward folded the bias into its GEMM): dw = y^T g and db = 1^T g, two GEMMs into
    their zeroed gradients (into[1], into[2]); False where they cannot (the GEMM and a column sum
    then run). Not one GEMM of M = C + 1: an odd M ran on a slower kernel (bench/HISTORY.md)."""
    dw, db = into[1:3] if needs[1] and needs[2] else (None, None)
    if dw is None or db is None or not gemm.writes(padded.dtype, dw.dtype) or db.dtype != dw.dtype:
        return False
    if not (dw.flags.c_contiguous and db.flags.c_contiguous):  # a reshaped copy would take the GEMM
        return False
    C, g2 = dw.shape[0], _rows(g)
    gemm.gemm_into(padded[:, :C].T, g2, dw)
    gemm.gemm_into(padded[:, C : C + 1].T, g2, db.reshape(1, -1))
    return True


implement(
    "layer_norm_linear",
    "cuda",
    _layer_norm_linear_vjp,
    fusions={"seed": Seed},
    takes_pending=True,
    gives_column_sums=True,
    bias_input=lambda settings, inputs: inputs - 1 if settings.get("bias", True) else None,
)(_layer_norm_linear)


# -- cross-entropy --------------------------------------------------------------------------------


def _cross_entropy_vjp(g, saved, logits, targets, ignore_index=-1, count=None):
    lse, valid, count, t = saved
    t = targets.reshape(-1) if t is None else t  # else the device copy of host targets
    if valid is None:  # the forward ran the kernel: so does the backward, in one pass
        flat = _rows(logits)
        return (cross_entropy.backward(flat, t, lse, g, ignore_index, count).reshape(logits.shape),)
    with whole_arrays():
        return reference._cross_entropy_vjp(g, saved, logits, targets, ignore_index, count)


def _cross_entropy(logits, targets, ignore_index=-1, count=None):
    """One kernel each way where it runs; host targets are checked on the host (no device read) and
    copied once, with their count; device targets' count stays on the device: no host sync."""
    xp = array_module_of(logits)
    flat, t = reference.check_targets(logits, targets)
    valid = t != ignore_index
    reference.check_target_range(t, valid, flat.shape[1], ignore_index)
    count = _count(t, valid, count)
    copied = on_device = None
    if array_module_of(t) is np:  # host targets: checked above with no device read
        t, on_device = cross_entropy.targets_with_count(xp, t, count)
        copied = t
    if logits.flags.c_contiguous and cross_entropy.usable(flat, t):
        on_device = count.reshape(1) if on_device is None else on_device
        lse, losses = cross_entropy.forward(flat, t, ignore_index)
        loss_dtype = np.promote_types(logits.dtype, np.float32)
        loss = xp.divide(losses.sum(), on_device.reshape(()), dtype=loss_dtype)  # as losses.sum() / count
        return loss, (lse, None, on_device, copied)
    if copied is not None:  # the passes below need the mask on the device
        valid = t != ignore_index
    with whole_arrays():
        lse = reference.log_sum_exp(flat)
    picked = flat[xp.arange(flat.shape[0]), xp.where(valid, t, 0)]
    loss = ((lse - picked) * valid).sum() / count
    return xp.asarray(loss, dtype=logits.dtype), (lse, valid, count, copied)


def _count(t, valid, count):
    """The count the loss divides by (default: the valid targets'; 1 where it is 0): host targets'
    on the host, device targets' on the device (no host sync in the forward)."""
    if array_module_of(t) is np:
        return (count if count is not None else int(valid.sum())) or 1
    xp = array_module_of(t)
    count = xp.asarray(valid.sum() if count is None else count, dtype=np.float64)
    return xp.where(count == 0, 1.0, count)


def reads_as_they_are(logits, targets) -> bool:
    """Whether the cross-entropy kernel takes these 16-bit logits directly (it computes in float32:
    a float32 copy of the step's largest array is not needed)."""
    if not logits.flags.c_contiguous:
        return False
    return cross_entropy.usable(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


implement("cross_entropy", "cuda", _cross_entropy_vjp, fusions={"16-bit logits": reads_as_they_are})(
    _cross_entropy
)


# -- embedding ------------------------------------------------------------------------------------


def _embedding(w, idx):
    """w[idx]; host (NumPy) indices are checked on the host and copied once (kept for backward)."""
    check_indices(w, idx)
    idx, copied = onto(array_module_of(w), idx)
    return w[idx], idx if copied else None


implement("embedding", "cuda")(_embedding)
