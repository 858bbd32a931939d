//! GPUs: the catalog `--gpu` and `memest gpus` read (`data/gpus.toml`, embedded at build time),
//! the compute capability kernel choices depend on, and what stands between PyTorch's tensors and
//! the card's size: the CUDA context and the cuBLAS workspaces.
//!
//! This module knows cards and CUDA runtime facts; it knows nothing of models, tapes or the
//! simulator. [`DeviceTerms`] turns a reserved peak into what `nvidia-smi` shows.

use std::fmt;
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// The catalog's text (`data/gpus.toml`).
const CATALOG: &str = include_str!("../data/gpus.toml");

/// Who makes a GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Vendor {
    /// NVIDIA (CUDA).
    Nvidia,
    /// AMD (ROCm; PyTorch still calls the device `cuda`).
    Amd,
}

/// Where a catalog entry's total memory comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TotalFrom {
    /// What `nvidia-smi` / NVML report as `memory.total`, from a published output.
    NvidiaSmi,
    /// The datasheet's capacity in binary units (no published driver figure was found); the
    /// driver's total is at most this.
    Datasheet,
}

/// A GPU's architecture, as the kernels that PyTorch picks depend on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Arch {
    /// A CUDA compute capability `major.minor` (`9.0` is Hopper, `8.0` A100, `8.9` Ada, …).
    Cuda {
        /// Major version.
        major: u32,
        /// Minor version.
        minor: u32,
    },
    /// An AMD gfx target (`gfx90a` MI200, `gfx942` MI300), run through ROCm.
    Rocm(String),
}

impl Arch {
    /// What `--device cuda` models without `--gpu`: an H100 (sm 9.0), the GPU that
    /// `../shared/groundtruth/measure_fake_cuda.py` emulates by default (`--sm 9.0`).
    pub const DEFAULT: Arch = Arch::Cuda { major: 9, minor: 0 };

    /// Reads `"9.0"` or `"gfx942"`.
    ///
    /// # Errors
    /// A message when `s` is neither.
    pub fn parse(s: &str) -> Result<Arch, String> {
        if let Some(rest) = s.strip_prefix("gfx") {
            if !rest.is_empty() && rest.chars().all(|c| c.is_ascii_alphanumeric()) {
                return Ok(Arch::Rocm(s.to_string()));
            }
        } else if let Some((a, b)) = s.split_once('.')
            && let (Ok(major), Ok(minor)) = (a.parse(), b.parse())
        {
            return Ok(Arch::Cuda { major, minor });
        }
        Err(format!(
            "`{s}` is neither a compute capability (`9.0`) nor a gfx target (`gfx942`)"
        ))
    }

    /// The CUDA compute capability `(major, minor)`, `None` on ROCm.
    #[must_use]
    pub fn sm(&self) -> Option<(u32, u32)> {
        match self {
            Arch::Cuda { major, minor } => Some((*major, *minor)),
            Arch::Rocm(_) => None,
        }
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Arch::Cuda { major, minor } => write!(f, "{major}.{minor}"),
            Arch::Rocm(gfx) => f.write_str(gfx),
        }
    }
}

