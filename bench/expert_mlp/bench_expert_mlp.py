#!/usr/bin/env python3
"""Expert-MLP benchmark: Poise's SM90 kernels against the eager PyTorch baseline, same inputs.

One EP rank's local expert compute, forward and forward+backward, at the DeepSeek-V3 EP8 rank and
Qwen3-30B-A3B shapes, balanced routing and peak/mean ~3. The same torch tensors feed both sides
(Poise through ctypes on raw pointers). Poise's timed region covers the same work as the baseline:
routing layout (one device kernel in the bench library, standing in for Poise's route stage), gathering token rows into expert-grouped order,
the grouped GEMMs with SwiGLU and score multiply fused, and the top-k combine into out_TD; backward
adds the grad_out gather, dgrad/wgrad GEMMs, the grad_x combine and the grad_scores gather.
`*_kernels_ms` leave out the layout and the x gather (the EP dispatch writes grouped rows itself).

Usage: python3 bench_expert_mlp.py --lib path/libpoise_expert_mlp_bench.so --out results.json
"""
import argparse
import ctypes
import json
import math
import os
import pathlib
import statistics
import sys
import time
import types

import torch
import torch.nn.functional as Fn

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # run as a script or loaded by path (tests)
from smi_sampler import SmiSampler, device_identity, median_clock_power  # noqa: E402

SHAPES = {
    # name: (T, D, F, E_local, K)
    "deepseek_v3_ep8_rank": (4096, 7168, 2048, 32, 8),
    "qwen3_30b_a3b": (8192, 2048, 768, 128, 8),
}
# Diagnostics only (power_probe.py, profile_gemm.py; never in the bench's records): one expert holding
# 8192 rows, D = F = 8192, so FPROP W2 is cuBLAS's dense 8192^3 problem (dense_8192x2048: D = 2048,
# FPROP W2 = 8192 x 2048 x 8192, whose weights stay in L2; dense_2048x8192: 2048 rows, whose 32 MB stay
# in L2 while the tile order streams each weight slice once).
DIAGNOSTIC_SHAPES = {"dense_8192": (8192, 8192, 8192, 1, 1), "dense_8192x2048": (8192, 2048, 8192, 1, 1),
                     "dense_2048x8192": (2048, 8192, 8192, 1, 1)}

c_void_p, c_int64, c_int, c_float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def load_lib(path):
    lib = ctypes.CDLL(path)
    lib.pb_last_error.restype = ctypes.c_char_p
    lib.pb_set_problem.argtypes = [c_void_p, c_void_p, c_int64, c_int64, c_int64, c_int64, c_int, c_int, c_float, c_float]
    lib.pb_set_problem.restype = ctypes.c_int
    lib.pb_score_partials.argtypes = [c_int64]
    lib.pb_score_partials.restype = c_int64
    sigs = {
        "pb_fprop_w13": [c_void_p] * 5,
        "pb_fprop_w2": [c_void_p] * 5,
        "pb_dgrad_w2": [c_void_p] * 8,
        "pb_dgrad_w13": [c_void_p] * 4,
        "pb_wgrad_w2": [c_void_p, c_void_p, c_void_p, c_int, c_int, c_void_p],
        "pb_wgrad_w13": [c_void_p, c_void_p, c_void_p, c_int, c_int, c_void_p],
        "pb_wgrad_w2_combine": [c_void_p, c_void_p, c_void_p, c_int, c_int, c_void_p, c_int64, c_int64, c_void_p,
                                c_void_p, c_void_p, c_int64, c_void_p, c_void_p],
        "pb_wgrad_w13_combine": [c_void_p, c_void_p, c_void_p, c_int, c_int, c_void_p, c_int64, c_int64, c_void_p,
                                 c_void_p, c_void_p, c_int64, c_void_p, c_void_p],
        "pb_routing_layout": [c_void_p, c_void_p, c_int64, c_int64, c_void_p, c_void_p, c_void_p, c_void_p, c_int64,
                              c_void_p, c_void_p],
        "pb_fprop_w2_combine": [c_void_p, c_void_p, c_void_p, c_void_p, c_int64, c_void_p, c_void_p],
        "pb_dgrad_w13_combine": [c_void_p, c_void_p, c_void_p, c_int64, c_void_p, c_void_p],
        "pb_scatter_rows": [c_void_p, c_int64, c_int64, c_int64, c_void_p, c_void_p, c_void_p],
        "pb_combine_rows": [c_void_p, c_int64, c_int64, c_int64, c_void_p, c_void_p, c_void_p],
        "pb_gather_scalars": [c_void_p, c_int64, c_void_p, c_int64, c_void_p, c_void_p],
        "pb_gather_rows_streamed": [c_void_p, c_int64, c_int64, c_void_p, c_void_p, c_int, c_void_p],
        "pb_fprop_w13_streamed": [c_void_p] * 5,
        "pb_dgrad_w2_streamed": [c_void_p] * 8,
    }
    for name, args in sigs.items():
        if (name.endswith("_combine") or "streamed" in name) and not hasattr(lib, name):
            continue  # libraries before the combine side job / the fused forward combine / streamed rows
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = c_int
    return lib


def open_poise(path):
    """The bench library at `path`, wrapped for calls (the profiling scripts' entry point)."""
    return Poise(load_lib(path))


def ptr(t):
    return None if t is None else t.data_ptr()


def current_raw_stream():
    """torch's current CUDA stream as a handle, without building a torch.cuda.Stream object (a few us
    per call: the timed blocks start on an idle GPU, so their first launches wait for the host)."""
    return torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())


