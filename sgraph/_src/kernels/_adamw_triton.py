"""The Triton kernel of :mod:`adamw_lists`, imported only when it runs (Triton is
optional on CPU). In a process started with ``TRITON_INTERPRET=1`` it runs in
Triton's interpreter, on CPU tensors too."""

# mypy: ignore-errors
import triton
import triton.language as tl


@triton.jit
def adamw_lists(
    p_base,
    g_base,
    m_base,
    v_base,
    po_base,
    mo_base,
    vo_base,
    table,
    n_leaves,
    lr_ptr,
    step_ptr,
    b1,
    b2,
    log2_b1,
    log2_b2,
    eps,
    weight_decay,
    GRAD: tl.constexpr,
    OUT: tl.constexpr,
    GRAD_ALIGN: tl.constexpr,
    SEARCH: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
):
    # The table (int64): where every leaf's param, grad and moments are, in elements
    # from the first leaf's (the four base pointers), with OUT where its new param and
    # moments go (three more rows, from the po / mo / vo bases; without OUT the update
    # is written in place), each leaf's element count, then the running count of chunks
    # (n_leaves + 1 entries). Each program updates one chunk of BLOCK * ITERS elements
    # of one leaf.
    ROWS: tl.constexpr = 7 if OUT else 4
    chunk = tl.program_id(0).to(tl.int64)
    firsts = table + (ROWS + 1) * n_leaves
    lo = 0
    hi = n_leaves
    for _ in tl.static_range(SEARCH):  # the leaf whose chunks hold this one: firsts[lo] <= chunk < firsts[hi]
        mid = (lo + hi) // 2
        right = tl.load(firsts + mid) <= chunk
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    leaf = lo
    n = tl.load(table + ROWS * n_leaves + leaf)
    start = (chunk - tl.load(firsts + leaf)) * (BLOCK * ITERS)
    # every address is a multiple of 16 bytes (checked by the caller), so each offset
    # is a multiple of 16 bytes' elements (4 fp32, GRAD_ALIGN grads): vector accesses
    p_ptr = p_base + tl.multiple_of(tl.load(table + leaf), 4)
    g_ptr = g_base + tl.multiple_of(tl.load(table + n_leaves + leaf), GRAD_ALIGN)
    m_ptr = m_base + tl.multiple_of(tl.load(table + 2 * n_leaves + leaf), 4)
    v_ptr = v_base + tl.multiple_of(tl.load(table + 3 * n_leaves + leaf), 4)
    if OUT:
        po_ptr = po_base + tl.multiple_of(tl.load(table + 4 * n_leaves + leaf), 4)
        mo_ptr = mo_base + tl.multiple_of(tl.load(table + 5 * n_leaves + leaf), 4)
        vo_ptr = vo_base + tl.multiple_of(tl.load(table + 6 * n_leaves + leaf), 4)
    else:
        po_ptr = p_ptr
        mo_ptr = m_ptr
        vo_ptr = v_ptr

    lr = tl.load(lr_ptr).to(tl.float32)
    t = tl.load(step_ptr).to(tl.float32)
    # as ATen's fused AdamW: param -= lr * wd * param; then the moments; then
    # param -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps), with bc = 1 - beta ** t
    decay = lr * weight_decay
    step_size = tl.div_rn(lr, 1.0 - tl.exp2(t * log2_b1))
    bc2_sqrt = tl.sqrt_rn(1.0 - tl.exp2(t * log2_b2))
    for i in tl.static_range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        if start + (i + 1) * BLOCK <= n:  # a whole block: unmasked (vector) accesses
            p = tl.load(p_ptr + offs)
            g = tl.load(g_ptr + offs).to(tl.float32)
            m = tl.load(m_ptr + offs)
            v = tl.load(v_ptr + offs)
        else:
            mask = offs < n
            p = tl.load(p_ptr + offs, mask=mask, other=0.0)
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            m = tl.load(m_ptr + offs, mask=mask, other=0.0)
            v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        if weight_decay != 0.0:
            p = p - decay * p
        m = b1 * m + (1.0 - b1) * g
        v = b2 * v + (1.0 - b2) * g * g
        p = p - tl.div_rn(step_size * m, tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps)
        if start + (i + 1) * BLOCK <= n:
            tl.store(po_ptr + offs, p)
            tl.store(mo_ptr + offs, m)
            tl.store(vo_ptr + offs, v)
        else:
            mask = offs < n
            tl.store(po_ptr + offs, p, mask=mask)
            tl.store(mo_ptr + offs, m, mask=mask)
            tl.store(vo_ptr + offs, v, mask=mask)
