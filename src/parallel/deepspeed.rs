//! A DeepSpeed JSON config (`--deepspeed ds_config.json`) read into a [`ConfigPlan`].
//!
//! The keys and their defaults follow DeepSpeed's config documentation
//! (<https://www.deepspeed.ai/docs/config-json/>) and its pydantic models:
//! `deepspeed/runtime/zero/config.py` (`DeepSpeedZeroConfig`), `offload_config.py`
//! (`DeepSpeedZeroOffloadParamConfig`, `DeepSpeedZeroOffloadOptimizerConfig`) and
//! `deepspeed/runtime/config.py` (batch sizes, `bf16`, `fp16`). What each ZeRO buffer costs is
//! modelled in `sim/parallel.rs` after `stage_1_and_2.py` and `stage3.py`.
//!
//! `"auto"` is what the Hugging Face Trainer fills in (`HfTrainerDeepSpeedConfig` in
//! `transformers/integrations/deepspeed.py`): the batch sizes, accumulation and `bf16`/`fp16`
//! from its arguments (here: the flags or the model file's defaults), and from the model's
//! `hidden_size` `reduce_bucket_size = hidden²`, `stage3_prefetch_bucket_size = ⌊0.9·hidden²⌋`
//! and `stage3_param_persistence_threshold = 10·hidden` ([`AutoFromHidden`]).
//!
//! Every key is accounted for: the ones that change memory are read; the ones that do not
//! (learning rates, logging, schedulers) are accepted silently; the ones that change memory in a
//! way memest does not model, and unknown keys, are listed in [`ConfigPlan::notes`] with their
//! path.

use serde_json::{Map, Value};

use super::{ConfigEngine, ConfigNote, ConfigPlan, Offload, OffloadTarget, Zero};
use crate::dtype::DType;
use crate::error::{Error, SettingKey};

/// `zero_optimization` sizes left `"auto"`, which the Hugging Face Trainer fills from the
/// model's `hidden_size` (`trainer_config_finalize`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AutoFromHidden {
    /// `reduce_bucket_size = hidden_size²`.
    pub reduce_bucket: bool,
    /// `stage3_prefetch_bucket_size = int(0.9 · hidden_size²)`.
    pub prefetch_bucket: bool,
    /// `stage3_param_persistence_threshold = 10 · hidden_size`.
    pub persistence_threshold: bool,
}

impl AutoFromHidden {
    /// Whether any size waits for the model's hidden size.
    #[must_use]
    pub const fn any(self) -> bool {
        self.reduce_bucket || self.prefetch_bucket || self.persistence_threshold
    }

    /// Fills the sizes left `"auto"` in `z` from `hidden` (the model's `hidden_size`).
    pub fn fill(self, z: &mut Zero, hidden: u64) {
        let sq = hidden.saturating_mul(hidden);
        if self.reduce_bucket {
            z.reduce_bucket_elems = sq;
        }
        if self.prefetch_bucket {
            // `int(0.9 * hidden_size * hidden_size)`: 9/10, rounded down.
            z.prefetch_bucket_elems = sq / 10 * 9 + sq % 10 * 9 / 10;
        }
        if self.persistence_threshold {
            z.param_persistence_threshold = hidden.saturating_mul(10);
        }
    }
}

/// What a key does.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Known {
    /// Read by [`read`].
    Read,
    /// No effect on memory (learning rates, logging, …): accepted silently.
    NoEffect,
    /// Changes memory in a way memest does not model: named in a note.
    NotModelled,
    /// An object whose keys are checked one by one.
    Object,
}

