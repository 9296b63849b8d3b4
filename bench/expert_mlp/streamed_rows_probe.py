"""Where the streamed rows' time goes (diagnostic, no baseline): per shape, FPROP W13 and DGRAD W2
alone, the copy kernel alone, the copy then the GEMM, the streamed pair and the streamed gather
alone, for several gather CTA counts, all in one call.

    python3 bench/expert_mlp/streamed_rows_probe.py LIB [SHAPES] [CTAS]

The gather alone is timed last: without a streamed GEMM after it the generation does not advance, so
a streamed pair timed after it would find its row blocks already published."""
import sys

import bench_expert_mlp as bench

TIMING = {"settle_s": 0.3, "warm_ms": 100.0}


def main() -> int:
    P = bench.open_poise(sys.argv[1])
    shapes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["deepseek_v3_ep8_rank", "qwen3_30b_a3b"]
    ctas_list = [int(c) for c in sys.argv[3].split(",")] if len(sys.argv) > 3 else [8, 16, 32, 64]
    for name in shapes:
        c = bench.ready_block(P, name, 1)
        b, L = c.blk, c.blk.lay
        dgrad_args = (b.gy_rows, c.w2, b.h13, L["scores_R"], b.gh13, b.a, b.grad_score_partials)
        pairs = {
            "fprop_w13": (c.x, b.x_rows, lambda: P.fprop_w13(b.x_rows, c.w13, b.a, b.h13), P.fprop_w13_streamed,
                          (b.x_rows, c.w13, b.a, b.h13)),
            "dgrad_w2": (c.grad_out, b.gy_rows, lambda: P.dgrad_w2(*dgrad_args), P.dgrad_w2_streamed, dgrad_args),
        }
        gather_alone = {}
        for gemm, (src, dst, plain, streamed, args) in pairs.items():
            copy = lambda: P.scatter_rows(L["row_of_tk"], c.T * c.K, c.K, c.D, src, dst)
            t = {"gemm": bench.time_ms(plain, **TIMING), "copy": bench.time_ms(copy, **TIMING)}
            t["copy+gemm"] = bench.time_ms(lambda: (copy(), plain()), **TIMING)
            for ctas in ctas_list:
                def pair(ctas=ctas):
                    b.gather_ctas = ctas
                    b.streamed(src, dst, streamed, *args)
                t[f"streamed/{ctas}"] = bench.time_ms(pair, **TIMING)
            print(f"{name} {gemm}: " + ", ".join(f"{k} {v:.3f}" for k, v in t.items()), flush=True)
            gather_alone[gemm] = (src, dst)
        for gemm, (src, dst) in gather_alone.items():
            t = {ctas: bench.time_ms(lambda ctas=ctas: P.gather_rows_streamed(L["token_of_row"], c.T, c.D, src, dst,
                                                                             ctas), **TIMING)
                 for ctas in ctas_list}
            print(f"{name} streamed gather alone ({gemm}'s rows): " + ", ".join(f"{k} CTAs {v:.3f}" for k, v in t.items()),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
