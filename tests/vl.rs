//! The merged vision-language TokenFormer (`tokenformer::models::vl`) on the
//! shipped tiny fixtures (official-lm-tiny, vit-tiny; both d 32, 2 layers,
//! 2 heads): each modality reproduces its source, the mixed sequence routes
//! and masks as the paper's unification describes (arXiv 2410.23168).

mod common;

use candle_core::{DType, Device, Tensor};
use tokenformer::checkpoint::Tensors;
use tokenformer::loader;
use tokenformer::models::tokenformer::Logits;
use tokenformer::models::vl::{self, VisionLanguageModel};

struct Fixture {
    vl: VisionLanguageModel,
    lm: tokenformer::models::tokenformer::TokenFormerLm,
    vit: tokenformer::models::vit::VisionTransformer,
    pixels: Tensor,
    ids: Vec<u32>,
    tensors: Tensors,
}

fn weights(spec: &std::path::Path) -> loader::LoadedWeights {
    let files = loader::locate(spec.to_str().unwrap(), &Default::default()).unwrap();
    loader::read_weights(&files, Some(DType::F32), &Device::Cpu).unwrap()
}

fn fixture(bridge: usize, bridge_std: f32) -> Fixture {
    let dev = Device::Cpu;
    let vdir = common::fixtures().join("vit-tiny-imagenet/vit-tiny");
    let ldir = common::lm_fixture().join("pytorch_model.bin");
    let (vw, lw) = (weights(&vdir), weights(&ldir));
    let vcfg = loader::vit_config(&vw.config, &vw.path).unwrap();
    let lcfg = loader::lm_config(&lw.config, &lw.path).unwrap();
    let cfg = vl::Config::merged(&vcfg, &lcfg, bridge).unwrap();
    let mut seed = 1u64;
    let tensors = vl::assemble(&cfg, &vw.tensors, &lw.tensors, |_, r, c| {
        seed += 1;
        common::randn(&mut rand::SeedableRng::seed_from_u64(seed), &[r, c], 1.0) * bridge_std as f64
    })
    .unwrap();
    let vl = VisionLanguageModel::from_tensors(&cfg, &tensors, &dev).unwrap();
    let lm = loader::build_lm(lw, &dev).unwrap();
    let vit = loader::build_vit(vw, &dev).unwrap();
    let pixels = candle_core::safetensors::load(
        common::fixtures().join("vit-tiny-imagenet/pixels.safetensors"),
        &dev,
    )
    .unwrap()
    .remove("pixels")
    .unwrap();
    let ids: Vec<u32> = serde_json::from_value(common::expected_lm()["ids"].clone()).unwrap();
    Fixture {
        vl,
        lm,
        vit,
        pixels,
        ids: ids[..24].to_vec(),
        tensors,
    }
}

fn abs_sum(t: &Tensor) -> f32 {
    t.abs().unwrap().sum_all().unwrap().to_scalar().unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    tokenformer::probe::max_abs_diff(a, b).unwrap()
}