/// DeepSpeed's top-level keys (`deepspeed/runtime/config.py`, the config docs).
const TOP: &[(&str, Known)] = &[
    ("train_batch_size", Known::Read),
    ("train_micro_batch_size_per_gpu", Known::Read),
    ("gradient_accumulation_steps", Known::Read),
    ("optimizer", Known::Object),
    ("bf16", Known::Object),
    ("fp16", Known::Object),
    ("zero_optimization", Known::Object),
    ("activation_checkpointing", Known::Object),
    ("scheduler", Known::NoEffect),
    ("gradient_clipping", Known::NoEffect),
    ("prescale_gradients", Known::NoEffect),
    ("gradient_predivide_factor", Known::NoEffect),
    ("steps_per_print", Known::NoEffect),
    ("wall_clock_breakdown", Known::NoEffect),
    ("dump_state", Known::NoEffect),
    ("memory_breakdown", Known::NoEffect),
    ("zero_allow_untested_optimizer", Known::NoEffect),
    ("zero_force_ds_cpu_optimizer", Known::NoEffect),
    ("flops_profiler", Known::NoEffect),
    ("comms_logger", Known::NoEffect),
    ("tensorboard", Known::NoEffect),
    ("wandb", Known::NoEffect),
    ("csv_monitor", Known::NoEffect),
    ("comet", Known::NoEffect),
    ("timers", Known::NoEffect),
    ("dataloader_drop_last", Known::NoEffect),
    ("checkpoint", Known::NoEffect),
    ("disable_allgather", Known::NoEffect),
    ("communication_data_type", Known::NotModelled),
    ("seq_parallel_communication_data_type", Known::NotModelled),
    ("data_types", Known::Object),
    ("amp", Known::NotModelled),
    ("torch_autocast", Known::NotModelled),
    ("sparse_gradients", Known::NotModelled),
    ("sparse_attention", Known::NotModelled),
    ("pipeline", Known::NotModelled),
    ("elasticity", Known::NotModelled),
    ("autotuning", Known::NotModelled),
    ("compression_training", Known::NotModelled),
    ("data_efficiency", Known::NotModelled),
    ("curriculum_learning", Known::NotModelled),
    ("progressive_layer_drop", Known::NotModelled),
    ("eigenvalue", Known::NotModelled),
    ("quantize_training", Known::NotModelled),
    ("hybrid_engine", Known::NotModelled),
    ("tensor_parallel", Known::NotModelled),
    ("compile", Known::NotModelled),
    ("aio", Known::NotModelled),
    ("nebula", Known::NotModelled),
];

/// `zero_optimization`'s keys (`DeepSpeedZeroConfig`, with its `stage3_*` aliases).
const ZERO: &[(&str, Known)] = &[
    ("stage", Known::Read),
    ("reduce_bucket_size", Known::Read),
    ("allgather_bucket_size", Known::Read),
    ("stage3_prefetch_bucket_size", Known::Read),
    ("stage3_max_live_parameters", Known::Read),
    ("stage3_max_reuse_distance", Known::Read),
    ("stage3_param_persistence_threshold", Known::Read),
    ("contiguous_gradients", Known::Read),
    ("overlap_comm", Known::Read),
    ("offload_optimizer", Known::Object),
    ("offload_param", Known::Object),
    ("cpu_offload", Known::Read),
    ("cpu_offload_param", Known::Read),
    ("cpu_offload_use_pin_memory", Known::Read),
    ("allgather_partitions", Known::NoEffect),
    ("reduce_scatter", Known::NoEffect),
    ("load_from_fp32_weights", Known::NoEffect),
    ("elastic_checkpoint", Known::NoEffect),
    ("ignore_unused_parameters", Known::NoEffect),
    ("round_robin_gradients", Known::NoEffect),
    ("stage3_gather_16bit_weights_on_model_save", Known::NoEffect),
    ("stage3_gather_fp16_weights_on_model_save", Known::NoEffect),
    ("gather_16bit_weights_on_model_save", Known::NoEffect),
    ("use_multi_rank_bucket_allreduce", Known::NoEffect),
    ("log_trace_cache_warnings", Known::NoEffect),
    ("stage3_use_all_reduce_for_fetch_params", Known::NoEffect),
    ("memory_efficient_linear", Known::NoEffect),
    ("override_module_apply", Known::NoEffect),
    ("legacy_stage1", Known::NotModelled),
    ("sub_group_size", Known::NotModelled),
    ("stage3_model_persistence_threshold", Known::NotModelled),
    ("stage3_module_granularity_threshold", Known::NotModelled),
    ("zero_hpz_partition_size", Known::NotModelled),
    ("zero_quantized_weights", Known::NotModelled),
    ("zero_quantized_nontrainable_weights", Known::NotModelled),
    ("zero_quantized_gradients", Known::NotModelled),
    ("zeropp_loco_param", Known::NotModelled),
    ("mics_shard_size", Known::NotModelled),
    ("mics_hierarchical_params_gather", Known::NotModelled),
    ("pipeline_loading_checkpoint", Known::NotModelled),
];

