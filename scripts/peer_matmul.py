#!/usr/bin/env python3
"""The peer for `fathom_model::bench::nf4_matmul` on a GPU: PyTorch dense matmuls (f32 and bf16)
on Qwen2.5-1.5B's projection shapes, and bitsandbytes' NF4 matmul when that package is present.

    peer_matmul.py [--device cuda] [--iters 10] [--m 1,8,128,512]

Protocol (as nf4_matmul): a fresh random input for every timed iteration, one warm-up, median
of ITERS; y = x @ W^T with W [out, in]; the device is synchronised before every clock read.
Prints one JSON line.
"""
import argparse
import json
import statistics
import time

import torch

SHAPES = [("q_proj/o_proj", 1536, 1536), ("k_proj/v_proj", 256, 1536),
          ("gate/up_proj", 8960, 1536), ("down_proj", 1536, 8960)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--m", default="1,8,128,512")
    a = ap.parse_args()
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        import bitsandbytes.functional as bnbf
        import bitsandbytes as bnb
    except ImportError:
        bnb = None
    out = {"system": "torch", "torch": torch.__version__, "device": a.device,
           "bitsandbytes": getattr(bnb, "__version__", None), "results": []}

    def timed(f, inputs):
        f(inputs[0])
        ts = []
        for x in inputs[1:]:
            sync()
            t = time.perf_counter()
            f(x)
            sync()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    for name, o, i in SHAPES:
        w = torch.randn(o, i, device=dev) * 0.02
        wb = w.to(torch.bfloat16)
        q = bnbf.quantize_4bit(wb, quant_type="nf4") if bnb else None
        for m in [int(v) for v in a.m.split(",")]:
            xs = [torch.rand(m, i, device=dev) for _ in range(a.iters + 1)]
            xbs = [x.to(torch.bfloat16) for x in xs]
            r = {"projection": name, "rows": o, "cols": i, "m": m,
                 "dense_f32_s": timed(lambda x: x @ w.t(), xs),
                 "dense_bf16_s": timed(lambda x: x @ wb.t(), xbs)}
            if q is not None:
                r["bnb_nf4_bf16_s"] = timed(lambda x: bnb.matmul_4bit(x, q[0].t(), quant_state=q[1]), xbs)
            out["results"].append(r)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
