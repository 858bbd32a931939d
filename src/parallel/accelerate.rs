//! An accelerate config (`--accelerate config.yaml`, what `accelerate config` writes) read into
//! a [`ConfigPlan`].
//!
//! The keys follow accelerate's `ClusterConfig` (`accelerate/commands/config/config_args.py`)
//! and how `accelerate launch` turns them into plugins (`accelerate/utils/dataclasses.py`:
//! `FullyShardedDataParallelPlugin`, `DeepSpeedPlugin`):
//!
//! - `distributed_type`: `NO` (one GPU), `MULTI_GPU` (DDP), `FSDP` (`fsdp_config`),
//!   `DEEPSPEED` (`deepspeed_config`, inline keys or a `deepspeed_config_file`);
//! - `num_processes`: the world size;
//! - `deepspeed_config.zero_stage`: unset is stage 2 (`DeepSpeedPlugin.__post_init__`);
//! - `fsdp_config.fsdp_version`: unset is 1 (`FullyShardedDataParallelPlugin.__post_init__`);
//!   memest models FSDP2 only and names any other version in a note;
//! - `mixed_precision`: under FSDP a `MixedPrecisionPolicy` with 16-bit `param_dtype` over
//!   float32 shards (memest's `mixed-bf16`/`mixed-fp16` recipes), under DeepSpeed its
//!   `bf16`/`fp16` section (`DeepSpeedPlugin.set_mixed_precision`), else autocast (`--amp`);
//!   under FSDP the policy's `reduce_dtype` is that 16-bit dtype too
//!   (`FullyShardedDataParallelPlugin.set_mixed_precision`: `{"param_dtype": dtype,
//!   "reduce_dtype": dtype}`), so gradients are reduce-scattered in it.

use serde_json::{Map, Value};

use super::{ConfigEngine, ConfigNote, ConfigPlan, FsdpStrategy, Offload, OffloadTarget, Zero};
use crate::cost::{Amp, RecipeName};
use crate::dtype::DType;
use crate::error::{Error, SettingKey};

/// Top-level keys: `true` when memest reads it.
const TOP: &[(&str, bool)] = &[
    ("distributed_type", true),
    ("num_processes", true),
    ("mixed_precision", true),
    ("fsdp_config", true),
    ("deepspeed_config", true),
    ("num_machines", false),
    ("machine_rank", false),
    ("compute_environment", false),
    ("main_training_function", false),
    ("main_process_ip", false),
    ("main_process_port", false),
    ("rdzv_backend", false),
    ("same_network", false),
    ("use_cpu", false),
    ("debug", false),
    ("downcast_bf16", false),
    ("enable_cpu_affinity", false),
    ("gpu_ids", false),
    ("tpu_env", false),
    ("tpu_use_cluster", false),
    ("tpu_use_sudo", false),
    ("tpu_name", false),
    ("tpu_zone", false),
    ("commands", false),
    ("command_file", false),
    ("dynamo_config", false),
    ("megatron_lm_config", false),
    ("ipex_config", false),
    ("mpirun_config", false),
    ("fp8_config", false),
    ("parallelism_config", false),
];

/// `fsdp_config` keys (`FullyShardedDataParallelPlugin`): `true` when memest reads it.
const FSDP: &[(&str, bool)] = &[
    ("fsdp_sharding_strategy", true),
    ("fsdp_reshard_after_forward", true),
    ("fsdp_offload_params", true),
    ("fsdp_activation_checkpointing", true),
    ("fsdp_version", true),
    ("fsdp_auto_wrap_policy", false),
    ("fsdp_transformer_layer_cls_to_wrap", false),
    ("fsdp_min_num_params", false),
    ("fsdp_backward_prefetch", false),
    ("fsdp_backward_prefetch_policy", false),
    ("fsdp_forward_prefetch", false),
    ("fsdp_state_dict_type", false),
    ("fsdp_sync_module_states", false),
    ("fsdp_use_orig_params", false),
    ("fsdp_cpu_ram_efficient_loading", false),
];

/// `deepspeed_config` keys (`DeepSpeedPlugin`): `true` when memest reads it.
const DEEPSPEED: &[(&str, bool)] = &[
    ("deepspeed_config_file", true),
    ("zero_stage", true),
    ("offload_optimizer_device", true),
    ("offload_param_device", true),
    ("gradient_accumulation_steps", true),
    ("offload_optimizer_nvme_path", false),
    ("offload_param_nvme_path", false),
    ("gradient_clipping", false),
    ("zero3_init_flag", false),
    ("zero3_save_16bit_model", false),
    ("deepspeed_multinode_launcher", false),
    ("deepspeed_hostfile", false),
    ("deepspeed_exclusion_filter", false),
    ("deepspeed_inclusion_filter", false),
    ("deepspeed_moe_layer_cls_names", false),
];

