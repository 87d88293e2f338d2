//! Where a model runs: the `--device` of the commands, `TOKENFORMER_DEVICE` and
//! the `device=` of the Python `from_pretrained` (`cpu`, `cuda`, `cuda:N`,
//! `auto`), and its resolution to a candle [`Device`].
//!
//! CUDA exists only in a build with the `cuda` cargo feature (candle's CUDA
//! backend, which needs the CUDA toolkit to build). A missing feature, driver
//! or GPU is an ordinary condition on most machines, so each is an error that
//! says what to do, never a panic.

use std::fmt;
use std::str::FromStr;

use candle_core::Device;

/// A device as a user names it, before it is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// The CPU (the default).
    #[default]
    Cpu,
    /// A CUDA GPU: `cuda` (`None`: the first GPU) or `cuda:N`.
    Cuda(Option<usize>),
    /// CUDA when compiled in and a GPU is present, else the CPU.
    Auto,
}

impl FromStr for DeviceSpec {
    type Err = DeviceError;

    /// Lowercase as torch spells devices; anything else names the bad value.
    fn from_str(s: &str) -> Result<Self, DeviceError> {
        match s {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(None)),
            "auto" => Ok(DeviceSpec::Auto),
            _ => match s.strip_prefix("cuda:") {
                // Digits only: usize's parser would also take `+1`.
                Some(n) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => n
                    .parse()
                    .map(|i| DeviceSpec::Cuda(Some(i)))
                    .map_err(|_| DeviceError::Parse(s.to_string())),
                _ => Err(DeviceError::Parse(s.to_string())),
            },
        }
    }
}

impl fmt::Display for DeviceSpec {
    /// The spelling [`FromStr`] reads back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(None) => f.write_str("cuda"),
            DeviceSpec::Cuda(Some(i)) => write!(f, "cuda:{i}"),
            DeviceSpec::Auto => f.write_str("auto"),
        }
    }
}

/// Why a device cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("unknown device `{0}`: expected cpu, cuda, cuda:N (N a GPU index from 0) or auto")]
    Parse(String),
    #[error(
        "device `{0}`: this build has no CUDA support; build it with `--features cuda` \
         (`cargo build --release --features cuda`), which needs the CUDA toolkit (the README's \
         GPU section also covers the Python package and a toolkit from pip wheels)"
    )]
    NotCompiled(DeviceSpec),
    /// No driver, no GPU, or a GPU the driver would not open.
    #[error("device `{spec}`: no usable CUDA GPU: {reason}")]
    NoGpu { spec: DeviceSpec, reason: String },
    #[error("device `{spec}`: there is no GPU {index}: this machine has {}", gpus(*count))]
    OutOfRange {
        spec: DeviceSpec,
        index: usize,
        count: usize,
    },
}

/// The dtype a model computes in (`--dtype`, the Python `dtype=`):
/// activations and products; reductions (norms, Θ's normalisation, softmax,
/// log-softmax) accumulate in f32 whatever it is. f32 is the default: it is
/// exact against the official models, and on the CPU the fused kernels
/// serve it (bf16 and f16 are for GPUs, where they are several times faster).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ComputeDtype {
    #[default]
    F32,
    Bf16,
    F16,
}

impl ComputeDtype {
    pub fn dtype(self) -> candle_core::DType {
        match self {
            ComputeDtype::F32 => candle_core::DType::F32,
            ComputeDtype::Bf16 => candle_core::DType::BF16,
            ComputeDtype::F16 => candle_core::DType::F16,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ComputeDtype::F32 => "f32",
            ComputeDtype::Bf16 => "bf16",
            ComputeDtype::F16 => "f16",
        }
    }
}

impl fmt::Display for ComputeDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ComputeDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" | "float32" => Ok(ComputeDtype::F32),
            "bf16" | "bfloat16" => Ok(ComputeDtype::Bf16),
            "f16" | "float16" => Ok(ComputeDtype::F16),
            _ => Err(format!("unknown dtype `{s}`: expected f32, bf16 or f16")),
        }
    }
}

/// Free and total bytes of the GPU `device` is on (`None` for the CPU, or
/// when the driver does not say): what an out-of-memory error reports.
pub fn gpu_memory(device: &Device) -> Option<(usize, usize)> {
    cuda::memory(device)
}

/// The most elements one candle op takes on `device`: on a GPU 2^31 − 1, since
/// candle's CUDA kernels index with 32-bit ints (signed in its softmax and norms,
/// unsigned in element-wise ops), so a larger tensor would be read wrong; on the
/// CPU no limit. Logits and attention scores are computed in slices below it.
pub(crate) fn max_op_elements(device: &Device) -> usize {
    if device.is_cpu() {
        usize::MAX
    } else {
        i32::MAX as usize
    }
}

