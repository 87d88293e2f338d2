#!/usr/bin/env python3
"""Writes converters/tests/fixtures/import/: tiny random source models in their
native layouts and what the real peers compute on the shipped samples
(assets/samples), so the Rust tests check `tokenformer-convert import` against
transformers and timm without Python.

- vit-hf/: transformers `ViTForImageClassification` (save_pretrained) with a
  `ViTImageProcessor` preprocessor_config.json (32 px, bilinear, no crop).
- vit-timm/: timm `VisionTransformer` saved as on the Hub (`save_for_hf`:
  config.json with model_args and pretrained_cfg; 32 px, crop_pct 0.875, bicubic,
  average pooling).
- pythia/: transformers `GPTNeoXForCausalLM`, Pythia-style (parallel residual,
  untied head), with a 320-token byte-level BPE tokenizer learnt on the KJV.
- peers.safetensors: pixels of each processor (transformers' Pillow backend,
  timm's eval transform in its center and squash crop modes) on the shipped photos, the sources'
  logits on them; the Pythia source's token ids, logits and per-layer activations
  on pythia-eval.txt (the first words of the shipped eval text), and its
  per-token NLL and top-1 on the whole shipped eval text.

Usage: scripts/import_fixtures.py [--out converters/tests/fixtures/import]
Needs: pip install torch transformers timm pillow safetensors tokenizers; the
weights are random (seeded), so the files only change with the libraries.
"""

import argparse
import glob
import json
import os
import subprocess
import tempfile

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file

SAMPLES = "assets/samples"
WINDOW = 128  # the Pythia fixture's max_position_embeddings: the eval window


def photos(split):
    return sorted(glob.glob(os.path.join(SAMPLES, "photos", split, "*.jpg")))


def rgb(paths):
    return [Image.open(p).convert("RGB") for p in paths]


@torch.no_grad()
def randomise(model, gen, std_scale=1.0):
    """Weights far from the usual 0.02 init, so that every part matters: linear
    weights N(0, 1/fan_in), biases and norm offsets N(0, 0.1), norm scales 1 + N(0, 0.1)."""
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            fan_in = p[0].numel()
            p.copy_(torch.randn(p.shape, generator=gen) * std_scale / fan_in**0.5)
        elif name.endswith("weight") and "norm" in name.lower():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def vit_hf(out, peers, gen):
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    cfg = ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=2, intermediate_size=64, num_labels=10,
                    id2label={i: f"class {i}" for i in range(10)},
                    label2id={f"class {i}": i for i in range(10)})
    model = ViTForImageClassification(cfg).eval()
    randomise(model, gen)
    with torch.no_grad():
        model.vit.embeddings.cls_token.normal_(0, 0.5, generator=gen)
        model.vit.embeddings.position_embeddings.normal_(0, 0.5, generator=gen)
    d = os.path.join(out, "vit-hf")
    model.save_pretrained(d)
    kw = dict(size={"height": 32, "width": 32}, resample=2)
    pil = ViTImageProcessorPil(**kw)
    pil.save_pretrained(d)
    tv = ViTImageProcessor(**kw)
    ims = rgb(photos("eval"))
    px = pil(ims, return_tensors="pt")["pixel_values"].float()
    peers["hf.eval.pixels"] = px
    with torch.no_grad():
        peers["hf.eval.logits"] = model(pixel_values=px).logits.float()
    # The torchvision backend (AutoImageProcessor's default) resizes with torch's
    # kernels: within a level or two of Pillow's.
    tvx = tv(ims, return_tensors="pt")["pixel_values"].float()
    return float((tvx - px).abs().max() * 127.5)


def vit_timm(out, peers, gen):
    import timm
    from timm.data import create_transform, resolve_data_config
    from timm.models import save_for_hf

    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
        depth=2, num_heads=2, mlp_ratio=2.0, num_classes=10, global_pool="avg",
        pretrained_cfg_overlay=dict(input_size=(3, 32, 32), crop_pct=0.875,
                                    interpolation="bicubic", mean=(0.485, 0.456, 0.406),
                                    std=(0.229, 0.224, 0.225))).eval()
    randomise(model, gen)
    with torch.no_grad():
        model.cls_token.normal_(0, 0.5, generator=gen)
        model.pos_embed.normal_(0, 0.5, generator=gen)
    d = os.path.join(out, "vit-timm")
    save_for_hf(model, d, model_args=dict(img_size=32, patch_size=8, embed_dim=32, depth=2,
                                          num_heads=2, mlp_ratio=2.0, global_pool="avg"),
                safe_serialization=True)
    t = create_transform(**resolve_data_config({}, model=model))
    px = torch.stack([t(im) for im in rgb(photos("eval"))]).float()
    peers["timm.eval.pixels"] = px
    # timm's other crop mode: both sides to floor(32 / 0.875) = 36, then the centre crop.
    sq = create_transform(input_size=(3, 32, 32), crop_pct=0.875, crop_mode="squash",
                          interpolation="bilinear", mean=(0.485, 0.456, 0.406),
                          std=(0.229, 0.224, 0.225))
    peers["timm.eval.pixels_squash"] = torch.stack([sq(im) for im in rgb(photos("eval"))]).float()
    with torch.no_grad():
        peers["timm.eval.logits"] = model(px).float()


