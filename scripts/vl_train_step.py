#!/usr/bin/env python3
"""Fixture for tests/train_vl.rs: one `--train bridge` step of a tiny merged
vision-language TokenFormer in PyTorch autograd (f32, as the Rust side trains).

The model, written from the merged model's definition and not from this project's code:
every Pattention layer holds [vision | language | bridge] parameter tokens; an image
token's Theta runs over the vision and bridge tokens with the vision source's sqrt(n), a
text token's over the language and bridge tokens with the language source's sqrt(n)
(Theta = GELU(s / ||s||_2 * sqrt(n)), the official l2_norm_gelu). The sequence is
[class token, patches; caption]: image rows run the classifier's pre-norm blocks
(non-parametric LayerNorm, bidirectional among image rows); caption rows run the
language model's blocks with GPT-NeoX partial rotary (positions count text only) and
attend to every image row (its vision-route keys and values, not rotated) and causally
to the caption. The language model's final LayerNorm and tied embeddings give logits;
the loss is the mean next-token cross-entropy over real caption tokens (padding left
out). Only the bridge rows train: they are separate parameters concatenated after the
frozen rows, so frozen rows get no gradient, count in neither the norm nor clipping,
and are neither updated nor decayed.

Writes tests/fixtures/vl-train-step/{config.json, model.safetensors, batch.safetensors,
train_step.json}: seeded random weights (bridge keys non-zero, so the bridge takes part
in both routes); pixels, caption ids [b, t+1] and the loss mask [b, t]; the loss, each
bridge's gradient (norm and all values), the global norm before clipping, the clipping
bound, and every bridge after one AdamW step.

  pip install torch numpy
  python3 scripts/vl_train_step.py tests/fixtures/vl-train-step
"""
import json, math, os, struct, sys
import numpy as np
import torch
import torch.nn.functional as F

D, LAYERS, HEADS, BRIDGE = 16, 2, 2, 4
VISION = dict(architecture="tokenformer-vit", image_size=8, patch_size=4, num_channels=3,
              hidden_size=D, num_layers=LAYERS, num_heads=HEADS, qkv_tokens=12, proj_tokens=10,
              ffn_tokens=24, num_classes=3, pool="mean", norm_eps=1e-6,
              pattention_activation="l2_norm_gelu",
              # The vision source was grown keeping its old sqrt(n) constants.
              pattention_scale_tokens=dict(qkv=10, proj=8, ffn=20))
LANGUAGE = dict(architecture="tokenformer-lm", hidden_size=D, num_layers=LAYERS, num_heads=HEADS,
                qkv_tokens=14, proj_tokens=8, ffn_tokens=20, vocab_size=64,
                max_position_embeddings=16, rotary_pct=0.5, rotary_base=10000.0, norm_eps=1e-5,
                pattention_activation="l2_norm_gelu", eos_token_id=0, tie_word_embeddings=True)
KINDS = [("attention.query", "qkv"), ("attention.key", "qkv"), ("attention.value", "qkv"),
         ("attention.proj", "proj"), ("mlp", "ffn")]
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1


def groups():
    return {k: dict(vision=VISION[f"{k}_tokens"], language=LANGUAGE[f"{k}_tokens"], bridge=BRIDGE)
            for k in ("qkv", "proj", "ffn")}


def config():
    return {"architecture": "tokenformer-vl", "vision": VISION, "language": LANGUAGE,
            "bridge_tokens": BRIDGE, "pattention_groups": groups()}


def theta(s, n):
    return F.gelu(s / torch.norm(s, p=2, dim=-1, keepdim=True) * math.sqrt(n))


def layer_norm(x, eps):
    return F.layer_norm(x, (x.shape[-1],), eps=eps)