/// The device as torch (and lm-evaluation-harness's reports) name it: `cpu`,
/// `cuda:N`.
pub fn device_name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".to_string(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("mps:{gpu_id}"),
    }
}

/// The name of the GPU `device` is on (`None` for the CPU).
pub fn gpu_name(device: &Device) -> Option<String> {
    cuda::name(device)
}

/// Whether a failed operation ran out of GPU memory (the driver's or
/// cuBLAS's code somewhere in the error's text: cudarc shows cuBLAS's as
/// `CublasError(CUBLAS_STATUS_ALLOC_FAILED)`, with no words).
pub fn is_out_of_memory(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(c) = cause {
        let text = c.to_string();
        if [
            "OUT_OF_MEMORY",
            "out of memory",
            "CUBLAS_STATUS_ALLOC_FAILED",
        ]
        .iter()
        .any(|code| text.contains(code))
        {
            return true;
        }
        cause = c.source();
    }
    false
}

/// "1 CUDA GPU (cuda:0)", "2 CUDA GPUs (cuda:0 to cuda:1)".
fn gpus(count: usize) -> String {
    match count {
        0 => "no CUDA GPU".to_string(),
        1 => "1 CUDA GPU (cuda:0)".to_string(),
        n => format!("{n} CUDA GPUs (cuda:0 to cuda:{})", n - 1),
    }
}

/// Whether this build has candle's CUDA backend (the `cuda` feature).
pub fn cuda_compiled() -> bool {
    cfg!(feature = "cuda")
}