fn ids_tensor(ids: &[u32]) -> Tensor {
    Tensor::new(ids, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
}

#[test]
fn each_modality_reproduces_its_source_with_random_bridge_values() {
    // Large random bridge values: any leak of a bridge token into a route would show.
    let f = fixture(16, 1.0);
    let g = f.vl.config().pattention_groups;
    assert_eq!((g.qkv.vision, g.qkv.language, g.qkv.bridge), (24, 24, 16));
    let bridge_values = f.tensors["layers.1.mlp.value_param_tokens"]
        .narrow(0, g.ffn.vision + g.ffn.language, 16)
        .unwrap();
    assert!(abs_sum(&bridge_values) > 1.0);
    let bridge_keys = f.tensors["layers.1.mlp.key_param_tokens"]
        .narrow(0, g.ffn.vision + g.ffn.language, 16)
        .unwrap();
    assert_eq!(abs_sum(&bridge_keys), 0.0);

    // Text only: the language model's scores.
    let a = tokenformer::scoring::score_ids(f.vl.language(), &f.ids).unwrap();
    let b = tokenformer::scoring::score_ids(&f.lm, &f.ids).unwrap();
    for (x, y) in a.next_token_logprobs.iter().zip(&b.next_token_logprobs) {
        assert!((x - y).abs() <= 1e-5, "{x} vs {y}");
    }
    // ... and the PyTorch reference numbers of the fixture.
    let exp: Vec<f32> =
        serde_json::from_value(common::expected_lm()["next_token_logprobs"].clone()).unwrap();
    for (x, y) in a.next_token_logprobs.iter().zip(&exp) {
        assert!((x - y).abs() <= 1e-4, "{x} vs PyTorch {y}");
    }
    // Images only: the classifier's logits.
    let li = f.vl.vision().forward(&f.pixels).unwrap();
    assert!(max_diff(&li, &f.vit.forward(&f.pixels).unwrap()) <= 1e-5);
}

#[test]
fn mixed_sequence_keeps_image_logits_and_lets_text_see_the_image() {
    let f = fixture(8, 0.02);
    let img = f.pixels.narrow(0, 0, 1).unwrap();
    let other = f.pixels.narrow(0, 3, 1).unwrap();
    let ids = ids_tensor(&f.ids);
    let (il, tl) = f.vl.forward_mixed(Some(&img), &ids, None).unwrap();
    // Image tokens attend only among themselves: exactly the classifier's logits.
    assert!(max_diff(&il.unwrap(), &f.vit.forward(&img).unwrap()) <= 1e-5);
    // Text tokens attend to the image: other image, other text logits; text only differs too.
    let (_, tl2) = f.vl.forward_mixed(Some(&other), &ids, None).unwrap();
    assert!(max_diff(&tl, &tl2) > 1e-3);
    assert!(max_diff(&tl, &f.lm.forward(&ids, None).unwrap()) > 1e-3);
    // Causal among text: the first 10 positions do not see the later tokens.
    let (_, short) =
        f.vl.forward_mixed(Some(&img), &ids_tensor(&f.ids[..10]), None)
            .unwrap();
    assert!(max_diff(&short, &tl.narrow(1, 0, 10).unwrap()) <= 1e-5);
    // Decoding with the cache (image + prefix, then one token at a time) equals the full pass.
    let mut cache = f.vl.new_cache();
    let (_, first) =
        f.vl.forward_mixed(Some(&img), &ids_tensor(&f.ids[..20]), Some(&mut cache))
            .unwrap();
    assert!(max_diff(&first, &tl.narrow(1, 0, 20).unwrap()) <= 1e-5);
    // Generation's prefill: the last text position's logits only, the same row.
    let (_, last) =
        f.vl.forward_mixed_with(
            Some(&img),
            &ids_tensor(&f.ids[..20]),
            Some(&mut f.vl.new_cache()),
            Logits::Last,
        )
        .unwrap();
    assert_eq!(last.dims()[..2], [1, 1]);
    assert!(max_diff(&last, &tl.narrow(1, 19, 1).unwrap()) <= 1e-4);
    for j in 20..24 {
        let (none, step) =
            f.vl.forward_mixed(None, &ids_tensor(&f.ids[j..j + 1]), Some(&mut cache))
                .unwrap();
        assert!(none.is_none());
        assert!(
            max_diff(&step, &tl.narrow(1, j, 1).unwrap()) <= 1e-4,
            "position {j}"
        );
    }
    assert_eq!(cache.text_len(), 24);
}

/// Several sequences, each after its own image and at its own text position,
/// decode one step together as each would alone; batched generation gives each
/// prompt the tokens its own `generate_with_image_kv` gives, whatever the batch size.
#[test]
fn rows_with_their_own_images_decode_as_each_would_alone() {
    use tokenformer::generate::{generate_batch_with_images, generate_with_image_kv};
    let f = fixture(8, 0.02);
    let images: Vec<Tensor> = [0, 3, 1]
        .iter()
        .map(|&i| f.pixels.narrow(0, i, 1).unwrap())
        .collect();
    let prompts: Vec<&[u32]> = vec![&f.ids[..5], &f.ids[2..13], &f.ids[..2]];
    let prefill = |i: usize| {
        let mut cache = f.vl.new_cache();
        f.vl.forward_mixed(Some(&images[i]), &ids_tensor(prompts[i]), Some(&mut cache))
            .unwrap();
        cache
    };
    let (mut together, mut alone): (Vec<_>, Vec<_>) =
        (0..3).map(|i| (prefill(i), prefill(i))).unzip();
    for step in 0..3u32 {
        let next: Vec<u32> = (0..3).map(|r| 100 + 1000 * r + 7 * step).collect();
        let ids = Tensor::new(&next[..], &Device::Cpu)
            .unwrap()
            .unsqueeze(1)
            .unwrap();
        let mut caches: Vec<_> = together.iter_mut().collect();
        let got = f.vl.forward_rows(&ids, &mut caches).unwrap();
        assert_eq!(got.dims(), &[3, 1, f.vl.language().config().vocab_size]);
        for (r, cache) in alone.iter_mut().enumerate() {
            let (_, want) =
                f.vl.forward_mixed(None, &ids_tensor(&next[r..r + 1]), Some(cache))
                    .unwrap();
            let d = max_diff(&got.get(r).unwrap(), &want.squeeze(0).unwrap());
            assert!(d <= 1e-4, "step {step}, row {r}: {d}");
            assert_eq!(together[r].text_len(), prompts[r].len() + step as usize + 1);
        }
        // Each row saw its own image at its own position: no two rows alike.
        assert!(max_diff(&got.get(0).unwrap(), &got.get(1).unwrap()) > 1e-3);
    }

    let kv = tokenformer::KvDtype::F32;
    let params = tokenformer::SamplingParams {
        temperature: 0.9,
        seed: 5,
        ..Default::default()
    };
    for params in [Default::default(), params] {
        let alone: Vec<Vec<u32>> = (0..3)
            .map(|i| {
                generate_with_image_kv(&f.vl, kv, &images[i], prompts[i], 6, params.clone(), |_| {
                    Ok(std::ops::ControlFlow::Continue(()))
                })
                .unwrap()
            })
            .collect();
        assert_ne!(alone[0], alone[1]);
        for batch in [1, 2, 8] {
            let got = generate_batch_with_images(
                &f.vl,
                kv,
                &images,
                &prompts,
                6,
                params.clone(),
                batch,
                |_, _| Ok(std::ops::ControlFlow::Continue(())),
            )
            .unwrap();
            assert_eq!(got, alone, "batch {batch}, {params:?}");
        }
    }
    let e = generate_batch_with_images(
        &f.vl,
        kv,
        &images[..2],
        &prompts,
        6,
        Default::default(),
        2,
        |_, _| Ok(std::ops::ControlFlow::Continue(())),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("3 prompts but 2 images"), "{e}");
}

#[test]
fn mismatched_sources_are_refused() {
    let vw = weights(&common::fixtures().join("vit-tiny-imagenet/vit-tiny"));
    let mut vcfg = loader::vit_config(&vw.config, &vw.path).unwrap();
    let lw = weights(&common::lm_fixture().join("pytorch_model.bin"));
    let lcfg = loader::lm_config(&lw.config, &lw.path).unwrap();
    vcfg.num_layers = 3;
    let e = vl::Config::merged(&vcfg, &lcfg, 4).unwrap_err();
    assert!(e.contains("num_layers 3") && e.contains("2"), "{e}");
}