class Poise:
    """Calls into the ctypes library on torch's current stream, raising on any reported error."""

    def __init__(self, lib):
        self.lib = lib

    def __getattr__(self, name):
        fn = getattr(self.lib, "pb_" + name)

        def call(*args):
            conv = [ptr(a) if (a is None or isinstance(a, torch.Tensor)) else a for a in args]
            if fn(*conv, current_raw_stream()) != 0:
                raise RuntimeError(f"{name}: {self.lib.pb_last_error().decode()}")

        setattr(self, name, call)  # later calls find it without __getattr__
        return call


# ---------------------------------------------------------------- routing
def make_routing(T, E, K, target_skew, gen):
    """ids [T, K] (distinct experts per token) with peak/mean rows per expert ~ target_skew.
    target_skew 0 (a diagnostic, not a benchmark case): every expert exactly T*K/E rows, token t on
    experts t*K .. t*K + K - 1 (mod E), so no expert's rows end inside a 128-row block when T*K/E is
    a multiple of 128: the padding's cost is the difference to the balanced case."""
    dev = "cuda"
    if target_skew == 0.0:
        if E % K or (T * K) % E:
            raise ValueError(f"aligned routing (skew 0) needs K | E and E | T*K, got T={T} E={E} K={K}")
        t = torch.arange(T, device=dev, dtype=torch.int64)[:, None]
        return (t * K + torch.arange(K, device=dev, dtype=torch.int64)[None, :]) % E, 1.0

    def sample(s):
        w = (torch.arange(E, device=dev, dtype=torch.float64) + 1.0) ** (-s)
        w = w[torch.randperm(E, device=dev, generator=gen)]
        ids = torch.multinomial(w.float().expand(T, E), K, replacement=False, generator=gen)
        counts = torch.bincount(ids.flatten(), minlength=E).double()
        return ids, (counts.max() / counts.mean()).item()

    if target_skew <= 1.0:
        return sample(0.0)
    lo, hi = 0.0, 4.0
    best = sample(0.0)
    for _ in range(14):
        mid = 0.5 * (lo + hi)
        ids, skew = sample(mid)
        if abs(skew - target_skew) < abs(best[1] - target_skew):
            best = (ids, skew)
        if skew < target_skew:
            lo = mid
        else:
            hi = mid
    return best


def routing_name(target_skew):
    """How records and logs name make_routing's target: 0 the aligned diagnostic, <= 1 balanced."""
    if target_skew == 0.0:
        return "aligned"
    return "balanced" if target_skew <= 1 else f"peak/mean~{target_skew}"


# ---------------------------------------------------------------- baseline
def baseline_forward(x, ids, scores, w13, w2):
    """Eager PyTorch: sort-permute + _grouped_mm + SwiGLU + _grouped_mm + score multiply + index_add_."""
    T, K = ids.shape
    E = w13.shape[0]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0, dtype=torch.int32)
    tok = order // K
    xs = x.index_select(0, tok)
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    g, u = h.chunk(2, dim=-1)
    a = Fn.silu(g) * u
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
    y = y * scores.flatten().index_select(0, order).unsqueeze(1).to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tok, y)


def saved_bytes_of(fn, exclude):
    """Bytes autograd keeps for backward (unique storages, inputs and parameters excluded)."""
    storages = {}
    skip = {t.untyped_storage().data_ptr() for t in exclude}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