/// Keys that never change memory (launch and checkpoint details): no note for them.
const NO_EFFECT: &[&str] = &[
    "num_machines",
    "machine_rank",
    "compute_environment",
    "main_training_function",
    "main_process_ip",
    "main_process_port",
    "rdzv_backend",
    "same_network",
    "debug",
    "enable_cpu_affinity",
    "gpu_ids",
    "tpu_env",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "tpu_name",
    "tpu_zone",
    "commands",
    "command_file",
    "dynamo_config",
    "mpirun_config",
    "use_cpu",
    "fsdp_auto_wrap_policy",
    "fsdp_transformer_layer_cls_to_wrap",
    "fsdp_state_dict_type",
    "fsdp_sync_module_states",
    "fsdp_use_orig_params",
    "fsdp_cpu_ram_efficient_loading",
    "offload_optimizer_nvme_path",
    "offload_param_nvme_path",
    "gradient_clipping",
    "zero3_init_flag",
    "zero3_save_16bit_model",
    "deepspeed_multinode_launcher",
    "deepspeed_hostfile",
    "deepspeed_exclusion_filter",
    "deepspeed_inclusion_filter",
];

/// An accelerate config read: the plan, and the DeepSpeed config file it names (the caller
/// reads it with [`super::deepspeed::read`] and [`merge_deepspeed`]).
#[derive(Clone, Debug, PartialEq)]
pub struct AccelerateConfig {
    /// The plan the YAML states.
    pub plan: ConfigPlan,
    /// `deepspeed_config.deepspeed_config_file`, as written (relative to where memest runs,
    /// as `accelerate launch` reads it).
    pub deepspeed_config_file: Option<String>,
}

