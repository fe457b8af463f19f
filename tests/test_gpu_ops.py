"""Every fast CUDA op against its torch reference on random inputs, and greedy tokens of the fast
path (Triton/fla kernels + CUDA graphs) against the reference path on small random models.

Runs on a CUDA machine. CPU CI skips it, except that with TRITON_INTERPRET=1 (and Triton
installed) the Triton kernels' comparisons run on the CPU through Triton's interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from engram.ops import activation, attention, conv, gated_delta, moe, norm, sample, ssd, staging, verify

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
try:
    from engram.ops import cuda_kernels, triton_ops
except ImportError:  # no Triton: nothing here can run
    cuda_kernels = triton_ops = None

pytestmark = [
    pytest.mark.skipif(
        not (HAS_CUDA or INTERPRET),
        reason="fast ops need a CUDA GPU (or TRITON_INTERPRET=1 to run the Triton kernels on the CPU interpreter)",
    ),
    pytest.mark.skipif(triton_ops is None, reason="Triton is not installed (the `cuda` extra)"),
]
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (CUDA graphs, fla-core kernels)")
DEV = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if HAS_CUDA else [torch.float32]


def _tol(dtype: torch.dtype) -> dict:
    return dict(atol=2e-4, rtol=2e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _randn(*shape, g, dtype=torch.float32):
    return torch.randn(*shape, generator=g, device=DEV).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("w_fp32", [False, True])
def test_rms_norm(dtype, w_fp32):
    g = _gen(0)
    for n in (48, 1536, 4096 + 8):
        w, x = _randn(n, g=g, dtype=dtype), _randn(7, n, g=g, dtype=dtype)  # weights first: see PDL_LAUNCH
        out = triton_ops.norm.rms_norm(x, w, 1e-5, w_fp32)
        ref = norm.rms_norm(x, w, 1e-5, w_fp32)
        assert out.dtype == ref.dtype
        torch.testing.assert_close(out, ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual_fp32", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.22])
def test_add_rms_norm(dtype, residual_fp32, scale):
    g = _gen(12)
    for n in (48, 1536):
        w, x = _randn(n, g=g, dtype=dtype), _randn(7, n, g=g, dtype=dtype)  # weights first: see PDL_LAUNCH
        r = _randn(7, n, g=g, dtype=torch.float32 if residual_fp32 else dtype)
        out, stream = triton_ops.norm.add_rms_norm(x, r, w, 1e-5, scale)
        ref, ref_stream = norm.add_rms_norm(x, r, w, 1e-5, scale)
        assert out.dtype == ref.dtype and stream.dtype == ref_stream.dtype
        # the same roundings (in float32 the kernel may fuse the multiply-add: within an ulp)
        torch.testing.assert_close(stream, ref_stream, **(dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=0)))
        torch.testing.assert_close(out, ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm(dtype):
    g = _gen(1)
    for n, gs in ((96, 48), (3072, 3072), (1024, 128)):
        w, x, z = _randn(n, g=g, dtype=dtype), _randn(5, n, g=g), _randn(5, n, g=g, dtype=dtype)  # weights first: see PDL_LAUNCH
        out = triton_ops.norm.gated_rms_norm(x, z, w, 1e-6, gs, dtype)
        ref = norm.gated_rms_norm(x, z, w, 1e-6, gs, dtype)
        torch.testing.assert_close(out, ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 40, 64, 65])
@pytest.mark.parametrize("bias", [False, True])
def test_linear(dtype, rows, bias):
    """The small-batch kernels (the GEMV up to LINEAR_GEMV_MAX_ROWS rows, the tensor-core kernel up to
    LINEAR_DOT_MAX_ROWS; cuBLAS above) against F.linear."""
    g = _gen(14)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if HAS_CUDA else 1
    # one, two and four blocks of K; layers narrow and wide for the tensor-core kernel's blocks; a K
    # too short for tensor cores (cuBLAS then)
    shapes = ((40, 96), (200, 1536 + 16), (24, 3072 + 16), (triton_ops.linear.LINEAR_DOT_WIDE_COLUMNS_PER_SM * sms + 8, 256), (40, 8))
    narrow = "linear_dot_narrow_64" if rows > 32 else "linear_dot_narrow"
    assert {triton_ops.linear.linear_dot_config_key(n, rows, torch.device(DEV)) for n, _ in shapes} == {"linear_dot", narrow}
    for n, k in shapes:
        x, w = _randn(rows, k, g=g, dtype=dtype), _randn(n, k, g=g, dtype=dtype) * 0.05
        for b in (_randn(n, g=g, dtype=dtype), _randn(2 * n, g=g, dtype=dtype)[::2]) if bias else (None,):  # the second strided
            torch.testing.assert_close(triton_ops.linear.linear(x, w, b), F.linear(x, w, b), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    h = _randn(9, 2 * 56, g=_gen(2), dtype=dtype)
    torch.testing.assert_close(triton_ops.norm.silu_and_mul(h), activation.silu_and_mul(h), **_tol(dtype))


def _conv_inputs(g, dtype, C=144, K=4, slots_total=6):
    w = _randn(C, 1, K, g=g, dtype=dtype)[:, 0, :]  # a strided view, as the layer passes it
    b = _randn(C, g=g, dtype=dtype)
    pool = _randn(slots_total, K - 1, C, g=g, dtype=dtype)
    return w, b, pool


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize(
    "slots", [[4, 0, -1, 2], [3], [5, 1, -1, 0, 2, 4], [-1 if i % 7 == 3 else (i * 5) % 41 for i in range(41)]]
)  # GEMV, tensor cores
@pytest.mark.parametrize("bias", [True, False])
def test_linear_conv_update_in_place_by_slot(dtype, K, slots, bias):
    """Mamba2's in_proj with the conv update of its xBC columns (C = 144 of 200, starting at 10)."""
    g = _gen(3)
    w, b, pool = _conv_inputs(g, dtype, K=K, slots_total=max(slots) + 1)
    b = b if bias else None
    slots = torch.tensor(slots, device=DEV)  # -1: a CUDA-graph padding row
    x = _randn(len(slots), 96, g=g, dtype=dtype)
    proj_w, proj_b = _randn(200, 96, g=g, dtype=dtype) * 0.1, _randn(200, g=g, dtype=dtype)
    pool_ref = pool.clone()
    real = slots >= 0
    out = triton_ops.linear.linear_conv_update(x, proj_w, proj_b, w, b, pool, slots, 10)
    ref = conv.linear_conv_update(x[real], proj_w, proj_b, w, b, pool_ref, slots[real], 10)
    torch.testing.assert_close(out[real], ref, **_tol(dtype))
    torch.testing.assert_close(pool, pool_ref, **_tol(dtype))  # untouched slots too


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("silu", [True, False])  # Mamba2's conv, LFM2's short conv
def test_causal_conv1d_varlen_in_place_by_slot(dtype, K, silu):
    g = _gen(4)
    w, b, pool = _conv_inputs(g, dtype, K=K)
    lens = [1, 2, 70, 5, 3, 4]
    slots = torch.tensor([5, 1, 3, 0, 2, -1], device=DEV)  # -1: reads zeros, writes nothing
    xbc = _randn(sum(lens), 160, g=g, dtype=dtype)[:, 8:152]
    pool_ref = pool.clone()
    y = triton_ops.conv.causal_conv1d_varlen(xbc, w, b, pool, slots, lens, silu=silu)
    y_ref = conv.causal_conv1d_varlen(xbc, w, b, pool_ref, slots, lens, silu=silu)
    torch.testing.assert_close(y, y_ref, **_tol(dtype))
    torch.testing.assert_close(pool, pool_ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_causal_conv1d_update_in_place_by_slot(dtype, K, silu, bias):
    """The decode update alone (LFM2's short conv, without the SiLU), padding rows included: the
    reference gives them a zero window too, and the slot -1 would alias (the last) stays as it was."""
    g = _gen(5)
    w, b, pool = _conv_inputs(g, dtype, K=K)
    slots = torch.tensor([4, -1, 0, 3, -1], device=DEV)
    x = _randn(len(slots), 144, g=g, dtype=dtype)
    pool_ref, last = pool.clone(), pool[-1].clone()
    y = triton_ops.conv.causal_conv1d_update(x, w, b if bias else None, pool, slots, silu=silu)
    y_ref = conv.causal_conv1d_update(x, w, b if bias else None, pool_ref, slots, silu=silu)
    torch.testing.assert_close(y, y_ref, **_tol(dtype))
    torch.testing.assert_close(pool, pool_ref, **_tol(dtype))
    assert torch.equal(pool[-1], last)


def _ssd_params(g, H, G, P, N, slots_total, pool_dtype=torch.float32):
    dt_bias = _randn(H, g=g)
    A_log = torch.log(torch.rand(H, generator=g, device=DEV) * 4 + 0.5)
    D = _randn(H, g=g)
    pool = _randn(slots_total, H, P, N, g=g).to(pool_dtype)
    return dt_bias, A_log, D, pool


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(6, 2, 16, 12), (48, 1, 64, 128), (16, 8, 64, 128)])
def test_ssd_state_update_in_place_by_slot(dtype, shape):
    H, G, P, N = shape
    g = _gen(5)
    dt_bias, A_log, D, pool = _ssd_params(g, H, G, P, N, 5)
    slots = torch.tensor([3, -1, 0, 4], device=DEV)
    S = len(slots)
    proj = _randn(S, H * P + 2 * G * N + 7, g=g, dtype=dtype)
    x = proj[:, : H * P].reshape(S, H, P)
    B = proj[:, H * P : H * P + G * N].reshape(S, G, N)
    C = proj[:, H * P + G * N : H * P + 2 * G * N].reshape(S, G, N)
    dt = _randn(S, H, g=g, dtype=dtype) * 2
    pool_ref = pool.clone()
    real = slots >= 0
    y = triton_ops.ssd.ssd_state_update(pool, slots, x, dt, dt_bias, (0.0, float("inf")), A_log, B, C, D)
    y_ref = ssd.ssd_state_update(pool_ref, slots[real], x[real], dt[real], dt_bias, (0.0, float("inf")), A_log, B[real], C[real], D)
    torch.testing.assert_close(y[real], y_ref, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(pool, pool_ref, atol=1e-4, rtol=1e-4)
    # a time-step limit clamps
    y2 = triton_ops.ssd.ssd_state_update(pool.clone(), slots, x, dt, dt_bias, (0.01, 0.1), A_log, B, C, D)
    y2_ref = ssd.ssd_state_update(pool.clone(), slots[real], x[real], dt[real], dt_bias, (0.01, 0.1), A_log, B[real], C[real], D)
    torch.testing.assert_close(y2[real], y2_ref, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("silu", [True, False])  # Mamba2's and gated DeltaNet's conv, LFM2's short conv
def test_conv_verify_keeps_every_window(dtype, K, bias, silu):
    """The one-launch verify conv against ops/verify.py: y and the windows of sequences of different
    lengths (positions past a length repeat its last row), the pool untouched."""
    g = _gen(26)
    C, lens, slots = 300, [3, 1, 5, 2], torch.tensor([4, 1, 0, 2], device=DEV)
    T = sum(lens)
    x = _randn(T, C + 5, g=g, dtype=dtype)[:, :C]  # a column slice of the projection, as in the layer
    w, b = _randn(C, K, g=g, dtype=dtype), (_randn(C, g=g, dtype=dtype) if bias else None)
    pool = _randn(6, K - 1, C, g=g, dtype=dtype)
    rows, flat = verify.verify_layout(lens, torch.device(DEV))
    full = torch.zeros(len(lens), K - 1 + max(lens) + 2, C, dtype=dtype, device=DEV)  # a view narrower than its buffer
    windows, ref_windows = full[:, : K - 1 + max(lens)], full.clone()[:, : K - 1 + max(lens)]
    before = pool.clone()
    y = triton_ops.conv.causal_conv1d_verify(x, w, b, pool, slots, rows, flat, windows, silu)
    y_ref = verify.causal_conv1d_verify(x, w, b, pool, slots, rows, flat, ref_windows, silu)
    assert torch.equal(pool, before) and torch.equal(windows, ref_windows)
    torch.testing.assert_close(y, y_ref, **_tol(dtype))


@pytest.mark.parametrize("pool_dtype", DTYPES)
@pytest.mark.parametrize("shape", [(6, 2, 16, 12), (48, 1, 64, 128)])
def test_ssd_verify_keeps_the_state_after_every_position(pool_dtype, shape):
    """The one-launch verify SSD against ops/verify.py: y and every position's state of sequences of
    different lengths (positions past a length repeat its last row), the pool untouched; a padding
    sequence (slot -1) starts from zeros, as the reference's from the zeroed last slot."""
    H, G, P, N = shape
    g = _gen(25)
    dt_bias, A_log, D, pool = _ssd_params(g, H, G, P, N, 6, pool_dtype)
    pool[-1] = 0
    lens, slots = [3, 1, 5, 2], torch.tensor([4, -1, 0, 2], device=DEV)
    T = sum(lens)
    proj = _randn(T, H * P + 2 * G * N + 7, g=g)
    x = proj[:, : H * P].reshape(T, H, P)
    B = proj[:, H * P : H * P + G * N].reshape(T, G, N)
    C = proj[:, H * P + G * N : H * P + 2 * G * N].reshape(T, G, N)
    dt = _randn(T, H, g=g) * 2
    rows, flat = verify.verify_layout(lens, torch.device(DEV))
    full = torch.zeros(len(lens), max(lens) + 2, H, P, N, dtype=pool_dtype, device=DEV)  # a view narrower than its buffer
    states, ref_states = full[:, : max(lens)], full.clone()[:, : max(lens)]
    before = pool.clone()
    args = (dt_bias, (0.0, float("inf")), A_log, B, C, D, rows, flat)
    y = triton_ops.ssd.ssd_verify(x, dt, *args, pool, slots, states)
    y_ref = verify.ssd_verify(x, dt, *args, pool, slots, ref_states)
    assert torch.equal(pool, before)
    tol = dict(atol=1e-3, rtol=1e-3) if pool_dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(states.float(), ref_states.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 64])  # fused up to LINEAR_GEMV_MAX_ROWS
# not fused: two groups; more than SSD_NORM_MAX_PARTS sums of squares a row
@pytest.mark.parametrize("shape", [(6, 1, 16, 12), (48, 1, 64, 128), (8, 2, 16, 32), (65, 1, 64, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_ssd_state_update_norm_linear(dtype, rows, shape, bias, monkeypatch):
    """The decode output with the gated norm folded into the SSD update and the output projection's
    GEMV (or not: more rows, two groups), against the reference's three steps, padding rows (slot -1)
    included."""
    H, G, P, N = shape
    g = _gen(15)
    dt_bias, A_log, D, pool = _ssd_params(g, H, G, P, N, rows + 2)
    norm_w = 1 + 0.1 * _randn(H * P, g=g, dtype=dtype)
    w = _randn(40, H * P, g=g, dtype=dtype) * 0.05
    b = _randn(40, g=g, dtype=dtype) if bias else None
    slots = torch.randperm(rows + 2, generator=g, device=DEV)[:rows]
    slots[1::5] = -1
    proj = _randn(rows, 2 * H * P + 2 * G * N + 3, g=g, dtype=dtype)
    gate = proj[:, : H * P]
    x = proj[:, H * P : 2 * H * P].reshape(rows, H, P)
    B = proj[:, 2 * H * P : 2 * H * P + G * N].reshape(rows, G, N)
    C = proj[:, 2 * H * P + G * N : 2 * H * P + 2 * G * N].reshape(rows, G, N)
    dt = _randn(rows, H, g=g, dtype=dtype)
    real = slots >= 0
    pool_ref = pool.clone()
    args = (dt_bias, (0.0, float("inf")), A_log)
    norm_calls = []
    norm_kernel = triton_ops.norm.gated_rms_norm
    monkeypatch.setattr(triton_ops.ssd, "gated_rms_norm", lambda *a: norm_calls.append(a) or norm_kernel(*a))
    out = triton_ops.ssd.ssd_state_update_norm_linear(pool, slots, x, dt, *args, B, C, D, gate, norm_w, 1e-5, H * P // G, w, b)
    fused = G == 1 and rows <= triton_ops.linear.LINEAR_GEMV_MAX_ROWS and H * P // 8 <= triton_ops.ssd.SSD_NORM_MAX_PARTS
    assert not norm_calls if fused else len(norm_calls) == 1  # fused: no norm kernel of its own
    ref = ssd.ssd_state_update_norm_linear(
        pool_ref, slots[real], x[real], dt[real], *args, B[real], C[real], D, gate[real], norm_w, 1e-5, H * P // G, w, b
    )
    assert out.dtype == ref.dtype == dtype
    torch.testing.assert_close(out[real], ref, **_tol(dtype))
    torch.testing.assert_close(pool, pool_ref, atol=1e-4, rtol=1e-4)


@needs_cuda
@pytest.mark.skipif(cuda_kernels is None or not cuda_kernels.has_fla(), reason="fla-core is not installed (the `cuda` extra)")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(6, 2, 16, 12), (48, 1, 64, 128)])
def test_ssd_varlen_fla_matches_reference(dtype, shape):
    H, G, P, N = shape
    g = _gen(6)
    dt_bias, A_log, D, pool = _ssd_params(g, H, G, P, N, 6)
    lens = [1, 37, 300, 64, 5]
    slots = torch.tensor([2, 5, 0, 3, 1], device=DEV)
    T = sum(lens)
    x = _randn(T, H, P, g=g, dtype=dtype)
    B, C = _randn(T, G, N, g=g, dtype=dtype), _randn(T, G, N, g=g, dtype=dtype)
    dt = _randn(T, H, g=g, dtype=dtype) - 1
    pool_ref = pool.clone()
    y = cuda_kernels.ssd_varlen_fla(x, dt, dt_bias, (0.0, float("inf")), A_log, B, C, D, 64, lens, pool, slots)
    y_ref = ssd.ssd_varlen(x, dt, dt_bias, (0.0, float("inf")), A_log, B, C, D, 64, lens, pool_ref, slots)
    limit = 5e-3 if dtype == torch.float32 else 3e-2
    assert _rel(y, y_ref) < limit, _rel(y, y_ref)
    assert _rel(pool, pool_ref) < limit, _rel(pool, pool_ref)


_FLA = {"gdn": "_chunk_gdr", "kda": "_chunk_kda"}  # fla-core's chunked kernel of each rule


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens", [[1, 37, 5], [1, 37, 300, 64, 5]])  # the token-by-token kernel, fla's chunked one
@pytest.mark.parametrize(
    "rule, shape",  # Hk, Hv, K, V: the second shape of each is Qwen3-Next's and Kimi-Linear-48B-A3B's
    [("gdn", (2, 4, 32, 48)), ("gdn", (16, 32, 128, 128)), ("kda", (3, 3, 16, 16)), ("kda", (32, 32, 128, 128))],
)
def test_gated_delta_varlen_fla_matches_reference(rule, shape, dtype, lens):
    """fla-core's chunk_gated_delta_rule (a decay per head) and chunk_kda (per key channel)."""
    if cuda_kernels is None or getattr(cuda_kernels, _FLA[rule]) is None:
        pytest.skip(f"fla-core (with its {rule} kernel) is not installed (the `cuda` extra)")
    q, k, v, decay, beta, pool = _gdn_inputs(lens, shape, dtype, 7 if rule == "gdn" else 8, per_channel=rule == "kda")
    slots = torch.tensor([2, 5, 0, 3, 1][: len(lens)], device=DEV)
    pool_ref = pool.clone()
    o = cuda_kernels.gated_delta_varlen(q, k, v, decay, beta, lens, pool, slots, 64, True)
    o_ref = gated_delta.gated_delta_varlen(q, k, v, decay, beta, lens, pool_ref, slots, 64, True)
    limit = 5e-3 if dtype == torch.float32 else 3e-2
    assert _rel(o, o_ref) < limit, _rel(o, o_ref)
    assert _rel(pool, pool_ref) < limit, _rel(pool, pool_ref)


def _gdn_inputs(lens: list[int], shape: tuple[int, int, int, int], dtype: torch.dtype, seed: int, per_channel: bool = False):
    """Per-channel: Kimi Delta Attention's decay [T, Hv, K]."""
    Hk, Hv, K, V = shape
    g = _gen(seed)
    T = sum(lens)
    q, k, v = _randn(T, Hk, K, g=g, dtype=dtype), _randn(T, Hk, K, g=g, dtype=dtype), _randn(T, Hv, V, g=g, dtype=dtype)
    decay = -torch.rand(T, Hv, *((K,) if per_channel else ()), generator=g, device=DEV)
    beta = torch.rand(T, Hv, generator=g, device=DEV).to(dtype)
    return q, k, v, decay, beta, _randn(6, Hv, K, V, g=g) * 0.1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 4, 12, 40), (3, 3, 8, 12), (16, 32, 128, 128)])  # Hk, Hv, K, V (Qwen3-Next: the last)