def kjv(tmp):
    subprocess.run(["apt-get", "download", "bible-kjv", "bible-kjv-text"], cwd=tmp, check=True)
    root = os.path.join(tmp, "root")
    for deb in sorted(os.listdir(tmp)):
        if deb.endswith(".deb"):
            subprocess.run(["dpkg-deb", "-x", os.path.join(tmp, deb), root], check=True)
    exe = os.path.join(root, "usr", "bin", "bible")
    return subprocess.run([exe, "-p", os.path.join(root, "usr", "lib"), "Gen1:1-Rev22:21"],
                          stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                          check=True).stdout.decode()


def tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with tempfile.TemporaryDirectory() as tmp:
        text = kjv(tmp)
    tok.train_from_iterator([text], trainer)
    tok.save(path)
    return tok


def windows(ids):
    return [ids[i:i + WINDOW] for i in range(0, len(ids), WINDOW)]


def pythia(out, peers, gen):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    d = os.path.join(out, "pythia")
    os.makedirs(d, exist_ok=True)
    tok = tokenizer(os.path.join(d, "tokenizer.json"))
    cfg = GPTNeoXConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128, rotary_pct=0.5,
                        max_position_embeddings=WINDOW, layer_norm_eps=1e-5,
                        use_parallel_residual=True, tie_word_embeddings=False,
                        hidden_act="gelu", eos_token_id=0, bos_token_id=0)
    model = GPTNeoXForCausalLM(cfg).eval()
    randomise(model, gen)
    with torch.no_grad():
        # Embeddings of variance ~1 (eps/var ~1e-5: the q/k/v maps are exact), and
        # layer 1 without an MLP pre-activation bias (its MLP is exact too).
        model.gpt_neox.embed_in.weight.normal_(0, 1.0, generator=gen)
        model.gpt_neox.layers[1].post_attention_layernorm.bias.zero_()
        model.gpt_neox.layers[1].mlp.dense_h_to_4h.bias.zero_()
    model.save_pretrained(d)
    eval_text = open(os.path.join(SAMPLES, "text", "eval.txt")).read()
    excerpt = " ".join(eval_text.split()[:90]) + "\n"
    with open(os.path.join(out, "pythia-eval.txt"), "w") as f:
        f.write(excerpt)

    def run(ids, trace=False):
        """Logits [n, vocab] over WINDOW-token windows; activations of window 0."""
        acts, hooks = {}, []
        if trace:
            for i, layer in enumerate(model.gpt_neox.layers):
                def keep(name):
                    def hook(mod, inp, outp):
                        if name + ".in" not in acts:
                            x = inp[0] if isinstance(inp, tuple) and inp else inp
                            acts[name + ".in"] = x[0].detach().clone()
                            o = outp[0] if isinstance(outp, tuple) else outp
                            acts[name + ".out"] = o[0].detach().clone()
                    return hook
                hooks += [
                    layer.register_forward_hook(keep(f"pythia.l{i}.layer")),
                    layer.attention.query_key_value.register_forward_hook(keep(f"pythia.l{i}.qkv")),
                    layer.attention.dense.register_forward_hook(keep(f"pythia.l{i}.dense")),
                    layer.mlp.register_forward_hook(keep(f"pythia.l{i}.mlp")),
                ]
        logits = []
        with torch.no_grad():
            for w in windows(ids):
                logits.append(model(torch.tensor([w])).logits[0].float())
        for h in hooks:
            h.remove()
        return torch.cat(logits), acts

    ids = tok.encode(excerpt, add_special_tokens=False).ids
    logits, acts = run(ids, trace=True)
    peers["pythia.excerpt.ids"] = torch.tensor(ids, dtype=torch.int64)
    peers["pythia.excerpt.logits"] = logits
    # Layer input and output, q/k/v (fused, per head), the attention output before and
    # after its projection, the MLP's output.
    for k in ["layer.in", "layer.out", "qkv.out", "dense.in", "dense.out", "mlp.out"]:
        for i in range(cfg.num_hidden_layers):
            peers[f"pythia.l{i}.{k}"] = acts[f"pythia.l{i}.{k}"].float()
    ids = tok.encode(eval_text, add_special_tokens=False).ids
    logits, _ = run(ids)
    nll = []
    for i, w in enumerate(windows(ids)):
        lp = torch.log_softmax(logits[i * WINDOW:i * WINDOW + len(w)], -1)
        nll += [-lp[j, w[j + 1]].item() for j in range(len(w) - 1)]
    peers["pythia.shipped.ids"] = torch.tensor(ids, dtype=torch.int64)
    peers["pythia.shipped.nll"] = torch.tensor(nll, dtype=torch.float64)
    peers["pythia.shipped.top1"] = logits.argmax(-1).to(torch.int64)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="converters/tests/fixtures/import")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    gen = torch.Generator().manual_seed(20)
    peers = {}
    tv_levels = vit_hf(a.out, peers, gen)
    vit_timm(a.out, peers, gen)
    pythia(a.out, peers, gen)
    save_file({k: v.contiguous() for k, v in peers.items()}, os.path.join(a.out, "peers.safetensors"))
    import timm
    import transformers
    with open(os.path.join(a.out, "versions.json"), "w") as f:
        json.dump({"torch": torch.__version__, "transformers": transformers.__version__,
                   "timm": timm.__version__, "pillow": Image.__version__,
                   "vit_image_processor_torchvision_vs_pillow_max_levels": tv_levels,
                   "photos": {s: [os.path.basename(p) for p in photos(s)]
                              for s in ["calibration", "eval"]}}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
