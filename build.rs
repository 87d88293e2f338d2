//! With the `cuda` feature, compiles the project's CUDA kernels
//! (`src/kernels/cuda/*.cu`) to PTX with nvcc (`$NVCC`, else `nvcc` on the
//! PATH) for `CUDA_COMPUTE_CAP` (as candle-kernels reads it; default 80, whose
//! PTX the driver also compiles for every newer GPU). Without it: nothing.

use std::path::PathBuf;
use std::process::Command;

const KERNELS: [&str; 7] = [
    "theta",
    "softmax",
    "norm",
    "attention",
    "logprob",
    "adamw",
    "rotary",
];

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    println!("cargo::rerun-if-env-changed=NVCC");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".to_string());
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".to_string());
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    // Included by every kernel.
    println!("cargo::rerun-if-changed=src/kernels/cuda/rows.cuh");
    for k in KERNELS {
        let src = format!("src/kernels/cuda/{k}.cu");
        println!("cargo::rerun-if-changed={src}");
        let ptx = out.join(format!("{k}.ptx"));
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", &format!("-arch=compute_{cap}"), "-o"])
            .arg(&ptx)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| {
                panic!("running {nvcc} for {src} (the `cuda` feature needs the CUDA toolkit): {e}")
            });
        assert!(status.success(), "{nvcc} failed on {src}");
    }
}