# ---------------------------------------------------------------- poise
class PoiseBlock:
    """The expert block on Poise kernels, with static buffers of R = T*K + 128*E rows."""

    def __init__(self, P, T, D, F, E, K):
        self.P, self.T, self.D, self.F, self.E, self.K = P, T, D, F, E, K
        self.R = T * K + 128 * E
        dev, bf = "cuda", torch.bfloat16
        R = self.R
        self.x_rows = torch.empty(R, D, device=dev, dtype=bf)
        self.h13 = torch.empty(R, 2 * F, device=dev, dtype=bf)
        self.a = torch.empty(R, F, device=dev, dtype=bf)
        self.y_rows = torch.empty(R, D, device=dev, dtype=bf)
        self.gy_rows = torch.empty(R, D, device=dev, dtype=bf)
        self.gh13 = torch.empty(R, 2 * F, device=dev, dtype=bf)
        self.gx_rows = torch.empty(R, D, device=dev, dtype=bf)
        # The routing score's gradient per row, in DGRAD W2's per-tile pieces (summed in order).
        self.score_parts = P.lib.pb_score_partials(F)
        self.grad_score_partials = torch.empty(R, self.score_parts, device=dev, dtype=torch.float32)
        # The backward's grad_x combine and score sums as the WGRADs' side job (POISE_BENCH_SIDE_COMBINE=0:
        # separate glue kernels, for A/B runs; libraries without it: separate).
        self.side_combine = hasattr(P.lib, "pb_wgrad_w13_combine") and os.environ.get("POISE_BENCH_SIDE_COMBINE") != "0"
        # Its first third of the tokens (WGRAD W2's share of the two WGRADs' FLOPs) ride in WGRAD W2.
        self.side_combine_tokens = T // 3
        # The top-k combines fused into FPROP W2 (out) and DGRAD W13 (grad_x): bf16 additions by token
        # in L2, not bitwise reproducible. Off by default; the bench times both (run_case).
        self.fused_combine = False
        # POISE_BENCH_STREAMED_ROWS=1: the x gather and the grad_out scatter streamed under FPROP W13 /
        # DGRAD W2 (sm90::StreamedRows: the GEMM starts at once and waits per row block) instead of copy
        # kernels first. Off by default: on one GPU it was no faster (session 19, performance.md v28a);
        # the bench times it as an A/B (run_case). POISE_BENCH_GATHER_CTAS: the streamed gather's CTAs.
        self.can_stream_rows = hasattr(P.lib, "pb_gather_rows_streamed")
        self.streamed_rows = self.can_stream_rows and os.environ.get("POISE_BENCH_STREAMED_ROWS") == "1"
        self.gather_ctas = int(os.environ.get("POISE_BENCH_GATHER_CTAS", "32"))
        # POISE_BENCH_W13_LAYOUT=interleaved / POISE_BENCH_ACTIVATION=clamped (timing probes only: the
        # bench's weights and baseline are blocked W13 with plain SwiGLU, so outputs then differ).
        self.interleaved = int(os.environ.get("POISE_BENCH_W13_LAYOUT", "blocked") == "interleaved")
        self.clamped = int(os.environ.get("POISE_BENCH_ACTIVATION", "swiglu") == "clamped")

    def layout(self, ids, scores):
        """Routing layout on the device in one kernel (stand-in for Poise's route stage)."""
        T, K, E, R = self.T, self.K, self.E, self.R
        TK = T * K
        if not hasattr(self, "lay"):
            dev = "cuda"
            self.lay = dict(offsets=torch.empty(E, device=dev, dtype=torch.int32),
                            counts=torch.empty(E, device=dev, dtype=torch.int32),
                            row_of_tk=torch.empty(TK, device=dev, dtype=torch.int32),
                            scores_R=torch.zeros(R, device=dev, dtype=torch.float32),
                            token_of_row=torch.zeros(R, device=dev, dtype=torch.int32))
        L = self.lay
        self.P.routing_layout(ids, scores, TK, E, L["counts"], L["offsets"], L["row_of_tk"], L["scores_R"], K,
                              L["token_of_row"])
        if self.P.lib.pb_set_problem(L["offsets"].data_ptr(), L["counts"].data_ptr(), E, R, self.D, self.F,
                                     self.interleaved, self.clamped, 1.702, 7.0) != 0:
            raise RuntimeError(self.P.lib.pb_last_error().decode())

    def gather_x(self, x):
        self.P.scatter_rows(self.lay["row_of_tk"], self.T * self.K, self.K, self.D, x, self.x_rows)

    def forward_steps(self, x, ids, scores, w13, w2, out, save_h13=True, glue=True):
        """The forward as (name, call) steps in launch order: what forward runs and profile_chain times.
        glue=False: the kernels after the layout and the x gather (forward_kernels)."""
        P = self.P
        h13 = self.h13 if save_h13 else None
        if glue:
            yield "layout", lambda: self.layout(ids, scores)
            if self.streamed_rows:
                yield "gather_x+fprop_w13", lambda: self.streamed(x, self.x_rows, P.fprop_w13_streamed,
                                                                  self.x_rows, w13, self.a, h13)
            else:
                yield "gather_x", lambda: self.gather_x(x)
        if not (glue and self.streamed_rows):
            yield "fprop_w13", lambda: P.fprop_w13(self.x_rows, w13, self.a, h13)
        if self.fused_combine:
            yield "fprop_w2_fused_combine", lambda: self.fprop_w2_fused_combine(w2, out)
            return
        yield "fprop_w2", lambda: P.fprop_w2(self.a, w2, self.lay["scores_R"], self.y_rows)
        yield "combine", lambda: self.combine(self.y_rows, out)

    def forward_kernels(self, w13, w2, out, save_h13=True):
        for _, call in self.forward_steps(None, None, None, w13, w2, out, save_h13, glue=False):
            call()

    def streamed(self, src_TD, dst_RD, gemm, *gemm_args):
        """dst_RD's rows gathered from src_TD while `gemm` (FPROP W13 or DGRAD W2) runs over them."""
        self.P.gather_rows_streamed(self.lay["token_of_row"], self.T, self.D, src_TD, dst_RD, self.gather_ctas)
        gemm(*gemm_args)

    def combine(self, rows_RD, out_TD):
        """The top-k combine of grouped rows into token rows (glue kernel: fp32 sums in k order)."""
        self.P.combine_rows(self.lay["row_of_tk"], self.T, self.K, self.D, rows_RD, out_TD)

    def fprop_w2_fused_combine(self, w2, out):
        """FPROP W2 adding its scored rows into out by token (bf16, no fixed order), out zeroed first."""
        out.zero_()
        self.P.fprop_w2_combine(self.a, w2, self.lay["scores_R"], self.lay["token_of_row"], self.T, out)

    def dgrad_w13_fused_combine(self, w13, grad_x):
        """DGRAD W13 adding its rows into grad_x by token (bf16, no fixed order), grad_x zeroed first."""
        grad_x.zero_()
        self.P.dgrad_w13_combine(self.gh13, w13, self.lay["token_of_row"], self.T, grad_x)

    def forward(self, x, ids, scores, w13, w2, out):
        for _, call in self.forward_steps(x, ids, scores, w13, w2, out):
            call()

    def backward_steps(self, grad_out, w13, w2, grad_x, grad_w13, grad_w2, grad_scores_TK):
        """The backward as (name, call) steps in launch order (a forward has run): what backward runs and
        profile_chain times."""
        P, L = self.P, self.lay
        dgrad_w2_args = (self.gy_rows, w2, self.h13, L["scores_R"], self.gh13, self.a, self.grad_score_partials)
        if self.streamed_rows:
            yield "scatter_grad+dgrad_w2", lambda: self.streamed(grad_out, self.gy_rows, P.dgrad_w2_streamed,
                                                                 *dgrad_w2_args)
        else:
            yield "scatter_grad", lambda: P.scatter_rows(L["row_of_tk"], self.T * self.K, self.K, self.D, grad_out,
                                                         self.gy_rows)
            yield "dgrad_w2", lambda: P.dgrad_w2(*dgrad_w2_args)
        if self.fused_combine:
            yield "dgrad_w13_fused_combine", lambda: self.dgrad_w13_fused_combine(w13, grad_x)
            yield "wgrad_w2", lambda: P.wgrad_w2(self.gy_rows, self.a, grad_w2, 0, 0)
            yield "wgrad_w13", lambda: P.wgrad_w13(self.gh13, self.x_rows, grad_w13, 0, 0)
            yield "score_sums", lambda: self.score_sums(grad_scores_TK)
            return
        if self.side_combine:
            yield "dgrad_w13", lambda: P.dgrad_w13(self.gh13, w13, self.gx_rows)
            T1 = self.side_combine_tokens
            yield "wgrad_w2+combine", lambda: self.wgrad_w2_with_combine(grad_w2, grad_x, grad_scores_TK, T1)
            yield "wgrad_w13+combine", lambda: self.wgrad_w13_with_combine(grad_w13, grad_x, grad_scores_TK, T1)
            return
        yield "wgrad_w2", lambda: P.wgrad_w2(self.gy_rows, self.a, grad_w2, 0, 0)
        yield "dgrad_w13", lambda: P.dgrad_w13(self.gh13, w13, self.gx_rows)
        yield "wgrad_w13", lambda: P.wgrad_w13(self.gh13, self.x_rows, grad_w13, 0, 0)
        yield "combine_grad", lambda: self.combine(self.gx_rows, grad_x)
        yield "score_sums", lambda: self.score_sums(grad_scores_TK)

    def backward(self, grad_out, w13, w2, grad_x, grad_w13, grad_w2, grad_scores_TK):
        for _, call in self.backward_steps(grad_out, w13, w2, grad_x, grad_w13, grad_w2, grad_scores_TK):
            call()

    def combine_glue(self, grad_x, grad_scores_TK):
        """grad_x and grad_scores as separate glue kernels (DGRAD W13 and DGRAD W2 must have run)."""
        self.combine(self.gx_rows, grad_x)
        self.score_sums(grad_scores_TK)

    def score_sums(self, grad_scores_TK):
        """grad_scores of every (token, k): its row's DGRAD W2 score pieces summed in order (glue kernel)."""
        self.P.gather_scalars(self.lay["row_of_tk"], self.T * self.K, self.grad_score_partials, self.score_parts,
                              grad_scores_TK)

    def wgrads_with_combine(self, grad_w13, grad_w2, grad_x, grad_scores_TK):
        """The two WGRADs, with grad_x and grad_scores from their idle producer warps while they compute
        (DGRAD W13 must have run): side_combine_tokens ride in WGRAD W2, the rest in WGRAD W13."""
        T1 = self.side_combine_tokens
        self.wgrad_w2_with_combine(grad_w2, grad_x, grad_scores_TK, T1)
        self.wgrad_w13_with_combine(grad_w13, grad_x, grad_scores_TK, T1)

    def wgrad_w2_with_combine(self, grad_w2, grad_x, grad_scores_TK, tokens):
        """WGRAD W2 with the combine of tokens [0, tokens) as its side job (DGRAD W13 must have run)."""
        self.P.wgrad_w2_combine(self.gy_rows, self.a, grad_w2, 0, 0, self.lay["row_of_tk"], tokens, self.K,
                                self.gx_rows, grad_x, self.grad_score_partials, self.score_parts, grad_scores_TK)

    def wgrad_w13_with_combine(self, grad_w13, grad_x, grad_scores_TK, first_token=0):
        """WGRAD W13 with the combine of tokens [first_token, T) as its side job (DGRAD W13 must have run)."""
        t0, K = first_token, self.K
        self.P.wgrad_w13_combine(self.gh13, self.x_rows, grad_w13, 0, 0, self.lay["row_of_tk"][t0 * K:], self.T - t0,
                                 K, self.gx_rows, grad_x[t0:], self.grad_score_partials, self.score_parts,
                                 grad_scores_TK[t0:])

    def gemm_calls(self, w13, w2, grad_w13, grad_w2):
        """The six GEMMs on this block's buffers (a forward and backward filled them), name -> call."""
        P, L = self.P, self.lay
        return {
            "fprop_w13": lambda: P.fprop_w13(self.x_rows, w13, self.a, self.h13),
            "fprop_w2": lambda: P.fprop_w2(self.a, w2, L["scores_R"], self.y_rows),
            "dgrad_w2": lambda: P.dgrad_w2(self.gy_rows, w2, self.h13, L["scores_R"], self.gh13, self.a,
                                           self.grad_score_partials),
            "dgrad_w13": lambda: P.dgrad_w13(self.gh13, w13, self.gx_rows),
            "wgrad_w2": lambda: P.wgrad_w2(self.gy_rows, self.a, grad_w2, 0, 0),
            "wgrad_w13": lambda: P.wgrad_w13(self.gh13, self.x_rows, grad_w13, 0, 0),
        }

    def saved_bytes(self):
        # What backward needs from forward: grouped x rows, h13 (bf16), the routing layout, scores.
        L = self.lay
        tensors = [self.x_rows, self.h13, L["row_of_tk"], L["scores_R"], L["offsets"], L["counts"]]
        return sum(t.numel() * t.element_size() for t in tensors)


