#!/usr/bin/env python3
"""The peer for `cargo xtask bench model` / the CUDA report: `transformers` on the same
checkpoint with the same protocol, on CPU or CUDA, f32.

    peer_transformers.py CKPT_DIR [--device cuda|cpu] [--threads 2]

Protocol (as fathom_model::bench::throughput and the peers' hf_bench.py): prefill of 1x512 ids
with last-position logits; greedy decoding of 64 new tokens after a 32-token prompt at batch 1
and 8, the prompt's prefill included; medians of 5 (prefill) and 3 (decode) after one warm-up;
ids ((b*len + i)*7919 + 13) mod vocab. Synchronises the device before every clock read.
Prints one JSON line.
"""
import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM


def ids(batch, seq, vocab, device):
    rows = [[((b * seq + i) * 7919 + 13) % vocab for i in range(seq)] for b in range(batch)]
    return torch.tensor(rows, dtype=torch.long, device=device)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model = AutoModelForCausalLM.from_pretrained(a.ckpt, dtype=torch.float32).to(dev).eval()
    vocab = model.config.vocab_size
    gc = model.generation_config
    gc.eos_token_id = None
    gc.pad_token_id = 0
    gc.do_sample = False
    gc.max_new_tokens = gc.min_new_tokens = 64
    out = {"system": "transformers", "device": a.device, "torch": torch.__version__}
    with torch.inference_mode():
        x = ids(1, 512, vocab, dev)

        def prefill():
            sync()
            t = time.perf_counter()
            r = model(input_ids=x, use_cache=False, logits_to_keep=1)
            _ = r.logits.sum().item()
            sync()
            return time.perf_counter() - t

        prefill()
        ts = [prefill() for _ in range(5)]
        out["prefill_tok_s"] = 512 / statistics.median(ts)
        for b in (1, 8):
            p = ids(b, 32, vocab, dev)

            def gen():
                sync()
                t = time.perf_counter()
                g = model.generate(input_ids=p, attention_mask=torch.ones_like(p), generation_config=gc)
                sync()
                assert g.shape == (b, 96)
                return time.perf_counter() - t

            gen()
            ts = [gen() for _ in range(3)]
            out[f"decode_b{b}_tok_s"] = b * 64 / statistics.median(ts)
    if dev.type == "cuda":
        out["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