impl Serialize for Arch {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Arch {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Arch::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// One card of the catalog (`memest gpus --format json` prints these, `arch` as
/// `compute_capability`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Gpu {
    /// The name `--gpu` takes (`h100-80gb`).
    pub id: String,
    /// Other names `--gpu` takes (`h100`).
    pub aliases: Vec<String>,
    /// The name the driver reports.
    pub name: String,
    /// Who makes it.
    pub vendor: Vendor,
    /// The datasheet's memory, as marketed (`80 GB HBM3`).
    pub memory: String,
    /// Total device memory in bytes ([`TotalFrom`] says where it comes from).
    pub total_bytes: u64,
    /// Where `total_bytes` comes from.
    pub total_from: TotalFrom,
    /// Compute capability or gfx target.
    #[serde(rename(serialize = "compute_capability"))]
    pub arch: Arch,
    /// The vendor's datasheet or product page.
    pub source: String,
    /// Where the driver-reported total was published (`total_from = "nvidia-smi"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_source: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CatalogFile {
    gpu: Vec<Gpu>,
}

/// Every GPU of `data/gpus.toml`, in file order.
///
/// # Errors
/// [`Error::Internal`] if the embedded file does not parse (a unit test keeps it parsing).
pub fn catalog() -> Result<&'static [Gpu], Error> {
    static PARSED: OnceLock<Result<Vec<Gpu>, String>> = OnceLock::new();
    PARSED
        .get_or_init(|| {
            toml::from_str::<CatalogFile>(CATALOG)
                .map(|c| c.gpu)
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map(Vec::as_slice)
        .map_err(|_| Error::Internal("the embedded data/gpus.toml does not parse"))
}

/// The GPU called `name` (its id or an alias, any case, `_` read as `-`).
///
/// # Errors
/// A message naming the closest id (did-you-mean) and pointing at `memest gpus`.
pub fn find(name: &str) -> Result<&'static Gpu, String> {
    let all = catalog().map_err(|e| e.to_string())?;
    let key = name.trim().to_ascii_lowercase().replace('_', "-");
    if let Some(g) = all.iter().find(|g| g.id == key || g.aliases.contains(&key)) {
        return Ok(g);
    }
    let mut names: Vec<&str> = all.iter().map(|g| g.id.as_str()).collect();
    names.extend(
        all.iter()
            .flat_map(|g| g.aliases.iter().map(String::as_str)),
    );
    let hint = crate::error::nearest(&key, &names)
        .map(|n| format!(" (did you mean `{n}`?)"))
        .unwrap_or_default();
    Err(format!(
        "unknown GPU `{name}`{hint}; `memest gpus` lists the {} it knows",
        all.len()
    ))
}

/// The CUDA context when none is given (`--cuda-context`): 426 MiB, what `nvidia-smi` shows for
/// a process that has only created its context, measured with PyTorch 2.10 + CUDA 13.0 on an
/// RTX 6000 Ada (<https://github.com/unslothai/unsloth-zoo/pull/1053>). Since CUDA 11.7 (PyTorch
/// 1.13 sets `CUDA_MODULE_LOADING=LAZY`) kernels load into the context when first used, so the
/// context is a few hundred MiB on every architecture: "around 400MB"
/// (<https://github.com/pytorch/pytorch/issues/109888>), 287,047,680 bytes lazy against
/// 666,632,192 eager (<https://github.com/pytorch/pytorch/pull/86509>). Before it every kernel
/// was loaded up front: transformers' model-memory-anatomy guide measures 1,343 MiB on a V100
/// with CUDA 11.2. A run's context grows a little as further kernels load (cuDNN, cuBLASLt),
/// which this default leaves out. No figure was found for ROCm; the same default is used.
pub const CUDA_CONTEXT_DEFAULT_BYTES: u64 = 426 << 20;

/// cuBLAS's workspace per handle and stream (`getChosenWorkspaceSize`,
/// `aten/src/ATen/cuda/CublasHandlePool.cpp`): `:4096:2:16:8` (2 × 4 MiB + 8 × 16 KiB =
/// 8,519,680 bytes), 32 MiB on sm 9.0 (Hopper); on ROCm 32 MiB, 128 MiB on gfx94x/gfx95x.
#[must_use]
pub fn cublas_workspace_bytes(arch: &Arch) -> u64 {
    match arch {
        Arch::Cuda { major: 9, minor: 0 } => 32 << 20,
        Arch::Cuda { .. } => 2 * (4096 << 10) + 8 * (16 << 10),
        Arch::Rocm(gfx) if gfx.starts_with("gfx94") || gfx.starts_with("gfx95") => 128 << 20,
        Arch::Rocm(_) => 32 << 20,
    }
}

/// cuBLASLt's workspace per handle and stream (`getCUDABlasLtWorkspaceSize`, same file): 1 MiB
/// (`CUBLASLT_WORKSPACE_SIZE` default, kept apart from cuBLAS's unless
/// `TORCH_CUBLASLT_UNIFIED_WORKSPACE=1`); hipBLASLt's 76 MiB on ROCm.
#[must_use]
pub fn cublaslt_workspace_bytes(arch: &Arch) -> u64 {
    match arch {
        Arch::Cuda { .. } => 1 << 20,
        Arch::Rocm(_) => 76 << 20,
    }
}

/// What stands between the caching allocator's reserve and what `nvidia-smi` shows for the
/// process, for one GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct DeviceTerms {
    /// The CUDA context with PyTorch's CUDA runtime and the kernels it loaded
    /// ([`CUDA_CONTEXT_DEFAULT_BYTES`] unless `--cuda-context`).
    pub cuda_context_bytes: u64,
    /// cuBLAS and cuBLASLt workspaces: one of each per handle, and PyTorch makes a handle per
    /// thread that runs matmuls: the Python thread, and in training the autograd engine's
    /// device thread that runs backward.
    pub workspace_bytes: u64,
    /// What `nvidia-smi` shows: the reserved peak (`max_memory_reserved()`) + the context + the
    /// workspaces.
    pub device_bytes: u64,
}