@pytest.mark.parametrize("per_channel", [False, True])  # a decay per head (gated DeltaNet), per key channel (KDA)
def test_gated_delta_scan_matches_reference(dtype, shape, per_channel):
    """The token-by-token kernel: a varlen prefill from the pool's states, then a decode step whose
    padding row (slot -1) leaves the pool alone."""
    from engram.ops.triton_ops import gated_delta as gdn_scan

    lens = [1, 37, 5, 128]
    q, k, v, decay, beta, pool = _gdn_inputs(lens, shape, dtype, 9, per_channel)
    slots = torch.tensor([2, 5, 0, 3], device=DEV)
    pool_ref = pool.clone()
    o = gdn_scan.gated_delta_varlen_scan(q, k, v, decay, beta, lens, pool, slots, 64, True)
    o_ref = gated_delta.gated_delta_varlen(q, k, v, decay, beta, lens, pool_ref, slots, 64, True)
    limit = 1e-4 if dtype == torch.float32 else 3e-2
    assert _rel(o, o_ref) < limit and _rel(pool, pool_ref) < limit, (_rel(o, o_ref), _rel(pool, pool_ref))

    rows = [0, 9, 40, 70]  # one token for each of slots 2, 4 (unused so far), padding, 3
    step_slots = torch.tensor([2, 4, -1, 3], device=DEV)
    pool_ref = pool.clone()
    o = gdn_scan.gated_delta_state_update(pool, step_slots, q[rows], k[rows], v[rows], decay[rows], beta[rows], True)
    live = [0, 1, 3]
    o_ref = gated_delta.gated_delta_state_update(pool_ref, step_slots[live], *(t[rows][live] for t in (q, k, v, decay, beta)), True)
    assert _rel(o[live], o_ref) < limit and _rel(pool, pool_ref) < limit, (_rel(o[live], o_ref), _rel(pool, pool_ref))