/// `offload_optimizer`'s and `offload_param`'s keys (`offload_config.py`).
const OFFLOAD: &[(&str, Known)] = &[
    ("device", Known::Read),
    ("pin_memory", Known::Read),
    ("nvme_path", Known::NoEffect),
    ("buffer_count", Known::NotModelled),
    ("buffer_size", Known::NotModelled),
    ("max_in_cpu", Known::NotModelled),
    ("pipeline_read", Known::NoEffect),
    ("pipeline_write", Known::NoEffect),
    ("fast_init", Known::NoEffect),
    ("ratio", Known::Read),
];

/// `bf16` and `fp16` (`deepspeed/runtime/config.py`, `precision_config.py`).
const PRECISION: &[(&str, Known)] = &[
    ("enabled", Known::Read),
    ("auto_cast", Known::NotModelled),
    ("loss_scale", Known::NoEffect),
    ("initial_scale_power", Known::NoEffect),
    ("loss_scale_window", Known::NoEffect),
    ("hysteresis", Known::NoEffect),
    ("consecutive_hysteresis", Known::NoEffect),
    ("min_loss_scale", Known::NoEffect),
    ("fp16_master_weights_and_grads", Known::NotModelled),
    ("immediate_grad_update", Known::NoEffect),
    ("check_grad_overflow", Known::NoEffect),
    ("bf16_master_weights_and_grads", Known::NotModelled),
    ("bf16_optimizer_states", Known::NotModelled),
];

/// `data_types` (`deepspeed/runtime/config.py`: `grad_accum_dtype`).
const DATA_TYPES: &[(&str, Known)] = &[("grad_accum_dtype", Known::Read)];

/// `optimizer`.
const OPTIMIZER: &[(&str, Known)] = &[("type", Known::Read), ("params", Known::NoEffect)];

/// `activation_checkpointing` (`deepspeed/runtime/activation_checkpointing/config.py`): it
/// configures `deepspeed.checkpointing`, which a model must call itself (Megatron-style); it
/// does not turn checkpointing on in a Hugging Face model. `--checkpoint` does.
const ACTIVATION_CHECKPOINTING: &[(&str, Known)] = &[
    ("partition_activations", Known::NotModelled),
    ("cpu_checkpointing", Known::NotModelled),
    ("contiguous_memory_optimization", Known::NotModelled),
    ("number_checkpoints", Known::NotModelled),
    ("synchronize_checkpoint_boundary", Known::NoEffect),
    ("profile", Known::NoEffect),
];