impl DeviceTerms {
    /// The terms for `arch`, a context of `context` bytes (default
    /// [`CUDA_CONTEXT_DEFAULT_BYTES`]), over `reserved` bytes reserved by the caching allocator;
    /// `training` adds the autograd thread's cuBLAS handle.
    ///
    /// The workspaces go through the caching allocator in a real run, so a measured
    /// `max_memory_reserved()` includes them; memest's tensor figures do not, and they are
    /// counted here once.
    ///
    /// # Errors
    /// [`Error::Overflow`] when the sum does not fit in 64 bits.
    pub fn new(
        arch: &Arch,
        context: Option<u64>,
        reserved: u64,
        training: bool,
    ) -> Result<DeviceTerms, Error> {
        let handles: u64 = if training { 2 } else { 1 };
        let overflow = || Error::Overflow("device memory (reserved + context + workspaces)".into());
        let workspace_bytes = (cublas_workspace_bytes(arch) + cublaslt_workspace_bytes(arch))
            .checked_mul(handles)
            .ok_or_else(overflow)?;
        let cuda_context_bytes = context.unwrap_or(CUDA_CONTEXT_DEFAULT_BYTES);
        let device_bytes = reserved
            .checked_add(cuda_context_bytes)
            .and_then(|b| b.checked_add(workspace_bytes))
            .ok_or_else(overflow)?;
        Ok(DeviceTerms {
            cuda_context_bytes,
            workspace_bytes,
            device_bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catalog_parses_and_every_entry_has_its_sources() {
        let all = catalog().unwrap();
        assert!(all.len() >= 17, "{}", all.len());
        for g in all {
            assert!(g.source.starts_with("https://"), "{}: source", g.id);
            assert!(g.total_bytes > 0, "{}", g.id);
            match g.total_from {
                TotalFrom::NvidiaSmi => assert!(
                    g.total_source
                        .as_deref()
                        .is_some_and(|s| s.starts_with("https://")),
                    "{}: a driver figure needs its total_source",
                    g.id
                ),
                TotalFrom::Datasheet => {}
            }
            assert_eq!(g.id, g.id.to_ascii_lowercase(), "ids are lowercase");
            match (&g.vendor, &g.arch) {
                (Vendor::Nvidia, Arch::Cuda { .. }) | (Vendor::Amd, Arch::Rocm(_)) => {}
                _ => panic!("{}: vendor and arch disagree", g.id),
            }
        }
        // Names are unique across ids and aliases.
        let mut names: Vec<&str> = all.iter().map(|g| g.id.as_str()).collect();
        names.extend(
            all.iter()
                .flat_map(|g| g.aliases.iter().map(String::as_str)),
        );
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n, "a name is used twice");
    }

    #[test]
    fn the_issue_names_are_there() {
        for id in [
            "h100-80gb",
            "a100-40gb",
            "a100-80gb",
            "h200",
            "b200",
            "l4",
            "l40s",
            "t4",
            "v100-16gb",
            "v100-32gb",
            "a10g",
            "rtx-3090",
            "rtx-4090",
            "rtx-a6000",
            "mi250x",
            "mi300x",
        ] {
            assert_eq!(find(id).unwrap().id, id);
        }
    }

    #[test]
    fn find_reads_case_aliases_and_suggests() {
        // 81,559 MiB, what nvidia-smi reports for an 80 GB H100.
        assert_eq!(find("H100").unwrap().total_bytes, 81_559 << 20);
        assert_eq!(find("RTX_4090").unwrap().id, "rtx-4090");
        let err = find("rtx4090").unwrap_err();
        assert!(err.contains("did you mean `rtx-4090`?"), "{err}");
    }

    #[test]
    fn arch_parses_both_spellings() {
        assert_eq!(Arch::parse("8.6"), Ok(Arch::Cuda { major: 8, minor: 6 }));
        assert_eq!(Arch::parse("gfx942"), Ok(Arch::Rocm("gfx942".into())));
        assert!(Arch::parse("sm90").is_err());
        assert_eq!(Arch::DEFAULT.to_string(), "9.0");
    }

    #[test]
    fn workspaces_follow_cublas_handle_pool() {
        // :4096:2:16:8 = 8,519,680 bytes, plus cuBLASLt's 1 MiB, per handle.
        let a100 = Arch::Cuda { major: 8, minor: 0 };
        let t = DeviceTerms::new(&a100, None, 1000, false).unwrap();
        assert_eq!(t.workspace_bytes, 8_519_680 + 1_048_576);
        assert_eq!(t.device_bytes, 1000 + (426 << 20) + 8_519_680 + 1_048_576);
        // Hopper: 32 MiB; training has the autograd thread's handle too.
        let t = DeviceTerms::new(&Arch::DEFAULT, Some(0), 0, true).unwrap();
        assert_eq!(t.workspace_bytes, 2 * (33 << 20));
        assert!(DeviceTerms::new(&Arch::DEFAULT, Some(u64::MAX), 1, false).is_err());
    }
}