@pytest.mark.parametrize("pool_dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 4, 12, 40), (3, 3, 8, 12), (16, 32, 128, 128)])  # Hk, Hv, K, V (Qwen3-Next: the last)
def test_gated_delta_verify_keeps_the_state_after_every_position(pool_dtype, shape):
    """The one-launch verify gated delta rule against ops/verify.py: o and every position's state of
    sequences of different lengths (positions past a length repeat its last row), the pool
    untouched; a padding sequence (slot -1) starts from zeros, as the reference's from the zeroed last slot."""
    from engram.ops.triton_ops import gated_delta as gdn_scan

    Hk, Hv, K, V = shape
    lens, slots = [3, 1, 5, 2], torch.tensor([4, -1, 0, 2], device=DEV)
    q, k, v, decay, beta, pool = _gdn_inputs(lens, shape, torch.float32, 27)
    pool = pool.to(pool_dtype)
    pool[-1] = 0
    rows, flat = verify.verify_layout(lens, torch.device(DEV))
    full = torch.zeros(len(lens), max(lens) + 2, Hv, K, V, dtype=pool_dtype, device=DEV)  # a view narrower than its buffer
    states, ref_states = full[:, : max(lens)], full.clone()[:, : max(lens)]
    before = pool.clone()
    o = gdn_scan.gated_delta_verify(q, k, v, decay, beta, rows, flat, pool, slots, states, True)
    o_ref = verify.gated_delta_verify(q, k, v, decay, beta, rows, flat, pool, slots, ref_states, True)
    assert torch.equal(pool, before)
    limit = 1e-4 if pool_dtype == torch.float32 else 3e-2
    assert _rel(o, o_ref) < limit and _rel(states, ref_states) < limit, (_rel(o, o_ref), _rel(states, ref_states))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(6, 2, 16, 12), (48, 1, 64, 128)])