/// Reads an accelerate config from its YAML text.
///
/// # Errors
/// [`Error::Setting`] ([`SettingKey::Parallel`]) for text that is not a YAML mapping, an
/// unknown `distributed_type`, `mixed_precision` or sharding strategy, or a value of the wrong
/// type, each with its key.
pub fn read(text: &str) -> Result<AccelerateConfig, Error> {
    let value: Value =
        serde_norway::from_str(text).map_err(|e| bad("", &format!("not YAML: {e}")))?;
    let Value::Object(top) = value else {
        return Err(bad("", "an accelerate config is a YAML mapping"));
    };
    let mut plan = ConfigPlan::default();
    check_keys(&top, "", TOP, &mut plan.notes);
    plan.gpus = match top.get("num_processes") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().filter(|n| *n > 0).ok_or_else(|| {
            bad(
                "num_processes",
                &format!("expected a count of at least 1, got {v}"),
            )
        })?),
    };
    let dtype_kind = text_of(&top, "distributed_type")?.unwrap_or_else(|| "NO".into());
    let precision = text_of(&top, "mixed_precision")?.unwrap_or_else(|| "no".into());
    let half = match precision.to_ascii_lowercase().as_str() {
        "no" => None,
        "bf16" => Some(DType::Bfloat16),
        "fp16" => Some(DType::Float16),
        "fp8" => {
            plan.notes.push(ConfigNote {
                key: "mixed_precision".into(),
                message: "fp8: not modelled (FP8 through Transformer Engine or MS-AMP); estimated without mixed precision".into(),
            });
            None
        }
        other => {
            return Err(bad(
                "mixed_precision",
                &format!("expected no, fp16, bf16 or fp8, got {other}"),
            ));
        }
    };
    let mut deepspeed_config_file = None;
    match dtype_kind.to_ascii_uppercase().as_str() {
        "NO" => {
            plan.gpus = None;
            plan.amp = half.map(amp_of);
        }
        "MULTI_GPU" => {
            plan.engine = Some(ConfigEngine::Ddp);
            plan.amp = half.map(amp_of);
        }
        "FSDP" => {
            let empty = Map::new();
            let f = match top.get("fsdp_config") {
                Some(Value::Object(o)) => o,
                None | Some(Value::Null) => &empty,
                Some(v) => return Err(bad("fsdp_config", &format!("expected a mapping, got {v}"))),
            };
            check_keys(f, "fsdp_config", FSDP, &mut plan.notes);
            let (strategy, reshard) = fsdp(f)?;
            // `FullyShardedDataParallelPlugin.__post_init__`: `fsdp_version` unset is
            // `int(os.environ.get("FSDP_VERSION", "1"))` (and `accelerate launch` passes "1"):
            // FSDP1, whose flat parameters memest does not model.
            let version = f.get("fsdp_version").and_then(|v| {
                v.as_u64()
                    .or_else(|| v.as_str().and_then(|s| s.trim().parse().ok()))
            });
            if version != Some(2) {
                plan.notes.push(ConfigNote {
                    key: "fsdp_config.fsdp_version".into(),
                    message: format!(
                        "{}: FSDP1 is not modelled; estimated as FSDP2 (fully_shard) with the same strategy",
                        f.get("fsdp_version")
                            .map_or_else(|| "unset (accelerate's default is 1)".to_string(), ToString::to_string)
                    ),
                });
            }
            plan.engine = Some(ConfigEngine::Fsdp(strategy, reshard));
            if truthy(f, "fsdp_config", "fsdp_offload_params")? == Some(true) {
                plan.offload = Offload {
                    optimizer: Some(OffloadTarget::Cpu),
                    params: Some(OffloadTarget::Cpu),
                    pin_memory: true,
                };
            }
            if let Some(c) = truthy(f, "fsdp_config", "fsdp_activation_checkpointing")? {
                plan.checkpoint = Some(c);
            }
            plan.fsdp_reduce_dtype = half;
            plan.recipe = half.map(|d| {
                if d == DType::Float16 {
                    RecipeName::MixedFp16
                } else {
                    RecipeName::MixedBf16
                }
            });
        }
        "DEEPSPEED" => {
            let empty = Map::new();
            let d = match top.get("deepspeed_config") {
                Some(Value::Object(o)) => o,
                None | Some(Value::Null) => &empty,
                Some(v) => {
                    return Err(bad(
                        "deepspeed_config",
                        &format!("expected a mapping, got {v}"),
                    ));
                }
            };
            check_keys(d, "deepspeed_config", DEEPSPEED, &mut plan.notes);
            deepspeed_config_file = text_of(d, "deepspeed_config_file")?;
            if deepspeed_config_file.is_none() {
                // `DeepSpeedPlugin.__post_init__`: `zero_stage` unset is
                // `int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2))`: stage 2.
                let stage = match d.get("zero_stage") {
                    None | Some(Value::Null) => 2,
                    Some(v) => v
                        .as_u64()
                        .filter(|s| *s <= 3)
                        .and_then(|s| u8::try_from(s).ok())
                        .ok_or_else(|| {
                            bad(
                                "deepspeed_config.zero_stage",
                                &format!("expected 0 to 3, got {v}"),
                            )
                        })?,
                };
                plan.engine = Some(ConfigEngine::Zero(Zero::stage(stage)));
                for (key, is_param) in [
                    ("offload_optimizer_device", false),
                    ("offload_param_device", true),
                ] {
                    let target = match text_of(d, key)?
                        .as_deref()
                        .map(str::to_ascii_lowercase)
                        .as_deref()
                    {
                        None | Some("none") => None,
                        Some("cpu") => Some(OffloadTarget::Cpu),
                        Some("nvme") => Some(OffloadTarget::Nvme),
                        Some(other) => {
                            return Err(bad(
                                &format!("deepspeed_config.{key}"),
                                &format!("expected none, cpu or nvme, got {other}"),
                            ));
                        }
                    };
                    if is_param {
                        plan.offload.params = target;
                    } else {
                        plan.offload.optimizer = target;
                    }
                }
                if let Some(v) = d.get("gradient_accumulation_steps") {
                    plan.grad_accum = Some(v.as_u64().filter(|n| *n > 0).ok_or_else(|| {
                        bad(
                            "deepspeed_config.gradient_accumulation_steps",
                            &format!("expected a count of at least 1, got {v}"),
                        )
                    })?);
                }
            }
            plan.dtype = half;
        }
        other => {
            return Err(bad(
                "distributed_type",
                &format!("{other} is not modelled: expected NO, MULTI_GPU, FSDP or DEEPSPEED"),
            ));
        }
    }
    Ok(AccelerateConfig {
        plan,
        deepspeed_config_file,
    })
}

