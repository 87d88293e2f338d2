//! With the `cuda` feature, compiles the project's CUDA kernels
//! (`src/kernels/cuda/*.cu`) to PTX with nvcc (`$NVCC`, else `nvcc` on the
//! PATH) for `CUDA_COMPUTE_CAP` (as candle-kernels reads it; default 80, whose
//! PTX the driver also compiles for every newer GPU). ptxas (beside nvcc) then
//! assembles that PTX for `sm_CAP`, as the driver does when it loads it, so that a
//! kernel beyond a GPU's limits (more than 48 KB of static shared memory, say) fails
//! the build instead of its first launch. Without the feature: nothing.

use std::path::{Path, PathBuf};
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
    let ptxas = Path::new(&nvcc).with_file_name("ptxas");
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
        // (The cubin is only ptxas's output: the driver loads the PTX.)
        match Command::new(&ptxas)
            .arg(format!("-arch=sm_{cap}"))
            .arg("-o")
            .arg(out.join(format!("{k}.cubin")))
            .arg(&ptx)
            .status()
        {
            Ok(status) => assert!(
                status.success(),
                "{} refused {src}'s PTX for sm_{cap} (above: the kernel and the limit)",
                ptxas.display()
            ),
            Err(e) => println!(
                "cargo::warning=not checking {src}'s PTX for sm_{cap}: running {}: {e}",
                ptxas.display()
            ),
        }
    }
}