@pytest.mark.parametrize("lens", [[1, 37, 9, 64], [2048, 700, 3, 129]])  # up to SSD_SCAN_MAX_LEN: the scan serves whole prefill chunks
def test_ssd_varlen_scan_matches_reference(dtype, shape, lens):
    H, G, P, N = shape
    g = _gen(16)
    dt_bias, A_log, D, pool = _ssd_params(g, H, G, P, N, 6)
    slots = torch.tensor([2, 5, 0, 3], device=DEV)
    T = sum(lens)
    proj = _randn(T, H * P + 2 * G * N + 5, g=g, dtype=dtype)  # strided views, as the layer passes them
    x = proj[:, : H * P].reshape(T, H, P)
    B = proj[:, H * P : H * P + G * N].reshape(T, G, N)
    C = proj[:, H * P + G * N : H * P + 2 * G * N].reshape(T, G, N)
    dt = _randn(T, H, g=g, dtype=dtype) - 1
    pool_ref = pool.clone()
    y = triton_ops.ssd.ssd_varlen_scan(x, dt, dt_bias, (0.0, float("inf")), A_log, B, C, D, 8, lens, pool, slots)
    y_ref = ssd.ssd_varlen(x, dt, dt_bias, (0.0, float("inf")), A_log, B, C, D, 8, lens, pool_ref, slots)
    torch.testing.assert_close(y, y_ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(pool, pool_ref, atol=2e-3, rtol=2e-3)


def _kv_setup(g, dtype, hq, hkv, d, bs, ctx, n):
    num_pages = sum(-(-(c + m) // bs) for c, m in zip(ctx, n)) + 5
    k_cache = _randn(num_pages * bs, hkv, d, g=g, dtype=dtype)
    v_cache = _randn(num_pages * bs, hkv, d, g=g, dtype=dtype)
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(0)).tolist()
    width = max(-(-(c + m) // bs) for c, m in zip(ctx, n))
    tables = torch.full((len(ctx), width), -1, dtype=torch.long)
    for i, (c, m) in enumerate(zip(ctx, n)):
        need = -(-(c + m) // bs)
        tables[i, :need] = torch.tensor([perm.pop() for _ in range(need)])
    return k_cache, v_cache, tables.to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,bs", [(6, 2, 8, 4), (12, 4, 128, 16), (4, 4, 12, 16), (4, 4, 192, 16)])  # 192: Kimi-Linear latent K width
def test_store_kv_and_paged_attention_prefill(dtype, hq, hkv, d, bs):
    g = _gen(7)
    ctx, n = [0, 5, 33, 0], [7, 1, 70, 130]
    k_cache, v_cache, tables = _kv_setup(g, dtype, hq, hkv, d, bs, ctx, n)
    T = sum(n)
    key, value = _randn(T, hkv, d, g=g, dtype=dtype), _randn(T, hkv, d, g=g, dtype=dtype)
    slot_mapping = torch.cat([attention.token_slots(tables[i], c + m, bs)[c:] for i, (c, m) in enumerate(zip(ctx, n))])
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    triton_ops.attention.store_kv(k_cache, v_cache, key, value, slot_mapping)
    attention.store_kv(kc_ref, vc_ref, key, value, slot_mapping)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)
    q = _randn(T, hq, d, g=g, dtype=dtype)
    out = triton_ops.attention.paged_attention(q, k_cache, v_cache, n, ctx, tables, bs, d**-0.5)
    ref = attention.paged_attention(q, k_cache, v_cache, n, ctx, tables, bs, d**-0.5)
    torch.testing.assert_close(out, ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_split_keys_for_a_short_turn_on_a_long_history(dtype, monkeypatch):
    monkeypatch.setattr(triton_ops.attention, "ATTENTION_SPLIT_MIN_KEYS", 64)
    g = _gen(17)
    hq, hkv, d, bs = 12, 4, 32, 16
    ctx, n = [700, 300], [5, 30]
    k_cache, v_cache, tables = _kv_setup(g, dtype, hq, hkv, d, bs, ctx, n)
    q = _randn(sum(n), hq, d, g=g, dtype=dtype)
    out = triton_ops.attention.paged_attention(q, k_cache, v_cache, n, ctx, tables, bs, 0.2)
    ref = attention.paged_attention(q, k_cache, v_cache, n, ctx, tables, bs, 0.2)
    torch.testing.assert_close(out, ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [True, False])
def test_paged_attention_decode_with_device_lengths_and_padding(dtype, split, monkeypatch):
    if not split:  # enough sequences to fill the GPU: one program per (sequence, KV head)
        monkeypatch.setattr(triton_ops.attention, "ATTENTION_DECODE_TARGET_PROGRAMS", 1)
    g = _gen(8)
    hq, hkv, d, bs = 12, 4, 64, 16
    ctx = [1, 40, 300, 17]
    n = [1] * len(ctx)
    k_cache, v_cache, tables = _kv_setup(g, dtype, hq, hkv, d, bs, ctx, n)
    q = _randn(len(ctx) + 1, hq, d, g=g, dtype=dtype)
    # one padding row at the end: context -1, nothing read, nothing written
    cu = torch.arange(len(ctx) + 2, device=DEV)
    ctx_t = torch.tensor([*ctx, -1], device=DEV)
    tables_pad = torch.cat([tables, torch.full((1, tables.shape[1]), -1, device=DEV, dtype=tables.dtype)])
    out = triton_ops.attention.paged_attention(q, k_cache, v_cache, n + [1], ctx + [1], tables_pad, bs, 0.125, cu, ctx_t)
    ref = attention.paged_attention(q[:-1], k_cache, v_cache, n, ctx, tables, bs, 0.125)
    torch.testing.assert_close(out[:-1], ref, **_tol(dtype))
    assert torch.isfinite(out[-1]).all()
    # a transposed (column-major) block table, as the CUDA-graph runner keeps it
    out_t = triton_ops.attention.paged_attention(q, k_cache, v_cache, n + [1], ctx + [1], tables_pad.t().contiguous().t(), bs, 0.125, cu, ctx_t)
    torch.testing.assert_close(out_t, out)


def test_route_softmax_topk():
    g = _gen(9)
    for experts, k in ((4, 2), (64, 6), (40, 3)):
        logits = _randn(33, experts, g=g)
        w, ids = triton_ops.moe.route_softmax_topk(logits, k)
        w_ref, ids_ref = moe.route_softmax_topk(logits, k)
        assert torch.equal(ids, ids_ref)
        torch.testing.assert_close(w, w_ref)


def test_route_softmax_topk_ties_and_padding_rows():
    """Equal logits go to the lower index first; a CUDA-graph padding row (NaN, or all -inf) still
    picks k distinct valid experts, so that the expert kernels read no memory outside the weights."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0], [float("nan")] * 5, [float("-inf")] * 5], device=DEV)
    _, ids = triton_ops.moe.route_softmax_topk(logits, 3)
    assert ids[0].tolist() == [1, 2, 4]
    assert ids[1].tolist() == ids[2].tolist() == [0, 1, 2]


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax(dtype):
    """Rows longer than a chunk, ties within and across chunks (the first index wins), a row of
    -inf, a non-contiguous view, and NaN taken as the largest value, +inf included, as torch.argmax
    does (the first NaN)."""
    g = _gen(14)
    vocab = 3 * triton_ops.sample.ARGMAX_CHUNK + 123
    logits = _randn(6, vocab, g=g, dtype=dtype)
    logits[1, [5000, 9000, 200]] = 50.0  # equal maxima in different chunks
    logits[2, [7, 8]] = 50.0  # within one chunk
    logits[3] = float("-inf")
    logits[4, 10000] = float("nan")
    logits[5, [3, 9000, 9001]] = torch.tensor([float("inf"), float("nan"), float("nan")], dtype=dtype, device=DEV)
    assert torch.equal(triton_ops.sample.argmax(logits), sample.argmax(logits))
    strided = logits[:, ::2]
    assert torch.equal(triton_ops.sample.argmax(strided), sample.argmax(strided))
    out = torch.empty(6, dtype=torch.int64, device=DEV)
    assert triton_ops.sample.argmax(logits, out=out) is out and torch.equal(out, sample.argmax(logits))


def _host(t: torch.Tensor) -> torch.Tensor:
    """A host tensor the GPU can read and write (pinned), as a decode graph's staged inputs."""
    return t.pin_memory() if HAS_CUDA else t


def test_argmax_into_the_host_row_of_the_turn():
    """A decode graph's argmax also leaves the ids in host memory, in the row of turn[1] only."""
    logits = _randn(5, 2 * triton_ops.sample.ARGMAX_CHUNK + 7, g=_gen(15))
    for parity in (0, 1):
        host = _host(torch.full((2, 8), -1, dtype=torch.int64))
        turn = torch.tensor([3, parity, 0], device=DEV)
        out = triton_ops.sample.argmax(logits, host_out=host, turn=turn)
        ref = _host(torch.full((2, 8), -1, dtype=torch.int64))
        sample.argmax(logits.cpu(), host_out=ref, turn=turn.cpu())
        if HAS_CUDA:
            torch.cuda.synchronize()
        assert torch.equal(out.cpu(), sample.argmax(logits).cpu())
        assert torch.equal(host, ref) and host[parity, :5].tolist() == out.tolist()
        assert host[1 - parity].eq(-1).all() and host[parity, 5:].eq(-1).all()


def test_take_decode_inputs():
    """Replays take the two staged buffers in turn, each its own length of words (longer than one
    pass of the whole grid, and shorter than one program's block), gather each row's token from
    `sampled` or as sent, and count themselves; the words past a buffer's length are not written."""
    block = triton_ops.staging.TAKE_BLOCK
    words = 2 * triton_ops.staging.TAKE_PROGRAMS * block + 78  # even: each header an aligned int64
    columns, b = 8, 5
    g = torch.Generator().manual_seed(16)
    staged = torch.randint(-(2**31), 2**31 - 1, (2, staging.HEADER_WORDS + words), dtype=torch.int32, generator=g)
    rows = staged[:, staging.HEADER_WORDS : staging.HEADER_WORDS + 2 * (staging.TOKEN_ROW + 1) * columns].view(torch.int64).view(2, -1, columns)
    rows[:, staging.TOKEN_ROW] = torch.tensor([[3, -1, 0, -1, 6, 2, 2, 2], [-1, -1, 1, 7, -1, 2, 2, 2]])  # past b: not read
    staged = _host(staged)
    lengths = (words, rows[0].numel() * 2 + 1)
    for parity, n in enumerate(lengths):
        staging.staged_length(staged, parity)[0] = n
    sampled = torch.arange(100, 110, device=DEV)
    fast_turn = torch.tensor([7, 0, 0], device=DEV)
    ref_turn = fast_turn.clone()
    for replay in range(3):
        parity = (7 + replay) % 2
        n = lengths[parity]
        fast, ref = (torch.zeros(words, dtype=torch.int32, device=DEV) for _ in range(2))
        fast_ids, ref_ids = (torch.full((b,), -5, dtype=torch.int64, device=DEV) for _ in range(2))
        triton_ops.staging.take_decode_inputs(staged, fast, fast_turn, sampled, fast_ids, columns)
        staging.take_decode_inputs(staged, ref, ref_turn, sampled, ref_ids, columns)
        assert torch.equal(fast[:n], ref[:n]) and torch.equal(fast[:n].cpu(), staged[parity, staging.HEADER_WORDS : staging.HEADER_WORDS + n])
        assert fast[n:].eq(0).all()
        where, sent = rows[parity, staging.TOKEN_ROW, :b].tolist(), rows[parity, 0, :b].tolist()
        assert fast_ids.tolist() == ref_ids.tolist() == [100 + w if w >= 0 else s for w, s in zip(where, sent)]
        assert fast_turn.tolist() == ref_turn.tolist() == [8 + replay, parity, 0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual_fp32", [False, True])
def test_add_rms_norm_linear(dtype, residual_fp32):
    g = _gen(13)
    # Granite's router at 1, 64 and 101 tokens (on an H200 twice the rows a program for two tokens at 64
    # and 101, the last program of 101 with one), and other shapes
    for tokens, hidden, outputs, scale in (
        (1, 1536, 64, 1.0),
        (64, 1536, 64, 0.22),
        (101, 1536, 64, 1.0),
        (33, 96, 4, 0.22),
        (70, 200, 40, 1.0),
        (3, 48, 600, 1.0),
    ):
        w, lin = _randn(hidden, g=g, dtype=dtype), _randn(outputs, hidden, g=g, dtype=dtype) * 0.2  # weights first: see PDL_LAUNCH
        x = _randn(tokens, hidden, g=g, dtype=dtype)
        r = _randn(tokens, hidden, g=g, dtype=torch.float32 if residual_fp32 else dtype)
        h, stream, out = triton_ops.norm.add_rms_norm_linear(x, r, w, 1e-5, scale, lin)
        h_ref, stream_ref, out_ref = norm.add_rms_norm_linear(x, r, w, 1e-5, scale, lin)
        assert stream.dtype == stream_ref.dtype and h.dtype == h_ref.dtype and out.dtype == out_ref.dtype
        torch.testing.assert_close(stream, stream_ref, **(dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=0)))
        torch.testing.assert_close(h, h_ref, **_tol(dtype))
        torch.testing.assert_close(out, out_ref, **_tol(dtype))


def _check_moe_experts(dtype, tokens, hidden, inter, experts, k, gated, shared_inter, scale, seed):
    """The fast `moe_experts` against the reference on random weights (scaled by `scale`) and routing."""
    g = _gen(seed)
    w_in = _randn(experts, (2 if gated else 1) * inter, hidden, g=g, dtype=dtype) * scale
    w_out = _randn(experts, hidden, inter, g=g, dtype=dtype) * scale
    shared = None
    if shared_inter:  # an always-on expert, narrower or wider than the routed ones
        shared = (
            _randn((2 if gated else 1) * shared_inter, hidden, g=g, dtype=dtype) * scale,
            _randn(hidden, shared_inter, g=g, dtype=dtype) * scale,
        )
    x = _randn(tokens, hidden, g=g, dtype=dtype)  # after the weights: some kernels read weights before the PDL wait
    weights, ids = moe.route_softmax_topk(_randn(tokens, experts, g=g), k)
    act = F.silu if gated else moe.relu2
    out = triton_ops.moe.moe_experts(x, w_in, w_out, weights, ids, act, gated, shared)
    ref = moe.moe_experts(x, w_in, w_out, weights, ids, act, gated, shared)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:
        assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 40, 700])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("shared_inter", [None, 24, 80])
def test_moe_experts(dtype, tokens, gated, shared_inter):
    if INTERPRET and not HAS_CUDA and tokens > 40:
        pytest.skip("slow in the interpreter")
    _check_moe_experts(dtype, tokens, 96, 40, 8, 3, gated, shared_inter, scale=0.2, seed=10)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "tokens, hidden, inter, experts, k, gated, shared_inter",
    [(1, 97, 1100, 8, 6, True, None), (2, 97, 1100, 8, 6, False, 700), (3, 33, 600, 8, 3, True, 1030), (1, 2100, 40, 6, 6, True, 24)],
)
def test_moe_gemv_blocks(dtype, tokens, hidden, inter, experts, k, gated, shared_inter):
    """The per-pair GEMVs (few tokens) over several K blocks (routed, shared, and in the up
    projection), a last column block cut short (odd hidden sizes) and a top-k that is not a power of two."""
    assert tokens * k <= triton_ops.moe.MOE_GEMV_MAX_PAIRS
    _check_moe_experts(dtype, tokens, hidden, inter, experts, k, gated, shared_inter, scale=0.05, seed=15)


@pytest.mark.parametrize("align", ["torch", "triton"])
@pytest.mark.parametrize("tokens, skewed", [(50, False), (700, True)])
def test_moe_align_blocks_cover_every_pair_once(align, tokens, skewed):
    g = _gen(11)
    ids = torch.stack([torch.randperm(16, generator=torch.Generator().manual_seed(i))[:4] for i in range(tokens)])
    if skewed:  # one expert takes over 2,100 of the 2,800 pairs: its run spans more than one chunk of 128 blocks
        ids[:, :3] = 3
    ids = ids.to(DEV)
    if align == "torch":
        sorted_ids, block_expert = triton_ops.moe.moe_align(ids, 16, 16)
    else:  # the kernel also zeroes the grouped GEMM's tile counts
        done = torch.full((41,), 7, dtype=torch.int32, device=DEV)
        sorted_ids, block_expert = triton_ops.moe.moe_align_triton(ids, 16, 16, done)
        assert not done.any()
    ref_sorted, ref_blocks = triton_ops.moe.moe_align(ids, 16, 16)
    assert torch.equal(sorted_ids, ref_sorted) and torch.equal(block_expert, ref_blocks)
    flat = ids.reshape(-1)
    real = sorted_ids < flat.numel()
    assert sorted(sorted_ids[real].tolist()) == list(range(flat.numel()))
    experts_of_rows = block_expert.repeat_interleave(16)[: sorted_ids.numel()]
    assert torch.equal(experts_of_rows[real], flat[sorted_ids[real]])
    del g


# (tokens, experts, top-k, the op routes and sorts in one launch): the GEMV at 1 token; one launch up
# to TOPK_ALIGN_MAX_LOGITS (7 of 64; 5 of 48, whose padding experts the masks must hide); the kernel
# alone checked up to 128 tokens (40 and 128 of 64, 8 of 72); 129 apart
@pytest.mark.parametrize(
    "tokens,experts,k,fused",
    [
        (1, 64, 6, False),
        (7, 64, 6, True),
        (5, 48, 8, True),
        (40, 64, 6, False),
        (128, 64, 6, False),
        (8, 72, 9, False),
        (129, 64, 6, False),
    ],
)
def test_route_softmax_topk_align(tokens, experts, k, fused, monkeypatch):
    """Routing and sorting in one launch against `route_softmax_topk` and `moe_align` (exactly: the
    same ids, pairs in the same order), padding rows of NaN and -inf included; the op, through the
    path its batch takes, against the reference."""
    bm = 16
    logits = _randn(tokens, experts, g=_gen(16))
    logits[0, [3, 9]] = logits[0].max() + 1  # a tie for the first place
    if tokens > 2:
        logits[1] = float("nan")
        logits[2] = float("-inf")
    if tokens <= 128:  # the kernel holds 128 x 64 logits a program, beyond the op's threshold
        done = torch.full((300,), 7, dtype=torch.int32, device=DEV)  # the grouped GEMM's tile counts, zeroed on the way
        weights, ids, sorted_ids, block_expert = triton_ops.moe.route_softmax_topk_align(logits, k, bm, done)
        assert not done.any()
        w_ref, ids_ref = triton_ops.moe.route_softmax_topk(logits, k)
        assert torch.equal(ids, ids_ref)
        torch.testing.assert_close(weights, w_ref, equal_nan=True)  # rows of NaN or -inf: NaN weights in both
        ref_sorted, ref_blocks = triton_ops.moe.moe_align(ids_ref, experts, bm)
        assert torch.equal(sorted_ids, ref_sorted) and torch.equal(block_expert, ref_blocks)
    one_launch = []
    align = triton_ops.moe.route_softmax_topk_align
    monkeypatch.setattr(triton_ops.moe, "route_softmax_topk_align", lambda *a: one_launch.append(a) or align(*a))
    g = _gen(17)
    w_in, w_out = _randn(experts, 2 * 24, 40, g=g) * 0.2, _randn(experts, 40, 24, g=g) * 0.2
    shared = (_randn(2 * 32, 40, g=g) * 0.2, _randn(40, 32, g=g) * 0.2)
    x = _randn(tokens, 40, g=g)
    out = triton_ops.moe.softmax_topk_experts(x, logits, k, w_in, w_out, F.silu, True, shared)
    ref = moe.softmax_topk_experts(x, logits, k, w_in, w_out, F.silu, True, shared)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4, equal_nan=True)
    assert bool(one_launch) == fused


# ---- whole models: greedy tokens of the fast path == the reference path -------------------------
# The fast path runs with CUDA graphs and overlapped steps (tokens fed to graphs from the device);
# the reference path steps one at a time.


def _greedy_run(path: str, fast: bool, graphs: bool, dtype: str, prompts: list[list[int]], max_tokens: int):
    from engine_utils import greedy, make_engine, record_logits, run_to_end

    engine = make_engine(
        path, device="cuda", dtype=dtype, enable_fast_ops=fast, enable_cuda_graph=graphs, enable_overlap_schedule=graphs, max_num_batched_tokens=64
    )
    logits = record_logits(engine)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(max_tokens))
    done = run_to_end(engine)
    return [done[f"r{i}"].token_ids for i in range(len(prompts))], logits, engine


