//! `tokenformer bench`: throughput on random weights of the real sizes,
//! comparable key by key with the PyTorch peer's JSON.

use anyhow::{anyhow, Result};
use candle_core::Device;
use clap::Args;
use tokenformer::bench;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Shape to benchmark: 150m, 450m, 900m or 1.5b (random weights).
    #[arg(long, default_value = "150m")]
    pub config: String,
    /// Skip the ViT-B/16 image benchmark.
    #[arg(long)]
    pub skip_vit: bool,
    /// Run only these parts (comma-separated): prefill, decode, decode_f16, decode_q8, pattention,
    /// matmul, vit, train (training throughput; not run unless named). `TOKENFORMER_KERNELS=portable|avx2|avx512` forces a kernel path.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Print one JSON object (the peer's field names).
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: BenchArgs) -> Result<()> {
    let cfg = bench::lm_config(&a.config)
        .ok_or_else(|| anyhow!("unknown --config `{}` (150m, 450m, 900m, 1.5b)", a.config))?;
    let dev = Device::Cpu;
    let mut only = a.only.clone();
    if a.skip_vit {
        if only.is_empty() {
            only = [
                "load",
                "prefill",
                "decode",
                "decode_f16",
                "decode_q8",
                "pattention",
                "matmul",
            ]
            .map(String::from)
            .to_vec();
        }
        only.retain(|o| o != "vit");
    }
    // `train` (only when asked for): training throughput, see bench_train.
    let train = only.iter().any(|o| o == "train");
    only.retain(|o| o != "train");
    let mut out = if train && only.is_empty() {
        serde_json::Map::new()
    } else {
        bench::run_lm(&a.config, &cfg, &dev, &only)?
    };
    if train {
        out.extend(super::bench_train::run(&dev)?);
    }
    if a.json {
        println!("{}", serde_json::to_string(&out)?);
    } else {
        for (k, v) in &out {
            println!("{k:<32} {v}");
        }
    }
    Ok(())
}