/// Reads a DeepSpeed config from its JSON text.
///
/// # Errors
/// [`Error::Setting`] ([`SettingKey::Parallel`]) for text that is not a JSON object, a value of
/// the wrong type (`zero_optimization.stage: expected 0 to 3, got 4`), an offload device other
/// than `none`, `cpu` or `nvme`, or a partial optimizer offload (`ratio` below 1) outside ZeRO-3.
pub fn read(text: &str) -> Result<ConfigPlan, Error> {
    let value: Value = serde_json::from_str(text).map_err(|e| {
        bad(
            "",
            &format!(
                "not JSON at line {} column {}: {}",
                e.line(),
                e.column(),
                e.to_string().split(" at line ").next().unwrap_or_default()
            ),
        )
    })?;
    let Value::Object(top) = value else {
        return Err(bad("", "a DeepSpeed config is a JSON object"));
    };
    let mut plan = ConfigPlan::default();
    let mut auto = AutoFromHidden::default();
    check_keys(&top, "", TOP, &mut plan.notes);
    plan.train_batch = count(&top, "train_batch_size")?;
    plan.micro_batch = count(&top, "train_micro_batch_size_per_gpu")?;
    plan.grad_accum = count(&top, "gradient_accumulation_steps")?;
    for (section, dtype) in [("bf16", DType::Bfloat16), ("fp16", DType::Float16)] {
        if let Some(obj) = object(&top, section)? {
            check_keys(obj, section, PRECISION, &mut plan.notes);
            if flag(obj, section, "enabled")? == Some(true) {
                if let Some(other) = plan.dtype {
                    return Err(bad(
                        section,
                        &format!("bf16 and fp16 are both enabled (already {other})"),
                    ));
                }
                plan.dtype = Some(dtype);
            }
        }
    }
    if let Some(obj) = object(&top, "data_types")? {
        check_keys(obj, "data_types", DATA_TYPES, &mut plan.notes);
        match obj.get("grad_accum_dtype") {
            None | Some(Value::Null) => {}
            Some(Value::String(d)) => match d.to_ascii_lowercase().trim_start_matches("torch.") {
                // `DtypeEnum` (`deepspeed/inference/config.py`): fp32/float32/float,
                // fp16/float16/half, bf16/bfloat16, with or without `torch.`.
                "fp32" | "float32" | "float" => plan.grad_accum_fp32 = true,
                "fp16" | "float16" | "half" | "bf16" | "bfloat16" | "bfloat" => {}
                other => {
                    return Err(bad(
                        "data_types.grad_accum_dtype",
                        &format!("expected fp32, fp16 or bf16, got {other}"),
                    ));
                }
            },
            Some(v) => {
                return Err(bad(
                    "data_types.grad_accum_dtype",
                    &format!("expected fp32, fp16 or bf16, got {v}"),
                ));
            }
        }
    }
    if let Some(obj) = object(&top, "optimizer")? {
        check_keys(obj, "optimizer", OPTIMIZER, &mut plan.notes);
        if let Some(t) = obj.get("type").and_then(Value::as_str) {
            match t.to_ascii_lowercase().as_str() {
                // DeepSpeed's `Adam` is `FusedAdam`/`DeepSpeedCPUAdam` in `adam_w_mode` by
                // default: AdamW; both keep two moments.
                "adam" => plan.optimizer = Some(crate::cost::Optimizer::Adam),
                "adamw" => plan.optimizer = Some(crate::cost::Optimizer::Adamw),
                "sgd" => plan.optimizer = Some(crate::cost::Optimizer::Sgd),
                "adagrad" => plan.optimizer = Some(crate::cost::Optimizer::Adagrad),
                "lamb" => plan.optimizer = Some(crate::cost::Optimizer::Lamb),
                other => plan.notes.push(ConfigNote {
                    key: "optimizer.type".into(),
                    message: format!(
                        "optimizer {other} is not modelled: the optimizer is --optim's (or the model file's)"
                    ),
                }),
            }
        }
    }
    if let Some(obj) = object(&top, "activation_checkpointing")? {
        check_keys(
            obj,
            "activation_checkpointing",
            ACTIVATION_CHECKPOINTING,
            &mut plan.notes,
        );
        plan.notes.push(ConfigNote {
            key: "activation_checkpointing".into(),
            message: "configures deepspeed.checkpointing for models that call it; it does not checkpoint by itself: add --checkpoint for a model that checkpoints its blocks".into(),
        });
    }
    if let Some(z) = object(&top, "zero_optimization")? {
        let mut z = zero(z, &mut plan, &mut auto)?;
        z.auto_from_hidden = auto;
        plan.engine = Some(ConfigEngine::Zero(z));
    } else if top.contains_key("zero_optimization") {
        // `"zero_optimization": true` is the deprecated form of stage 1 (`read_zero_config_deprecated`).
        let on = flag(&top, "", "zero_optimization")?.unwrap_or(false);
        plan.engine = Some(ConfigEngine::Zero(Zero::stage(u8::from(on))));
    } else {
        plan.engine = Some(ConfigEngine::Zero(Zero::stage(0)));
    }
    Ok(plan)
}