@needs_cuda
@pytest.mark.parametrize(
    "kind",
    [
        *("granite", "mamba2", "nemotron", "bamba", "granite_rope", "falcon_h1", "falcon_h1_tied"),
        *("qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2", "kimi_linear", "kimi_linear_qlora"),
    ],
)
def test_greedy_tokens_fast_path_equal_reference(kind, checkpoint_dir):
    from engine_utils import random_prompt

    from engram.ops.dispatch import REFERENCE, use_kernels

    path = checkpoint_dir(kind)
    prompts = [random_prompt(n, seed=n) for n in (3, 29, 11, 52, 1, 70)]
    try:
        ref_tokens, ref_logits, _ = _greedy_run(path, False, False, "float32", prompts, 12)
        fast_tokens, fast_logits, engine = _greedy_run(path, True, True, "float32", prompts, 12)
        assert engine.runner.num_graph_replays > 0, "decode steps ran from CUDA graphs"
        assert fast_tokens == ref_tokens
        diff = max(float((a.cpu() - b.cpu()).abs().max()) for a, b in zip(fast_logits, ref_logits) if a.numel())
        print(f"{kind}: float32 max |logit diff| fast vs reference = {diff:.2e}")
        bf_tokens, _, _ = _greedy_run(path, True, True, "bfloat16", prompts, 12)
        ref_bf, _, _ = _greedy_run(path, False, False, "bfloat16", prompts, 12)
        same = sum(a == b for x, y in zip(bf_tokens, ref_bf) for a, b in zip(x, y)) / sum(len(x) for x in ref_bf)
        print(f"{kind}: bfloat16 greedy tokens equal fast vs reference: {same:.1%}")
    finally:
        use_kernels(REFERENCE)


