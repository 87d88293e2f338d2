#!/usr/bin/env python3
"""Fixture for tests/train_vit.rs: one training step of a tiny TokenFormer-ViT in PyTorch
autograd (f64 math is not used: f32 as the Rust side trains).

Writes tests/fixtures/vit-train-step/{config.json, model.safetensors, pixels.safetensors,
train_step.json}: random weights (seeded), pixels and labels; the loss, every tensor's
gradient norm and first 8 values (before clipping), the global norm, and the first 8
values of every tensor after global-norm clipping at 1.0 and one AdamW step (lr 1e-3,
betas 0.9/0.95, eps 1e-8, weight decay 0.1 on tensors of 2+ dims).

  pip install torch numpy
  python3 scripts/vit_train_step.py tests/fixtures/vit-train-step
"""
import json, math, os, struct, sys
import numpy as np
import torch
import torch.nn.functional as F

CFG = dict(architecture="tokenformer-vit", image_size=8, patch_size=4, num_channels=3,
           hidden_size=16, num_layers=2, num_heads=2, qkv_tokens=12, proj_tokens=10,
           ffn_tokens=24, num_classes=3, pool="mean", norm_eps=1e-6,
           pattention_activation="l2_norm_gelu")
MODS = [("attention.query", "qkv_tokens"), ("attention.key", "qkv_tokens"),
        ("attention.value", "qkv_tokens"), ("attention.proj", "proj_tokens"), ("mlp", "ffn_tokens")]


def shapes(c):
    d, p = c["hidden_size"], c["patch_size"]
    n = (c["image_size"] // p) ** 2
    s = {"patch_embed.weight": (d, 3, p, p), "patch_embed.bias": (d,), "cls_token": (1, 1, d),
         "pos_embed": (1, n + 1, d)}
    for i in range(c["num_layers"]):
        for m, key in MODS:
            for t in ("key_param_tokens", "value_param_tokens"):
                s[f"layers.{i}.{m}.{t}"] = (c[key], d)
    s["fc_norm.weight"], s["fc_norm.bias"] = (d,), (d,)
    s["head.weight"], s["head.bias"] = (c["num_classes"], d), (c["num_classes"],)
    return s


def theta(s):
    n = s.shape[-1]
    return F.gelu(s / torch.norm(s, p=2, dim=-1, keepdim=True) * math.sqrt(n))


def forward(w, c, pixels):
    return features(w, c, pixels) @ w["head.weight"].T + w["head.bias"]


def features(w, c, pixels):
    """The pooled, normalised feature [b, d] the head reads (timm's pre-logits)."""
    d, H, eps = c["hidden_size"], c["num_heads"], c["norm_eps"]
    pat = lambda x, m, n: theta(x @ w[f"{m}.key_param_tokens"].T) @ w[f"{m}.value_param_tokens"]
    x = F.conv2d(pixels, w["patch_embed.weight"], w["patch_embed.bias"], stride=c["patch_size"])
    x = x.flatten(2).transpose(1, 2)
    b, s = x.shape[0], x.shape[1] + 1
    x = torch.cat([w["cls_token"].expand(b, 1, d), x], 1) + w["pos_embed"]
    hd = d // H
    for i in range(c["num_layers"]):
        h = F.layer_norm(x, (d,), eps=eps)
        q, k, v = (pat(h, f"layers.{i}.attention.{n}", 0).view(b, s, H, hd).transpose(1, 2)
                   for n in ("query", "key", "value"))
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), -1) @ v
        x = x + pat(a.transpose(1, 2).reshape(b, s, d), f"layers.{i}.attention.proj", 0)
        x = x + pat(F.layer_norm(x, (d,), eps=eps), f"layers.{i}.mlp", 0)
    return F.layer_norm(x[:, 1:].mean(1), (d,), w["fc_norm.weight"], w["fc_norm.bias"], eps=eps)


def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for k in sorted(tensors):
        a = np.ascontiguousarray(tensors[k].detach().numpy().astype("<f4"))
        header[k] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        blobs.append(a.tobytes())
        off += a.nbytes
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    g = torch.Generator().manual_seed(7)
    w = {}
    for k, s in shapes(CFG).items():
        if k.endswith("bias"):
            t = torch.randn(*s, generator=g) * 0.1
        elif k == "fc_norm.weight":
            t = 1 + torch.randn(*s, generator=g) * 0.1
        else:
            t = torch.randn(*s, generator=g) * 0.2
        w[k] = torch.nn.Parameter(t)
    pixels = torch.randn(4, 3, CFG["image_size"], CFG["image_size"], generator=g)
    labels = torch.tensor([0, 2, 1, 2])
    write_safetensors(os.path.join(out, "model.safetensors"), w)
    write_safetensors(os.path.join(out, "pixels.safetensors"), {"pixels": pixels})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(CFG, f, indent=1)

    loss = F.cross_entropy(forward(w, CFG, pixels), labels)
    loss.backward()
    first8 = lambda t: [float(x) for x in t.detach().flatten()[:8]]
    grads = {k: p.grad.clone() for k, p in w.items()}
    total = torch.nn.utils.clip_grad_norm_(list(w.values()), 1.0)
    decay = [p for p in w.values() if p.dim() >= 2]
    plain = [p for p in w.values() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": plain, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    opt.step()
    res = {
        "what": "one step of a tiny TokenFormer-ViT (config.json, model.safetensors) on "
                "pixels.safetensors with labels: mean cross-entropy; unclipped gradients "
                "(norm, first 8); global norm; clipping at 1.0; AdamW lr 1e-3, betas "
                "0.9/0.95, eps 1e-8, weight decay 0.1 on 2+-dim tensors; weights after",
        "torch": torch.__version__,
        "labels": labels.tolist(),
        "loss": float(loss.detach()),
        "grad_global_norm_before_clip": float(total),
        "grad_norm": {k: float(torch.linalg.vector_norm(g.double())) for k, g in grads.items()},
        "grad_first8": {k: first8(g) for k, g in grads.items()},
        "after_step_first8": {k: first8(p) for k, p in w.items()},
    }
    with open(os.path.join(out, "train_step.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