impl DeviceSpec {
    /// Opens the device: the CPU, or the CUDA GPU asked for (`auto`: the
    /// first GPU when CUDA is compiled in and the driver sees one, else the CPU).
    pub fn resolve(self) -> Result<Device, DeviceError> {
        match self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(index) => cuda::open(self, index.unwrap_or(0)),
            // Any failure to count GPUs (no driver) means "no GPU present" here:
            // `auto` is the one spelling that asks for a fallback.
            DeviceSpec::Auto => match cuda::count() {
                Ok(n) if n > 0 => cuda::open(self, 0),
                _ => Ok(Device::Cpu),
            },
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::{DeviceError, DeviceSpec};
    use candle_core::cuda_backend::cudarc::driver::{CudaContext, DriverError};
    use candle_core::Device;

    /// "CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected".
    fn describe(e: DriverError) -> String {
        let name = e.error_name().map(|s| s.to_string_lossy().into_owned());
        let text = e.error_string().map(|s| s.to_string_lossy().into_owned());
        match (name, text) {
            (Ok(name), Ok(text)) => format!("{name}: {text}"),
            _ => format!("{e}"),
        }
    }

    /// How many GPUs the driver sees (initialising it first).
    pub(crate) fn count() -> Result<usize, String> {
        let n = CudaContext::device_count().map_err(describe)?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    pub(crate) fn open(spec: DeviceSpec, index: usize) -> Result<Device, DeviceError> {
        // Counted first so that a bad index is named as such, not as a driver code.
        let count = count().map_err(|reason| DeviceError::NoGpu { spec, reason })?;
        if count == 0 {
            return Err(DeviceError::NoGpu {
                spec,
                reason: "the CUDA driver sees no GPU".to_string(),
            });
        }
        if index >= count {
            return Err(DeviceError::OutOfRange { spec, index, count });
        }
        Device::new_cuda(index).map_err(|e| DeviceError::NoGpu {
            spec,
            reason: format!("opening GPU {index}: {e}"),
        })
    }

    pub(crate) fn memory(device: &Device) -> Option<(usize, usize)> {
        match device {
            Device::Cuda(d) => d.cuda_stream().context().mem_get_info().ok(),
            _ => None,
        }
    }

    pub(crate) fn name(device: &Device) -> Option<String> {
        match device {
            Device::Cuda(d) => d.cuda_stream().context().name().ok(),
            _ => None,
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use super::{DeviceError, DeviceSpec};
    use candle_core::Device;

    pub(crate) fn count() -> Result<usize, String> {
        Err("this build has no CUDA support".to_string())
    }

    pub(crate) fn open(spec: DeviceSpec, _index: usize) -> Result<Device, DeviceError> {
        Err(DeviceError::NotCompiled(spec))
    }

    pub(crate) fn memory(_device: &Device) -> Option<(usize, usize)> {
        None
    }

    pub(crate) fn name(_device: &Device) -> Option<String> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_spelling_and_prints_it_back() {
        for (text, spec) in [
            ("cpu", DeviceSpec::Cpu),
            ("cuda", DeviceSpec::Cuda(None)),
            ("cuda:0", DeviceSpec::Cuda(Some(0))),
            ("cuda:7", DeviceSpec::Cuda(Some(7))),
            ("auto", DeviceSpec::Auto),
        ] {
            assert_eq!(text.parse::<DeviceSpec>().unwrap(), spec, "{text}");
            assert_eq!(spec.to_string(), text);
        }
        assert_eq!(DeviceSpec::default(), DeviceSpec::Cpu);
    }

    #[test]
    fn a_bad_device_is_named() {
        for bad in [
            "",
            "gpu",
            "CUDA",
            "cuda:",
            "cuda:-1",
            "cuda:+1",
            "cuda:x",
            "cuda:0:1",
            " cpu",
            "metal",
            "cuda:99999999999999999999999",
        ] {
            let e = bad.parse::<DeviceSpec>().unwrap_err();
            assert!(
                matches!(&e, DeviceError::Parse(v) if v == bad),
                "{bad:?}: {e:?}"
            );
            let msg = e.to_string();
            assert!(msg.contains(&format!("`{bad}`")), "{msg}");
            assert!(msg.contains("cpu, cuda, cuda:N"), "{msg}");
        }
    }

    #[test]
    fn cpu_resolves_to_the_cpu() {
        assert!(DeviceSpec::Cpu.resolve().unwrap().is_cpu());
    }

    #[test]
    fn dtypes_parse_in_ours_and_torchs_spellings() {
        for (text, d) in [
            ("f32", ComputeDtype::F32),
            ("float32", ComputeDtype::F32),
            ("bf16", ComputeDtype::Bf16),
            ("bfloat16", ComputeDtype::Bf16),
            ("f16", ComputeDtype::F16),
            ("float16", ComputeDtype::F16),
        ] {
            assert_eq!(text.parse::<ComputeDtype>().unwrap(), d);
            assert_eq!(d.to_string().parse::<ComputeDtype>().unwrap(), d);
        }
        assert_eq!(ComputeDtype::Bf16.dtype(), candle_core::DType::BF16);
        let e = "fp8".parse::<ComputeDtype>().unwrap_err();
        assert!(e.contains("`fp8`") && e.contains("bf16"), "{e}");
    }

    /// The driver's and cuBLAS's out-of-memory codes are found at any depth
    /// of an error's causes; other errors are not taken for one.
    #[test]
    fn out_of_memory_is_recognised_in_the_cause_chain() {
        #[derive(Debug, thiserror::Error)]
        #[error("running layer 3")]
        struct Outer(#[source] std::io::Error);
        let driver =
            std::io::Error::other("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")");
        assert!(is_out_of_memory(&Outer(driver)));
        // As candle passes cudarc's cuBLAS error through (its Debug form).
        let cublas = std::io::Error::other("CublasError(CUBLAS_STATUS_ALLOC_FAILED)");
        assert!(is_out_of_memory(&cublas));
        let other = std::io::Error::other("CUDA_ERROR_ILLEGAL_ADDRESS");
        assert!(!is_out_of_memory(&Outer(other)));
        assert_eq!(gpu_memory(&Device::Cpu), None);
    }

    #[test]
    fn the_gpu_count_is_said_in_words() {
        assert_eq!(gpus(1), "1 CUDA GPU (cuda:0)");
        assert_eq!(gpus(4), "4 CUDA GPUs (cuda:0 to cuda:3)");
        let e = DeviceError::OutOfRange {
            spec: DeviceSpec::Cuda(Some(4)),
            index: 4,
            count: 2,
        };
        assert_eq!(
            e.to_string(),
            "device `cuda:4`: there is no GPU 4: this machine has 2 CUDA GPUs (cuda:0 to cuda:1)"
        );
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn without_the_feature_cuda_says_how_to_build_it_and_auto_is_the_cpu() {
        assert!(!cuda_compiled());
        for spec in [DeviceSpec::Cuda(None), DeviceSpec::Cuda(Some(1))] {
            let e = spec.resolve().unwrap_err();
            assert!(
                matches!(e, DeviceError::NotCompiled(s) if s == spec),
                "{e:?}"
            );
            let msg = e.to_string();
            assert!(msg.contains(&format!("`{spec}`")), "{msg}");
            assert!(msg.contains("--features cuda"), "{msg}");
        }
        assert!(DeviceSpec::Auto.resolve().unwrap().is_cpu());
    }

    /// With the feature and no GPU (the CI and these hosts, with the link
    /// stub's driver), `cuda` is a clear error and `auto` the CPU.
    #[cfg(feature = "cuda")]
    #[test]
    fn with_the_feature_and_no_gpu_cuda_is_an_error_and_auto_the_cpu() {
        assert!(cuda_compiled());
        if cuda::count().map(|n| n > 0).unwrap_or(false) {
            eprintln!("skipped: a CUDA GPU is present");
            return;
        }
        let e = DeviceSpec::Cuda(None).resolve().unwrap_err();
        assert!(matches!(e, DeviceError::NoGpu { .. }), "{e:?}");
        assert!(DeviceSpec::Auto.resolve().unwrap().is_cpu());
    }
}