/// Puts a DeepSpeed config file named by an accelerate config under it: the DeepSpeed file
/// gives the engine and its options; accelerate gives the world size, and its
/// `mixed_precision` where the DeepSpeed file enables neither `bf16` nor `fp16`.
#[must_use]
pub fn merge_deepspeed(accelerate: ConfigPlan, mut deepspeed: ConfigPlan) -> ConfigPlan {
    deepspeed.gpus = accelerate.gpus.or(deepspeed.gpus);
    deepspeed.dtype = deepspeed.dtype.or(accelerate.dtype);
    let mut notes = accelerate.notes;
    notes.append(&mut deepspeed.notes);
    deepspeed.notes = notes;
    deepspeed
}

/// FSDP's strategy and `reshard_after_forward`: FSDP1's `fsdp_sharding_strategy` (a name or
/// its number, 1 = `FULL_SHARD` … 4 = `HYBRID_SHARD`), and FSDP2's `fsdp_reshard_after_forward`
/// (a boolean, or a strategy name in older files: accelerate maps `FULL_SHARD`/`HYBRID_SHARD`
/// to true and the others to false).
fn fsdp(f: &Map<String, Value>) -> Result<(FsdpStrategy, Option<bool>), Error> {
    let by_name = |s: &str, key: &str| -> Result<FsdpStrategy, Error> {
        Ok(match s.to_ascii_uppercase().as_str() {
            "FULL_SHARD" | "1" => FsdpStrategy::FullShard,
            "SHARD_GRAD_OP" | "2" => FsdpStrategy::ShardGradOp,
            "NO_SHARD" | "3" => FsdpStrategy::NoShard,
            "HYBRID_SHARD" | "4" => FsdpStrategy::HybridShard,
            other => {
                return Err(bad(
                    &format!("fsdp_config.{key}"),
                    &format!(
                        "expected FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD, got {other} (HYBRID_SHARD_ZERO2 is not modelled)"
                    ),
                ));
            }
        })
    };
    let strategy = match f.get("fsdp_sharding_strategy") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(by_name(s, "fsdp_sharding_strategy")?),
        Some(Value::Number(n)) => Some(by_name(&n.to_string(), "fsdp_sharding_strategy")?),
        Some(v) => {
            return Err(bad(
                "fsdp_config.fsdp_sharding_strategy",
                &format!("expected a strategy name, got {v}"),
            ));
        }
    };
    let reshard = match f.get("fsdp_reshard_after_forward") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(Value::String(s)) if s.eq_ignore_ascii_case("true") => Some(true),
        Some(Value::String(s)) if s.eq_ignore_ascii_case("false") => Some(false),
        Some(Value::String(s)) => {
            let st = by_name(s, "fsdp_reshard_after_forward")?;
            return Ok((strategy.unwrap_or(st), None));
        }
        Some(v) => {
            return Err(bad(
                "fsdp_config.fsdp_reshard_after_forward",
                &format!("expected true or false, got {v}"),
            ));
        }
    };
    // FSDP2 (`fsdp_version: 2`) states the strategy through `reshard_after_forward` alone:
    // false is SHARD_GRAD_OP's behaviour.
    let strategy = strategy.unwrap_or(match reshard {
        Some(false) => FsdpStrategy::ShardGradOp,
        _ => FsdpStrategy::FullShard,
    });
    Ok((strategy, reshard))
}

fn amp_of(d: DType) -> Amp {
    if d == DType::Float16 {
        Amp::Fp16
    } else {
        Amp::Bf16
    }
}

fn check_keys(
    obj: &Map<String, Value>,
    at: &str,
    known: &[(&str, bool)],
    notes: &mut Vec<ConfigNote>,
) {
    for (key, value) in obj {
        let path = ConfigNote::path(at, key);
        match known.iter().find(|k| k.0 == key) {
            Some((_, true)) => {}
            Some((name, false)) if NO_EFFECT.contains(name) => {}
            Some(_) => {
                let off = matches!(value, Value::Null | Value::Bool(false))
                    || value.as_object().is_some_and(Map::is_empty);
                if !off {
                    notes.push(ConfigNote::not_modelled(path));
                }
            }
            None => {
                let names: Vec<&str> = known.iter().map(|k| k.0).collect();
                notes.push(ConfigNote::unknown(path, key, &names, "an accelerate"));
            }
        }
    }
}

fn text_of(obj: &Map<String, Value>, key: &str) -> Result<Option<String>, Error> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Number(n)) => Ok(Some(n.to_string())),
        Some(Value::Bool(b)) => Ok(Some(b.to_string())),
        Some(v) => Err(bad(key, &format!("expected a string, got {v}"))),
    }
}