# ---------------------------------------------------------------- timing
def time_ms(fn, warmup=3, reps=15, settle_s=0.0, warm_ms=0.0, back_to_back=False, spans=None):
    """Median ms of reps calls. settle_s: idle first; warm_ms: warm up for at least that long; spans: a
    list that gets the timed calls' (start, end) in time.time() (the clock samples of that window).

    back_to_back: the calls are enqueued without a synchronize between them, so each one's span on the
    GPU has the host ahead of it, as inside a model where the next layer's launches are queued while
    this one runs. A call that synchronizes inside (the baseline's bincount) still pays its host
    stall; what goes is the launch latency of a call that starts on an idle GPU.

    The block timings (baseline and Poise, fwd and fwd+bwd) settle 1 s and warm up 300 ms each:
    this card runs power- and temperature-limited, and a timing that starts right after another
    block's hot stretch inherits its state (the skewed DeepSeek-V3 case measured 16.9 ms after
    the baseline and 15.3 ms in a chain timed from a cool start; interleaving the two blocks gave
    Poise the baseline's power headroom instead). Each block then runs into its own steady state
    from the same start."""
    if settle_s > 0:
        torch.cuda.synchronize()
        time.sleep(settle_s)
    start = time.perf_counter()
    done = 0
    while done < warmup or (time.perf_counter() - start) * 1e3 < warm_ms:
        fn()
        done += 1
        if done >= warmup:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    timed_from = time.time()
    events = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        if not back_to_back:
            torch.cuda.synchronize()
        events.append((s, e))
    torch.cuda.synchronize()
    if spans is not None:
        spans.append((timed_from, time.time()))
    return statistics.median(s.elapsed_time(e) for s, e in events)