/// `zero_optimization`.
fn zero(
    obj: &Map<String, Value>,
    plan: &mut ConfigPlan,
    auto: &mut AutoFromHidden,
) -> Result<Zero, Error> {
    let at = "zero_optimization";
    check_keys(obj, at, ZERO, &mut plan.notes);
    let stage = match count_at(obj, at, "stage", true)? {
        None => 0,
        Some(s) if s <= 3 => u8::try_from(s).unwrap_or(3),
        Some(s) => {
            return Err(bad(
                &format!("{at}.stage"),
                &format!("expected 0 to 3, got {s}"),
            ));
        }
    };
    let mut z = Zero::stage(stage);
    let elems = |key: &str, auto_flag: Option<&mut bool>| -> Result<Option<u64>, Error> {
        if is_auto(obj.get(key))
            && let Some(f) = auto_flag
        {
            *f = true;
            return Ok(None);
        }
        count_at(obj, at, key, true)
    };
    if let Some(n) = elems("reduce_bucket_size", Some(&mut auto.reduce_bucket))? {
        z.reduce_bucket_elems = n;
    }
    if let Some(n) = elems("allgather_bucket_size", None)? {
        z.allgather_bucket_elems = n;
    }
    if let Some(n) = elems(
        "stage3_prefetch_bucket_size",
        Some(&mut auto.prefetch_bucket),
    )? {
        z.prefetch_bucket_elems = n;
    }
    if let Some(n) = elems(
        "stage3_param_persistence_threshold",
        Some(&mut auto.persistence_threshold),
    )? {
        z.param_persistence_threshold = n;
    }
    if let Some(n) = elems("stage3_max_live_parameters", None)? {
        z.max_live_parameters = n;
    }
    if let Some(n) = elems("stage3_max_reuse_distance", None)? {
        z.max_reuse_distance_elems = n;
    }
    if let Some(b) = flag(obj, at, "contiguous_gradients")? {
        z.contiguous_gradients = b;
    }
    if let Some(b) = flag(obj, at, "overlap_comm")? {
        z.overlap_comm = b;
        z.overlap_comm_in_file = Some(b);
    }
    let mut offload = Offload::none();
    for (key, is_param) in [("offload_optimizer", false), ("offload_param", true)] {
        let path = format!("{at}.{key}");
        let Some(o) = object(obj, key)? else { continue };
        check_keys(o, &path, OFFLOAD, &mut plan.notes);
        let device = match o.get("device") {
            None => None,
            Some(Value::String(d)) => match d.to_ascii_lowercase().as_str() {
                "none" => None,
                "cpu" => Some(OffloadTarget::Cpu),
                "nvme" => Some(OffloadTarget::Nvme),
                _ => {
                    return Err(bad(
                        &format!("{path}.device"),
                        &format!("expected none, cpu or nvme, got \"{d}\""),
                    ));
                }
            },
            Some(v) => {
                return Err(bad(
                    &format!("{path}.device"),
                    &format!("expected none, cpu or nvme, got {v}"),
                ));
            }
        };
        // `offload_param.pin_memory` does not change what memest counts: ZeRO-3 pins its
        // parameter partitions whatever it says (`param_groups_fp16_flat_cpu_memory`).
        if !is_param && flag(o, &path, "pin_memory")? == Some(true) {
            offload.pin_memory = true;
        }
        if let Some(r) = o.get("ratio").and_then(Value::as_f64)
            && r < 1.0
        {
            if stage != 3 {
                return Err(bad(
                    &format!("{path}.ratio"),
                    "partial offloading is only supported for ZeRO stage 3",
                ));
            }
            plan.notes.push(ConfigNote {
                key: format!("{path}.ratio"),
                message: format!("{r}: partial optimizer offload is not modelled; the whole optimizer is counted as offloaded"),
            });
        }
        if device == Some(OffloadTarget::Nvme) {
            plan.notes.push(ConfigNote {
                key: format!("{path}.device"),
                message: if stage < 3 {
                    // `stage_1_and_2.py`: `cpu_offload = device != none`.
                    "nvme: ZeRO stages 1 and 2 offload to host memory for any device but none; counted as cpu".into()
                } else {
                    "nvme: the GPU side is as with cpu; the state is on disk and the host's swap buffers are not counted in cpu_bytes".into()
                },
            });
        }
        if is_param {
            offload.params = device;
        } else {
            offload.optimizer = device;
        }
    }
    // The deprecated booleans (`new_param_fn` in `DeepSpeedZeroConfig`).
    if flag(obj, at, "cpu_offload")? == Some(true) {
        offload.optimizer = Some(OffloadTarget::Cpu);
    }
    if flag(obj, at, "cpu_offload_param")? == Some(true) {
        offload.params = Some(OffloadTarget::Cpu);
    }
    if flag(obj, at, "cpu_offload_use_pin_memory")? == Some(true) {
        offload.pin_memory = true;
    }
    plan.offload = offload;
    Ok(z)
}