/// A YAML boolean, or the strings `true`/`false` accelerate writes for some fields.
fn truthy(obj: &Map<String, Value>, at: &str, key: &str) -> Result<Option<bool>, Error> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(Value::String(s)) if s.eq_ignore_ascii_case("true") => Ok(Some(true)),
        Some(Value::String(s)) if s.eq_ignore_ascii_case("false") => Ok(Some(false)),
        Some(v) => Err(bad(
            &format!("{at}.{key}"),
            &format!("expected true or false, got {v}"),
        )),
    }
}

fn bad(key: &str, message: &str) -> Error {
    let what = if key.is_empty() {
        "accelerate config".to_string()
    } else {
        format!("accelerate config {key}")
    };
    Error::setting(SettingKey::Parallel, format!("{what}: {message}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fsdp_config() {
        let c = read(
            "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 8\nfsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: false\n  fsdp_offload_params: false\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_activation_checkpointing: true\n",
        )
        .unwrap();
        assert_eq!(c.plan.gpus, Some(8));
        assert_eq!(
            c.plan.engine,
            Some(ConfigEngine::Fsdp(FsdpStrategy::ShardGradOp, Some(false)))
        );
        assert_eq!(c.plan.recipe, Some(RecipeName::MixedBf16));
        assert_eq!(c.plan.fsdp_reduce_dtype, Some(DType::Bfloat16));
        assert_eq!(c.plan.checkpoint, Some(true));
        assert!(c.plan.notes.is_empty(), "{:?}", c.plan.notes);
    }

    #[test]
    fn deepspeed_inline_and_file() {
        let c = read(
            "distributed_type: DEEPSPEED\nmixed_precision: bf16\nnum_processes: 4\ndeepspeed_config:\n  zero_stage: 3\n  offload_optimizer_device: cpu\n  offload_param_device: none\n  gradient_accumulation_steps: 2\n  zero3_init_flag: true\n",
        )
        .unwrap();
        let Some(ConfigEngine::Zero(z)) = c.plan.engine else {
            panic!("zero")
        };
        assert_eq!(z.stage, 3);
        assert_eq!(c.plan.offload.optimizer, Some(OffloadTarget::Cpu));
        assert_eq!(c.plan.offload.params, None);
        assert_eq!(c.plan.grad_accum, Some(2));
        assert_eq!(c.plan.dtype, Some(DType::Bfloat16));
        let c = read("distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n  fsdp_thing: 1\n").unwrap();
        assert_eq!(c.deepspeed_config_file.as_deref(), Some("ds.json"));
        assert_eq!(c.plan.notes[0].key, "deepspeed_config.fsdp_thing");
    }

    /// accelerate's defaults: `zero_stage` unset is 2 (`DeepSpeedPlugin.__post_init__`);
    /// `fsdp_version` unset is 1, which memest names (it models FSDP2 only).
    #[test]
    fn accelerate_defaults() {
        let c = read("distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  offload_optimizer_device: none\n").unwrap();
        let Some(ConfigEngine::Zero(z)) = c.plan.engine else {
            panic!("zero")
        };
        assert_eq!(z, Zero::stage(2));
        for (yaml, note) in [
            (
                "",
                Some("unset (accelerate's default is 1): FSDP1 is not modelled"),
            ),
            ("  fsdp_version: 1\n", Some("1: FSDP1 is not modelled")),
            ("  fsdp_version: \"2\"\n", None),
            ("  fsdp_version: 2\n", None),
        ] {
            let c = read(&format!(
                "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n{yaml}"
            ))
            .unwrap();
            let got: Vec<String> = c
                .plan
                .notes
                .iter()
                .map(|n| format!("{}: {}", n.key, n.message))
                .collect();
            match note {
                Some(_) => assert_eq!(got.len(), 1, "{got:?}"),
                None => assert!(got.is_empty(), "{got:?}"),
            }
            if let Some(n) = note {
                assert!(
                    got[0].starts_with(&format!("fsdp_config.fsdp_version: {n}")),
                    "{got:?}"
                );
            }
        }
    }

    #[test]
    fn errors_name_the_key() {
        let e = read("distributed_type: TPU\n").unwrap_err();
        assert!(
            e.to_string()
                .contains("distributed_type: TPU is not modelled"),
            "{e}"
        );
        let e = read("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: HALF\n")
            .unwrap_err();
        assert!(
            e.to_string().contains("fsdp_config.fsdp_sharding_strategy"),
            "{e}"
        );
    }
}