BLOCK_TIMING = {"settle_s": 1.0, "warm_ms": 300.0}


def block_clocks(smi, spans):
    """Each block's median SM clock (MHz) and instantaneous board power (W) over its timed window, per
    repeat (None where no sample fell inside: a Qwen3 window is ~60 ms), the samples they come from
    and the clock event reasons seen (0x...4: the software power cap)."""
    per_block = {k: [median_clock_power(smi.samples_between(a, b)) for a, b in v] for k, v in spans.items()}
    return {"block_sm_mhz": {k: [m and m[0] for m in v] for k, v in per_block.items()},
            "block_power_w": {k: [m and m[1] for m in v] for k, v in per_block.items()},
            "block_clock_samples": {k: [m[3] if m else 0 for m in v] for k, v in per_block.items()},
            "block_clock_reasons": {k: sorted({r for m in v if m for r in m[2]}) for k, v in per_block.items()}}


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def dense_tflops():
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: torch.matmul(a, b), warmup=5, reps=20)
    return 2 * n**3 / ms / 1e9


def make_inputs(T, D, F, E, K, skew_target):
    """The same seeded inputs for every measurement of a case: routing, x, scores, weights, grad_out."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1234)
    torch.manual_seed(1234)
    dev, bf = "cuda", torch.bfloat16
    ids, skew = make_routing(T, E, K, skew_target, gen)
    x = torch.randn(T, D, device=dev, dtype=bf)
    scores = torch.softmax(torch.randn(T, K, device=dev), dim=-1)
    w13 = (torch.randn(E, 2 * F, D, device=dev) / math.sqrt(D)).to(bf)
    w2 = (torch.randn(E, D, F, device=dev) / math.sqrt(F)).to(bf)
    grad_out = torch.randn(T, D, device=dev, dtype=bf)
    return ids, skew, x, scores, w13, w2, grad_out


def fused_combine_fields(med, timing, flops_fwd):
    """The fused-combine blocks' record fields for one timing ("" or "_back_to_back"): their medians,
    the forward's TFLOP/s and both speedups over the baseline's blocks of the same timing."""
    f_ms, fb_ms = med[f"fwd_fused_combine{timing}_ms"], med[f"fwdbwd_fused_combine{timing}_ms"]
    return {f"fwd_fused_combine{timing}_ms": f_ms, f"fwdbwd_fused_combine{timing}_ms": fb_ms,
            f"fwd_fused_combine{timing}_tflops": flops_fwd / f_ms / 1e9,
            f"speedup_fwd_fused_combine{timing}": med[f"baseline_fwd{timing}_ms"] / f_ms,
            f"speedup_fwdbwd_fused_combine{timing}": med[f"baseline_fwdbwd{timing}_ms"] / fb_ms}


def run_case(P, name, skew_target, dense, commit, gemm_detail, repeats=1, back_to_back_blocks=False):
    T, D, F, E, K = SHAPES[name]
    dev, bf = "cuda", torch.bfloat16
    ids, skew, x, scores, w13, w2, grad_out = make_inputs(T, D, F, E, K, skew_target)
    TK = T * K
    flops_fwd = 6.0 * TK * D * F

    # ---- baseline
    xb = x.clone().requires_grad_(True)
    sb = scores.clone().requires_grad_(True)
    w13b = w13.clone().requires_grad_(True)
    w2b = w2.clone().requires_grad_(True)

    def base_fwd():
        with torch.no_grad():
            baseline_forward(x, ids, scores, w13, w2)

    def base_fwdbwd():
        for p in (xb, sb, w13b, w2b):
            p.grad = None
        baseline_forward(xb, ids, sb, w13b, w2b).backward(grad_out)

    out_base, base_saved = saved_bytes_of(lambda: baseline_forward(xb, ids, sb, w13b, w2b), [xb, sb, w13b, w2b, ids])
    for p in (xb, sb, w13b, w2b):
        p.grad = None
    out_base.backward(grad_out)

    # ---- poise
    blk = PoiseBlock(P, T, D, F, E, K)
    out = torch.empty(T, D, device=dev, dtype=bf)
    grad_x = torch.empty(T, D, device=dev, dtype=bf)
    grad_w13 = torch.empty_like(w13)
    grad_w2 = torch.empty_like(w2)
    grad_scores = torch.empty(T, K, device=dev, dtype=torch.float32)

    def poise_fwd():
        blk.forward(x, ids, scores, w13, w2, out)

    def poise_fwdbwd():
        blk.forward(x, ids, scores, w13, w2, out)
        blk.backward(grad_out, w13, w2, grad_x, grad_w13, grad_w2, grad_scores)

    # The top-k combines fused into FPROP W2 and DGRAD W13 (libraries that have them), same buffers.
    fused = hasattr(P.lib, "pb_fprop_w2_combine") and hasattr(P.lib, "pb_dgrad_w13_combine")

    def with_block_flag(fn, flag, value):
        """fn run with one of the block's switches (fused_combine, streamed_rows) set to value."""
        def run():
            before = getattr(blk, flag)
            setattr(blk, flag, value)
            try:
                fn()
            finally:
                setattr(blk, flag, before)
        return run

    def with_fused_combine(fn):
        return with_block_flag(fn, "fused_combine", True)

    fused_errors = {}
    if fused:
        for t in (out, grad_x, grad_scores):
            t.fill_(float("nan"))
        with_fused_combine(poise_fwdbwd)()
        torch.cuda.synchronize()
        fused_errors = {"out_fused_combine": rel_err(out, out_base.detach()),
                        "grad_x_fused_combine": rel_err(grad_x, xb.grad),
                        "grad_scores_fused_combine": rel_err(grad_scores, sb.grad)}
    poise_fwdbwd()
    torch.cuda.synchronize()
    errors = {
        "out": rel_err(out, out_base.detach()),
        "grad_x": rel_err(grad_x, xb.grad),
        "grad_w13": rel_err(grad_w13, w13b.grad),
        "grad_w2": rel_err(grad_w2, w2b.grad),
        "grad_scores": rel_err(grad_scores, sb.grad),
    }
    errors.update(fused_errors)
    # The four block timings in this order, `repeats` times over (the card drifts 2-4% between device
    # calls and within one; the record holds each block's median and every repeat).
    blocks = {"baseline_fwd_ms": base_fwd, "baseline_fwdbwd_ms": base_fwdbwd, "fwd_ms": poise_fwd,
              "fwdbwd_ms": poise_fwdbwd}
    if fused:
        blocks["fwd_fused_combine_ms"] = with_fused_combine(poise_fwd)
        blocks["fwdbwd_fused_combine_ms"] = with_fused_combine(poise_fwdbwd)
    # Same-call A/B of the streamed rows against the copy kernels first: the blocks other than the
    # default combine's forward with the other setting (suffix _streamed or _copies_first).
    streamed = blk.streamed_rows
    ab_suffix = "_copies_first" if streamed else "_streamed"
    if blk.can_stream_rows:
        for k in [k for k in blocks if k.startswith("fwd") and k != "fwd_ms"]:
            blocks[k.replace("_ms", ab_suffix + "_ms")] = with_block_flag(blocks[k], "streamed_rows", not streamed)
    # --back-to-back: the same blocks enqueued back to back (time_ms, back_to_back=True), the baseline's and
    # Poise's forward and forward+backward with the host ahead, next to the headline timings from an
    # idle GPU (session 18: the baseline gains as much, performance.md).
    # (Every block but the default combine's forward.)
    back_to_back = {k.replace("_ms", "_back_to_back_ms"): fn for k, fn in blocks.items()
                    if k != "fwd_ms" and ab_suffix not in k} if back_to_back_blocks else {}
    times = {k: [] for k in {**blocks, **back_to_back}}
    spans = {k: [] for k in times}
    for _ in range(repeats):
        for k, fn in blocks.items():
            times[k].append(time_ms(fn, **BLOCK_TIMING, spans=spans[k]))
        for k, fn in back_to_back.items():
            times[k].append(time_ms(fn, **BLOCK_TIMING, back_to_back=True, spans=spans[k]))
    med = {k: statistics.median(v) for k, v in times.items()}
    base_fwd_ms, base_fwdbwd_ms, fwd_ms, fwdbwd_ms = (med[k] for k in list(blocks)[:4])
    fwd_kernels_ms = time_ms(lambda: blk.forward_kernels(w13, w2, out))

    rec = {
        "shape": name, "T": T, "D": D, "F": F, "E_local": E, "K": K,
        "skew": round(skew, 3), "routing": routing_name(skew_target),
        "fwd_ms": fwd_ms, "fwd_kernels_ms": fwd_kernels_ms, "fwdbwd_ms": fwdbwd_ms,
        "baseline_fwd_ms": base_fwd_ms, "baseline_fwdbwd_ms": base_fwdbwd_ms,
        "fwd_tflops": flops_fwd / fwd_ms / 1e9, "fwd_kernels_tflops": flops_fwd / fwd_kernels_ms / 1e9,
        "fwdbwd_tflops": 3 * flops_fwd / fwdbwd_ms / 1e9,
        "baseline_fwd_tflops": flops_fwd / base_fwd_ms / 1e9,
        "baseline_fwdbwd_tflops": 3 * flops_fwd / base_fwdbwd_ms / 1e9,
        "speedup_fwd": base_fwd_ms / fwd_ms, "speedup_fwdbwd": base_fwdbwd_ms / fwdbwd_ms,
        "dense_tflops": dense,
        "timing": "sequential, each block after 1 s idle and 300 ms of warm-up"
                  + (f"; medians of {repeats} repeats of the {len(blocks)} blocks" if repeats > 1 else "")
                  + ("; *_back_to_back_ms: the same block's calls enqueued without a synchronize between them"
                     if back_to_back_blocks else ""),
        "saved_bytes": blk.saved_bytes(), "baseline_saved_bytes": base_saved,
        "rel_err_vs_baseline": errors, "commit": commit,
    }
    if fused:
        # FPROP W2 / DGRAD W13 adding their rows into out / grad_x by token (bf16, no fixed order)
        # instead of grouped rows + a combine.
        rec.update(fused_combine_fields(med, "", flops_fwd))
    rec["streamed_rows"] = streamed
    if blk.can_stream_rows:
        rec["gather_ctas"] = blk.gather_ctas
        # The same blocks with the x gather / grad_out scatter the other way (streamed or copies first).
        for k in [k for k in med if ab_suffix in k]:
            rec[k] = med[k]
            base = med["baseline_fwd_ms" if k.startswith("fwd_") else "baseline_fwdbwd_ms"]
            rec[k.replace("_ms", "_speedup")] = base / med[k]
    if back_to_back_blocks:
        b2b_base = med["baseline_fwdbwd_back_to_back_ms"]
        rec.update({"baseline_fwd_back_to_back_ms": med["baseline_fwd_back_to_back_ms"],
                    "baseline_fwdbwd_back_to_back_ms": b2b_base,
                    "fwdbwd_back_to_back_ms": med["fwdbwd_back_to_back_ms"],
                    "speedup_fwdbwd_back_to_back": b2b_base / med["fwdbwd_back_to_back_ms"]})
        if fused:
            rec.update(fused_combine_fields(med, "_back_to_back", flops_fwd))
    rec["block_spans"] = spans  # each repeat's timed window (time.time()), for block_clocks
    if repeats > 1:
        rec["repeats"] = times
        rec["speedup_fwdbwd_repeats"] = [b / p for b, p in zip(times["baseline_fwdbwd_ms"], times["fwdbwd_ms"])]
    if gemm_detail:
        g = {k: time_ms(call) for k, call in blk.gemm_calls(w13, w2, grad_w13, grad_w2).items()}
        g["gather_x"] = time_ms(lambda: blk.gather_x(x))
        g["combine"] = time_ms(lambda: blk.combine(blk.y_rows, out))
        if fused:  # zeroing the target + the GEMM with the combine, against the GEMM + combine above
            g["fprop_w2_fused_combine"] = time_ms(lambda: blk.fprop_w2_fused_combine(w2, out))
            g["dgrad_w13_fused_combine"] = time_ms(lambda: blk.dgrad_w13_fused_combine(w13, grad_x))
        # torch._grouped_mm on the same (unpadded) problem, GEMM for GEMM.
        xs, offs = grouped_mm_operands(x, ids, E, K)
        a_t = torch.randn(TK, F, device=dev, dtype=bf)
        g["torch_grouped_mm_w13"] = time_ms(lambda: torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs))
        g["torch_grouped_mm_w2"] = time_ms(lambda: torch._grouped_mm(a_t, w2.transpose(1, 2), offs=offs))
        tf = {}
        for k, v in g.items():
            if "w13" in k and "gather" not in k:
                tf[k] = 2.0 * TK * D * 2 * F / v / 1e9
            elif "w2" in k:
                tf[k] = 2.0 * TK * D * F / v / 1e9
        rec["gemm_ms"] = g
        rec["gemm_tflops"] = tf
    return rec