@needs_cuda
@pytest.mark.parametrize("kind", ["granite", "mamba2", "nemotron", "bamba", "falcon_h1", "qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2"])
@pytest.mark.parametrize("wrong", [False, True])
def test_verify_graphs_give_plain_greedy_tokens(kind, wrong, checkpoint_dir):
    """Speculative steps replayed from verify graphs (and their commits from commit graphs), drafts
    all kept or all rejected, short ones padded: float32 greedy tokens equal plain decoding's on
    the fast path (decode graphs), all graphs captured before the requests."""
    from engine_utils import ContinuationDrafter, greedy, make_engine, random_prompt, run_to_end

    from engram.ops.dispatch import REFERENCE, use_kernels

    path = checkpoint_dir(kind)
    prompts = [random_prompt(n, seed=n) for n in (3, 29, 11, 52, 1, 70)]
    spec = '{"method": "ngram", "num_speculative_tokens": 4}'
    try:
        plain, _, _ = _greedy_run(path, True, True, "float32", prompts, 16)
        engine = make_engine(path, device="cuda", dtype="float32", speculative_config=spec, max_num_batched_tokens=64)
        for kind_, size in engine.runner.capturable_buckets():
            engine.runner.capture(kind_, size)
        engine.speculator.drafter = ContinuationDrafter([p + out for p, out in zip(prompts, plain)], wrong)
        captures, replays = engine.runner.num_graph_captures, engine.runner.num_graph_replays
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, greedy(16))
        done = run_to_end(engine)
        assert [done[f"r{i}"].token_ids for i in range(len(prompts))] == plain
        stats = engine.stats()
        assert engine.runner.num_graph_captures == captures and engine.runner.num_graph_replays > replays
        assert stats.spec_draft_tokens_total > 0 and (stats.spec_accepted_tokens_total == 0) == wrong
    finally:
        use_kernels(REFERENCE)


