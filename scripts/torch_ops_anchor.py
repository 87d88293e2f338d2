#!/usr/bin/env python3
"""Eager PyTorch's time for each piece of a TokenFormer layer, beside `bench --only ops`.

`tokenformer bench --device cuda --only ops` times the pieces of one 150M layer at
16 x 2048 tokens (the norm, a q/k/v-sized and the feed-forward Pattention whole and as
their scores product and Theta, the attention, the head). This times the same pieces,
at the same shapes and in the same way (one warm-up call, then the median of three,
synchronised), in eager PyTorch with the anchors' math (../shared/bench/torch_baseline.py),
so each of our pieces has its PyTorch counterpart. The attention is also timed with each
of PyTorch's SDPA backends forced in turn: `flash` is FlashAttention-2, the existing
kernel issue 33 asks us to measure ours against (the Rust `candle-flash-attn` crate
wraps the same kernels; docs/PERFORMANCE.md says why it is not built here).

  python3 torch_ops_anchor.py [--device cuda] [--batch 16] [--seq 2048] > torch-ops.json

Prints one JSON object: torch_ops_{f32,bf16}_{piece}_ms and the piece's rate
(_tflops for products, _gb_per_s for passes over memory), and _sum_ms as ours adds it
up. No TF32, as the other anchors.
"""
import argparse, json, os, sys, time

import torch
import torch.nn.functional as F

here = os.path.dirname(os.path.abspath(__file__))
for bench in (os.path.join(here, "..", "bench"), os.path.join(here, "..", "..", "shared", "bench")):
    sys.path.insert(0, bench)
import torch_baseline as tb  # noqa: E402


def timed(fn, sync):
    fn()
    sync()
    t = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        sync()
        t.append(time.perf_counter() - start)
    return sorted(t)[1]


def sdpa_backends():
    """Context managers forcing each of PyTorch's SDPA backends, by name, where this
    PyTorch can force one."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return {}
    names = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
             "cudnn": "CUDNN_ATTENTION", "math": "MATH"}
    return {k: (lambda b=getattr(SDPBackend, v): sdpa_kernel(b))
            for k, v in names.items() if hasattr(SDPBackend, v)}


def ops(out, c, dtype, dev, b, s, sync, vocab=50304):
    name = {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]
    size = torch.finfo(dtype).bits // 8
    d, L, H = c["d"], c["L"], c["H"]
    rows = b * s
    g = torch.Generator(device=dev).manual_seed(0)
    randn = lambda *shape, std: (torch.randn(*shape, generator=g, device=dev) * std).to(dtype)
    total = 0.0

    def record(piece, fn, times, flops=None, bytes_=None):
        nonlocal total
        secs = timed(fn, sync)
        total += times * secs
        out[f"torch_ops_{name}_{piece}_ms"] = round(secs * 1e3, 3)
        if flops is not None:
            out[f"torch_ops_{name}_{piece}_tflops"] = round(flops / secs / 1e12, 2)
        else:
            out[f"torch_ops_{name}_{piece}_gb_per_s"] = round(bytes_ / secs / 1e9, 2)

    with torch.no_grad():
        x = randn(b, s, d, std=1.0)
        flat = x.reshape(rows, d)
        record("norm", lambda: F.layer_norm(x, (d,), eps=1e-5), 2 * L, bytes_=2 * rows * d * size)
        # The output projection has q's size in every released shape: one timing serves both.
        sizes = [("pattention_qkv", c["nq"], 3 * L + (L if c["no"] == c["nq"] else 0))]
        if c["no"] != c["nq"]:
            sizes.append(("pattention_proj", c["no"], L))
        sizes.append(("pattention_ffn", c["nf"], L))
        for piece, n, times in sizes:
            kv = (randn(n, d, std=1.0), randn(n, d, std=0.02))
            flops = 4.0 * rows * n * d
            record(piece, lambda: tb.pattention(x, kv), times, flops=flops)
            record(f"{piece}_scores", lambda: flat @ kv[0].T, 0, flops=flops / 2)
            scores = flat @ kv[0].T
            record(f"{piece}_theta", lambda: tb.theta(scores), 0, bytes_=2 * rows * n * size)
            del scores
        hd = d // H
        q, k, v = (randn(b, H, s, hd, std=1.0) for _ in range(3))
        flops = 2.0 * b * H * s * s * hd  # causal: half the scores and half the mixing
        record("attention", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), L,
               flops=flops)
        for backend, forced in sdpa_backends().items():
            def run():
                with forced():
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)
            try:
                record(f"attention_{backend}", run, 0, flops=flops)
            except RuntimeError as e:  # the backend does not take this dtype or device
                out[f"torch_ops_{name}_attention_{backend}_error"] = str(e).splitlines()[0][:200]
        del q, k, v
        emb = randn(vocab, d, std=0.02)
        record("head", lambda: flat @ emb.T, 1, flops=2.0 * rows * d * vocab)
    out[f"torch_ops_{name}_sum_ms"] = round(total * 1e3, 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="150m", choices=sorted(tb.LM))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--dtypes", default="f32,bf16")
    a = ap.parse_args()
    dev = torch.device(a.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(dev)
           if dev.type == "cuda" else "cpu", "ops_shape": [a.batch, a.seq, a.model]}
    for dt in a.dtypes.split(","):
        dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dt]
        try:
            ops(out, tb.LM[a.model], dtype, dev, a.batch, a.seq, sync)
        except Exception as e:  # one dtype failing (out of memory, say) keeps the other
            out[f"torch_ops_{dt}_error"] = f"{type(e).__name__}: {e}"[:300]
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