def grouped_mm_operands(x, ids, E, K):
    """torch._grouped_mm's rows operand for the same (unpadded) problem: the token rows sorted by
    expert, and the experts' end offsets."""
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0, dtype=torch.int32)
    return x.index_select(0, order // K), offs


def ready_block(P, name, skew_target):
    """A case's inputs and a PoiseBlock whose buffers one forward and backward filled, with the
    output and gradient tensors those wrote (the GEMM-only timings and the profiling scripts)."""
    T, D, F, E, K = {**SHAPES, **DIAGNOSTIC_SHAPES}[name]
    dev = "cuda"
    ids, skew, x, scores, w13, w2, grad_out = make_inputs(T, D, F, E, K, skew_target)
    c = types.SimpleNamespace(name=name, T=T, D=D, F=F, E=E, K=K, ids=ids, skew=skew, x=x, scores=scores,
                              w13=w13, w2=w2, grad_out=grad_out, blk=PoiseBlock(P, T, D, F, E, K))
    c.out = torch.empty(T, D, device=dev, dtype=torch.bfloat16)
    c.gx, c.gs = torch.empty_like(c.out), torch.empty(T, K, device=dev)
    c.g13, c.g2 = torch.empty_like(w13), torch.empty_like(w2)
    c.forward = lambda: c.blk.forward(x, ids, scores, w13, w2, c.out)
    c.backward = lambda: c.blk.backward(grad_out, w13, w2, c.gx, c.g13, c.g2, c.gs)
    c.forward()
    c.backward()
    c.gemm_calls = c.blk.gemm_calls(w13, w2, c.g13, c.g2)
    return c


def gemm_only(P, name, skew_target, label):
    """Times the six Poise GEMMs alone (no baseline): for comparing two builds of the kernels."""
    c = ready_block(P, name, skew_target)
    calls = dict(c.gemm_calls)
    if c.blk.side_combine:  # the WGRADs carrying the grad_x combine, next to the glue it replaces
        b = c.blk
        calls["wgrad_w13+combine"] = lambda: b.wgrad_w13_with_combine(c.g13, c.gx, c.gs)  # all of it in WGRAD W13
        calls["wgrads+combine"] = lambda: b.wgrads_with_combine(c.g13, c.g2, c.gx, c.gs)
        calls["combine_glue"] = lambda: b.combine_glue(c.gx, c.gs)
    g = {k: time_ms(call) for k, call in calls.items()}
    fwdbwd = time_ms(lambda: (c.forward(), c.backward()))
    TK = c.T * c.K
    tf = {k: (4.0 if "w13" in k else 2.0) * TK * c.D * c.F / v / 1e9 for k, v in g.items() if "combine" not in k}
    print(f"[{label}] {name} {routing_name(skew_target)} (skew {c.skew:.2f}): fwdbwd {fwdbwd:.2f} ms; TF/s " + ", ".join(f"{k} {v:.0f}" for k, v in tf.items())
          + "".join(f"; {k} {v * 1e3:.0f} us" for k, v in g.items() if "combine" in k), flush=True)


def write_records(path, records):
    with open(path, "w") as f:
        json.dump(records, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--skews", default="1,3")
    ap.add_argument("--gemm-only", default="", help="label: only time the Poise GEMMs of this build")
    ap.add_argument("--repeats", type=int, default=1, help="time the four blocks this many times; record medians")
    ap.add_argument("--back-to-back", action="store_true",
                    help="also time the blocks enqueued back to back (no synchronize between calls)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    P = Poise(load_lib(args.lib))
    if args.gemm_only:
        for name in args.shapes.split(","):
            for skew in [float(s) for s in args.skews.split(",")]:
                gemm_only(P, name, skew, args.gemm_only)
        return 0
    # Which card, and the clock each timed block ran at (the figures move 2-4% between device calls).
    device = device_identity()
    print("device:", device, flush=True)
    records = []
    with SmiSampler(period_ms=25) as smi:
        dense = dense_tflops()
        print(f"dense bf16 matmul 8192^3: {dense:.0f} TFLOP/s", flush=True)
        for name in args.shapes.split(","):
            for skew in [float(s) for s in args.skews.split(",")]:
                rec = run_case(P, name, skew, dense, args.commit, gemm_detail=True, repeats=args.repeats,
                               back_to_back_blocks=args.back_to_back)
                rec["device"] = device
                records.append(rec)
                print(json.dumps(rec), flush=True)
                write_records(args.out, records)  # each case as it ends: a cut-short run keeps its records
    print(f"clock samples: {len(smi.lines)}", flush=True)
    for rec in records:  # the sampler has stopped: every line it printed is in
        rec.update(block_clocks(smi, rec["block_spans"]))
    write_records(args.out, records)
    print("\nshape                 skew  fwd_ms (base)   fwdbwd_ms (base)  fwd TF/s  x fwd  x fwdbwd  saved GiB (base)  err(out)")
    for r in records:
        print(f"{r['shape']:<21} {r['skew']:4.2f}  {r['fwd_ms']:6.2f} ({r['baseline_fwd_ms']:5.2f})  "
              f"{r['fwdbwd_ms']:6.2f} ({r['baseline_fwdbwd_ms']:6.2f})   {r['fwd_tflops']:6.0f}   {r['speedup_fwd']:4.2f}  "
              f"{r['speedup_fwdbwd']:5.2f}     {r['saved_bytes']/2**30:5.2f} ({r['baseline_saved_bytes']/2**30:5.2f})  "
              f"{r['rel_err_vs_baseline']['out']:.1e}")
        if "gemm_ms" in r:
            print("   gemm ms:", {k: round(v, 3) for k, v in r["gemm_ms"].items()})
            print("   gemm TF/s:", {k: round(v) for k, v in r["gemm_tflops"].items()})
            print("   rel err vs baseline:", {k: f"{v:.1e}" for k, v in r["rel_err_vs_baseline"].items()})
        ab = {k: round(v, 3) for k, v in r.items() if "_copies_first" in k or "_streamed_" in k}
        if ab:
            print("   streamed rows" if r.get("streamed_rows") else "   copies first",
                  "(default); the other way:", ab)
        if "fwd_fused_combine_ms" in r:
            print(f"   fused combine: fwd {r['fwd_fused_combine_ms']:.2f} ms ({r['fwd_fused_combine_tflops']:.0f} TF/s, "
                  f"x{r['speedup_fwd_fused_combine']:.2f}), fwdbwd {r['fwdbwd_fused_combine_ms']:.2f} ms "
                  f"(x{r['speedup_fwdbwd_fused_combine']:.3f})")
        if "speedup_fwdbwd_repeats" in r:
            print("   x fwdbwd per repeat:", [round(v, 3) for v in r["speedup_fwdbwd_repeats"]])
        if "block_sm_mhz" in r:
            print("   SM MHz / W per repeat:", {k: [f"{m:.0f}/{w:.0f}" if m else "-" for m, w in
                                                  zip(r["block_sm_mhz"][k], r["block_power_w"][k])]
                                              for k in r["block_sm_mhz"] if k.endswith("fwdbwd_ms")})
        if "fwdbwd_back_to_back_ms" in r:
            line = (f"   back to back: fwdbwd {r['fwdbwd_back_to_back_ms']:.2f} ms ({r['baseline_fwdbwd_back_to_back_ms']:.2f}) "
                    f"x{r['speedup_fwdbwd_back_to_back']:.3f}")
            if "fwdbwd_fused_combine_back_to_back_ms" in r:
                line += (f"; fused: fwd {r['fwd_fused_combine_back_to_back_ms']:.2f} ms "
                         f"({r['baseline_fwd_back_to_back_ms']:.2f}, {r['fwd_fused_combine_back_to_back_tflops']:.0f} TF/s), "
                         f"fwdbwd {r['fwdbwd_fused_combine_back_to_back_ms']:.2f} ms "
                         f"x{r['speedup_fwdbwd_fused_combine_back_to_back']:.3f}")
            print(line)


if __name__ == "__main__":
    sys.exit(main())