def rotary(x, dims, base):
    """GPT-NeoX rotate-half on the first `dims` features of x [b, h, t, hd]."""
    t = x.shape[2]
    inv = 1.0 / (base ** (torch.arange(0, dims, 2, dtype=torch.float32) / dims))
    ang = torch.arange(t, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    r, rest = x[..., :dims], x[..., dims:]
    half = dims // 2
    rot = torch.cat([-r[..., half:], r[..., :half]], -1)
    return torch.cat([r * cos + rot * sin, rest], -1)


class Merged:
    """Frozen weights plus trainable bridge rows."""

    def __init__(self, gen):
        g = groups()
        self.frozen, self.bridge = {}, {}
        p, c = VISION["patch_size"], VISION["num_channels"]
        n_img = (VISION["image_size"] // p) ** 2 + 1
        rnd = lambda *s, std: torch.randn(*s, generator=gen) * std
        self.frozen["vision.patch_embed.weight"] = rnd(D, c, p, p, std=0.2)
        self.frozen["vision.patch_embed.bias"] = rnd(D, std=0.1)
        self.frozen["vision.cls_token"] = rnd(1, 1, D, std=0.2)
        self.frozen["vision.pos_embed"] = rnd(1, n_img, D, std=0.2)
        self.frozen["vision.fc_norm.weight"] = 1 + rnd(D, std=0.1)
        self.frozen["vision.fc_norm.bias"] = rnd(D, std=0.1)
        self.frozen["vision.head.weight"] = rnd(VISION["num_classes"], D, std=0.2)
        self.frozen["vision.head.bias"] = rnd(VISION["num_classes"], std=0.1)
        self.frozen["language.word_embeddings.weight"] = rnd(LANGUAGE["vocab_size"], D, std=0.5)
        self.frozen["language.final_norm.weight"] = 1 + rnd(D, std=0.1)
        self.frozen["language.final_norm.bias"] = rnd(D, std=0.1)
        for i in range(LAYERS):
            for m, kind in KINDS:
                for t in ("key_param_tokens", "value_param_tokens"):
                    name = f"layers.{i}.{m}.{t}"
                    own = g[kind]["vision"] + g[kind]["language"]
                    self.frozen[name] = rnd(own, D, std=0.3)
                    self.bridge[name] = torch.nn.Parameter(rnd(BRIDGE, D, std=0.3))

    def full(self, name):
        if name in self.bridge:
            return torch.cat([self.frozen[name], self.bridge[name]], 0)
        return self.frozen[name]

    def route(self, name, vision):
        """A Pattention tensor's rows of one route: its own group, then the bridge."""
        kind = dict(KINDS)[name.split(".", 2)[2].rsplit(".", 1)[0]]
        grp = groups()[kind]
        own = self.frozen[name]
        part = own[:grp["vision"]] if vision else own[grp["vision"]:]
        return torch.cat([part, self.bridge[name]], 0)

    def pattention(self, x, prefix, vision):
        src = VISION if vision else LANGUAGE
        kind = dict(KINDS)[prefix.split(".", 2)[2]]
        scale = (src.get("pattention_scale_tokens") or {}).get(kind, src[f"{kind}_tokens"])
        k = self.route(f"{prefix}.key_param_tokens", vision)
        v = self.route(f"{prefix}.value_param_tokens", vision)
        return theta(x @ k.T, scale) @ v

    def logits(self, pixels, ids):
        b, t = ids.shape
        hd = D // HEADS
        w = self.frozen
        x = F.conv2d(pixels, w["vision.patch_embed.weight"], w["vision.patch_embed.bias"],
                     stride=VISION["patch_size"]).flatten(2).transpose(1, 2)
        img = torch.cat([w["vision.cls_token"].expand(b, 1, D), x], 1) + w["vision.pos_embed"]
        n_img = img.shape[1]
        txt = w["language.word_embeddings.weight"][ids]
        heads = lambda y: y.view(b, y.shape[1], HEADS, hd).transpose(1, 2)
        causal = torch.full((t, t), float("-inf")).triu(1)
        mask = torch.cat([torch.zeros(t, n_img), causal], 1)
        rd = int(hd * LANGUAGE["rotary_pct"])
        for i in range(LAYERS):
            a = f"layers.{i}.attention"
            hi = layer_norm(img, VISION["norm_eps"])
            qi, ki, vi = (heads(self.pattention(hi, f"{a}.{m}", True))
                          for m in ("query", "key", "value"))
            oi = torch.softmax(qi @ ki.transpose(-1, -2) / math.sqrt(hd), -1) @ vi
            new_img = img + self.pattention(oi.transpose(1, 2).reshape(b, n_img, D), f"{a}.proj", True)
            new_img = new_img + self.pattention(layer_norm(new_img, VISION["norm_eps"]),
                                                f"layers.{i}.mlp", True)
            ht = layer_norm(txt, LANGUAGE["norm_eps"])
            qt, kt, vt = (heads(self.pattention(ht, f"{a}.{m}", False))
                          for m in ("query", "key", "value"))
            qt = rotary(qt, rd, LANGUAGE["rotary_base"])
            kt = rotary(kt, rd, LANGUAGE["rotary_base"])
            k, v = torch.cat([ki, kt], 2), torch.cat([vi, vt], 2)
            ot = torch.softmax(qt @ k.transpose(-1, -2) / math.sqrt(hd) + mask, -1) @ v
            new_txt = txt + self.pattention(ot.transpose(1, 2).reshape(b, t, D), f"{a}.proj", False)
            txt = new_txt + self.pattention(layer_norm(new_txt, LANGUAGE["norm_eps"]),
                                            f"layers.{i}.mlp", False)
            img = new_img
        h = F.layer_norm(txt, (D,), w["language.final_norm.weight"], w["language.final_norm.bias"],
                         eps=LANGUAGE["norm_eps"])
        return h @ w["language.word_embeddings.weight"].T

    def loss(self, pixels, ids, mask):
        logits = self.logits(pixels, ids[:, :-1])
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                              reduction="none")
        m = mask.reshape(-1)
        return (nll * m).sum() / m.sum()


def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for k in sorted(tensors):
        t = tensors[k].detach()
        if t.dtype == torch.int64:
            a, dt = np.ascontiguousarray(t.numpy().astype("<u4")), "U32"
        else:
            a, dt = np.ascontiguousarray(t.numpy().astype("<f4")), "F32"
        header[k] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        blobs.append(a.tobytes())
        off += a.nbytes
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    gen = torch.Generator().manual_seed(11)
    model = Merged(gen)
    s = VISION["image_size"]
    pixels = torch.randn(2, 3, s, s, generator=gen)
    # Two captions of 7 and 5 tokens (+ EOS 0), the second padded with EOS.
    ids = torch.tensor([[5, 17, 42, 9, 33, 21, 0], [7, 60, 3, 12, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.float32)
    write_safetensors(os.path.join(out, "model.safetensors"),
                      {k: model.full(k) for k in model.frozen})
    write_safetensors(os.path.join(out, "batch.safetensors"),
                      {"pixels": pixels, "ids": ids, "mask": mask})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config(), f, indent=1)

    loss = model.loss(pixels, ids, mask)
    loss.backward()
    params = list(model.bridge.values())
    grads = {k: p.grad.clone() for k, p in model.bridge.items()}
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in
                                                       grads.values()])))
    # A bound below the norm, so that the step really clips.
    clip = float(f"{norm / 2:.3g}")
    total = torch.nn.utils.clip_grad_norm_(params, clip)
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    opt.step()
    flat = lambda t: [float(x) for x in t.detach().flatten()]
    res = {
        "what": "one `--train bridge` step of a tiny merged model (config.json, model.safetensors) "
                "on batch.safetensors (pixels, caption ids [b, t+1], loss mask [b, t]): mean "
                "next-token cross-entropy over the masked caption tokens; each bridge's unclipped "
                "gradient (norm, all values, rows of the bridge only); global norm; clipping at "
                "`clip`; AdamW lr 1e-3, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on the bridge "
                "rows; each tensor's bridge rows after the step (everything else is frozen)",
        "torch": torch.__version__,
        "bridge_rows": BRIDGE,
        "loss": float(loss.detach()),
        "grad_global_norm_before_clip": float(total),
        "clip": clip,
        "lr": LR,
        "grad_norm": {k: float(torch.linalg.vector_norm(g.double())) for k, g in grads.items()},
        "grad": {k: flat(g) for k, g in grads.items()},
        "bridge_after_step": {k: flat(p) for k, p in model.bridge.items()},
    }
    with open(os.path.join(out, "train_step.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