/// Names every key of `obj` that memest does not read: not-modelled ones and unknown ones (with
/// the nearest known key).
fn check_keys(
    obj: &Map<String, Value>,
    at: &str,
    known: &[(&str, Known)],
    notes: &mut Vec<ConfigNote>,
) {
    for (key, value) in obj {
        let path = ConfigNote::path(at, key);
        match known.iter().find(|k| k.0 == key).map(|k| k.1) {
            Some(Known::Read | Known::NoEffect | Known::Object) => {}
            Some(Known::NotModelled) => {
                // `false`, `null` and empty objects turn the feature off; `sub_group_size` at
                // its default (1e9) or above splits nothing.
                let off = matches!(value, Value::Bool(false) | Value::Null)
                    || (key == "sub_group_size" && value.as_f64().is_some_and(|v| v >= 1e9))
                    || (key == "zero_hpz_partition_size" && value.as_u64() == Some(1))
                    || value.as_object().is_some_and(Map::is_empty)
                    || value
                        .get("enabled")
                        .is_some_and(|e| e == &Value::Bool(false));
                if !off {
                    notes.push(ConfigNote::not_modelled(path));
                }
            }
            None => {
                let names: Vec<&str> = known.iter().map(|k| k.0).collect();
                notes.push(ConfigNote::unknown(path, key, &names, "a DeepSpeed"));
            }
        }
    }
}

fn bad(key: &str, message: &str) -> Error {
    let what = if key.is_empty() {
        "DeepSpeed config".to_string()
    } else {
        format!("DeepSpeed config {key}")
    };
    Error::setting(SettingKey::Parallel, format!("{what}: {message}"))
}

fn is_auto(v: Option<&Value>) -> bool {
    v.and_then(Value::as_str)
        .is_some_and(|s| s.eq_ignore_ascii_case("auto"))
}

/// A whole count at the top level (`"auto"`: left to the flags).
fn count(obj: &Map<String, Value>, key: &str) -> Result<Option<u64>, Error> {
    count_at(obj, "", key, false)
}

/// A whole number (`5e8` allowed, as DeepSpeed's `pp_int` fields take floats); `"auto"`:
/// `None`. `zero_ok`: 0 is a valid value.
fn count_at(
    obj: &Map<String, Value>,
    at: &str,
    key: &str,
    zero_ok: bool,
) -> Result<Option<u64>, Error> {
    let path = if at.is_empty() {
        key.to_string()
    } else {
        format!("{at}.{key}")
    };
    let Some(v) = obj.get(key) else {
        return Ok(None);
    };
    if is_auto(Some(v)) || v.is_null() {
        return Ok(None);
    }
    let n = match v {
        Value::Number(n) => n.as_u64().or_else(|| {
            n.as_f64()
                .filter(|f| f.is_finite() && *f >= 0.0 && f.fract() == 0.0 && *f < 1.8e19)
                .map(|f| {
                    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // checked
                    let u = f as u64;
                    u
                })
        }),
        _ => None,
    };
    match n {
        Some(0) if !zero_ok => Err(bad(&path, "expected a whole number of at least 1, got 0")),
        Some(n) => Ok(Some(n)),
        None => Err(bad(
            &path,
            &format!("expected a whole number or \"auto\", got {v}"),
        )),
    }
}