@needs_cuda
@pytest.mark.parametrize("head", [60, 300])
@pytest.mark.parametrize("kind", ["granite", "nemotron", "qwen3_next", "lfm2", "kimi_linear"])
def test_resumed_turn_through_prefill_graphs_equals_reference(kind, head, checkpoint_dir):
    """A new prompt (`head` tokens: buckets 64 and 512) and a short turn on top of its captured
    state each run as one single-sequence prefill (a prefill CUDA graph on the fast path): same
    tokens as the reference path, which recomputes nothing either."""
    from engine_utils import greedy, make_engine, random_prompt, run_to_end

    from engram.ops.dispatch import REFERENCE, use_kernels

    path = checkpoint_dir(kind)
    prompt = random_prompt(head + 30, seed=11)
    results = []
    try:
        for fast in (False, True):
            engine = make_engine(path, device="cuda", dtype="float32", enable_fast_ops=fast, enable_cuda_graph=fast)
            engine.add_request("head", prompt[:head], greedy(1), capture_state=True)
            state = run_to_end(engine)["head"].state
            replays = engine.runner.num_graph_replays
            assert replays > 0 or not fast  # the head's prefill (one token out: no decode step)
            engine.add_request("turn", prompt, greedy(6), initial_state=state)
            results.append(run_to_end(engine)["turn"].token_ids)
            if fast:
                assert engine.runner.num_graph_replays > replays
        assert results[0] == results[1]
    finally:
        use_kernels(REFERENCE)