/// A boolean (`"auto"`: `None`).
fn flag(obj: &Map<String, Value>, at: &str, key: &str) -> Result<Option<bool>, Error> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) if is_auto(Some(v)) => Ok(None),
        Some(v) => Err(bad(
            &if at.is_empty() {
                key.to_string()
            } else {
                format!("{at}.{key}")
            },
            &format!("expected true, false or \"auto\", got {v}"),
        )),
    }
}

/// A nested object, if present.
fn object<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
) -> Result<Option<&'a Map<String, Value>>, Error> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(o)) => Ok(Some(o)),
        // `"zero_optimization": true` is handled by the caller.
        Some(Value::Bool(_)) if key == "zero_optimization" => Ok(None),
        Some(v) => Err(bad(key, &format!("expected an object, got {v}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_auto_sizes_follow_hidden() {
        let plan = read(
            r#"{"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": "auto"},
                "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}}"#,
        )
        .unwrap();
        assert_eq!(plan.micro_batch, None);
        assert_eq!(plan.dtype, None);
        let Some(ConfigEngine::Zero(mut z)) = plan.engine else {
            panic!("zero")
        };
        assert!(z.auto_from_hidden.any());
        // Llama-3-8B: hidden 4096.
        let auto = z.auto_from_hidden;
        auto.fill(&mut z, 4096);
        assert_eq!(z.reduce_bucket_elems, 16_777_216);
        // int(0.9 * 4096 * 4096) = 15099494
        assert_eq!(z.prefetch_bucket_elems, 15_099_494);
        assert_eq!(z.param_persistence_threshold, 40_960);
        assert!(z.overlap_comm, "stage 3 overlaps by default");
    }

    #[test]
    fn offload_and_floats() {
        let plan = read(
            r#"{"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "overlap_comm": true,
                "offload_optimizer": {"device": "cpu", "pin_memory": true}},
                "fp16": {"enabled": true, "loss_scale": 0}, "train_batch_size": 64}"#,
        )
        .unwrap();
        assert_eq!(plan.dtype, Some(DType::Float16));
        assert_eq!(plan.train_batch, Some(64));
        assert_eq!(plan.offload.optimizer, Some(OffloadTarget::Cpu));
        assert!(plan.offload.pin_memory);
        let Some(ConfigEngine::Zero(z)) = plan.engine else {
            panic!("zero")
        };
        assert_eq!(
            (z.stage, z.reduce_bucket_elems, z.overlap_comm),
            (2, 500_000_000, true)
        );
        assert!(plan.notes.is_empty(), "{:?}", plan.notes);
    }

    #[test]
    fn unknown_and_unmodelled_keys_are_named() {
        let plan = read(
            r#"{"zero_optimization": {"stage": 3, "sub_group_size": 1e8, "stage3_max_live_paramters": 1},
                "train_micro_batch_size_per_gpu": 2, "wall_clock_breakdown": false}"#,
        )
        .unwrap();
        let keys: Vec<&str> = plan.notes.iter().map(|n| n.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "zero_optimization.stage3_max_live_paramters",
                "zero_optimization.sub_group_size"
            ]
        );
        assert!(plan.notes[0].message.contains("stage3_max_live_parameters"));
    }

    #[test]
    fn bad_values_are_errors_with_their_path() {
        let e = read(r#"{"zero_optimization": {"stage": 4}}"#).unwrap_err();
        assert!(
            e.to_string()
                .contains("zero_optimization.stage: expected 0 to 3, got 4"),
            "{e}"
        );
        let e = read(r#"{"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}"#)
            .unwrap_err();
        assert!(e.to_string().contains("offload_param.device"), "{e}");
        let e = read("[1]").unwrap_err();
        assert!(e.to_string().contains("JSON object"), "{e}");
    }
}
