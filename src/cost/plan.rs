//! One optimizer step under a precision recipe: what it keeps and allocates
//! ([`OptimizerPlan`]), and the recipe as the report shows it ([`RecipeReport`], with the bytes
//! per parameter it implies, [`BytesPerParam`]).

use serde::Serialize;

use super::TensorInfo;
use super::optim::{Optimizer, OptimizerImpl};
use super::recipe::Recipe;
use crate::dtype::DType;

/// The precision recipe: the dtypes it fixes and its bytes per parameter.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct RecipeReport {
    /// `fp32`, `bf16`, `fp16`, `amp-bf16`, `amp-fp16`, `mixed-bf16`, `mixed-fp16`,
    /// `mixed-bf16-fp32-grads`, or `pure-<dtype>`.
    pub name: String,
    /// Whether `--recipe` named it (else it follows from `--dtype` and `--amp`).
    pub explicit: bool,
    /// dtype of the parameters.
    pub weights_dtype: DType,
    /// dtype of the parameters' gradients (null in inference).
    pub gradients_dtype: Option<DType>,
    /// dtype of the master weights, when there are some (null in inference).
    pub master_weights_dtype: Option<DType>,
    /// dtype of the optimizer's per-element state (null without state).
    pub optimizer_state_dtype: Option<DType>,
    /// The autocast dtype, when autocast runs.
    pub autocast_dtype: Option<DType>,
    /// dtype activations are computed in outside autocast regions.
    pub activations_dtype: DType,
    /// Bytes per trainable parameter (frozen ones take `weights` only).
    pub bytes_per_param: BytesPerParam,
}

/// What a step did with its optimizer, as the per-parameter figures need it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepUse {
    /// Whether it is a training step (else gradients, master weights and state count 0).
    pub training: bool,
    /// The optimizer, if any (it counts only in training).
    pub optimizer: Option<Optimizer>,
    /// Its state bytes over the model ([`OptimizerPlan::state_bytes`]).
    pub state_bytes: u64,
    /// Trainable parameters (elements).
    pub trainable_params: u64,
    /// The average stored bytes per parameter over the whole model, when some weights are
    /// quantized (`--dtype nf4|int8|int4|fp8`): packed values and their scales beside the
    /// recipe's dtype elsewhere. `None`: every weight is in the recipe's dtype.
    pub stored_bytes_per_param: Option<f64>,
    /// The dtype of the trainable parameters when it is not the recipe's weights dtype (LoRA
    /// adapters kept in float32 beside a 16-bit base): gradients and optimizer state are
    /// theirs.
    pub trainable_dtype: Option<DType>,
}

impl RecipeReport {
    /// `recipe` as `step` uses it: gradients, master weights and optimizer state only in
    /// training.
    #[must_use]
    pub fn new(recipe: &Recipe, step: StepUse) -> RecipeReport {
        let training = step.training;
        let optimizer = step.optimizer.filter(|_| training);
        RecipeReport {
            name: recipe.name.to_string(),
            explicit: recipe.explicit,
            weights_dtype: recipe.weights,
            gradients_dtype: training.then_some(recipe.gradients),
            master_weights_dtype: recipe.master_weights.filter(|_| training),
            optimizer_state_dtype: optimizer.and_then(|o| o.state_dtype(recipe.optimizer_dtype())),
            autocast_dtype: recipe.autocast.map(super::Amp::dtype),
            activations_dtype: recipe.activations(),
            bytes_per_param: BytesPerParam::new(recipe, step),
        }
    }
}

/// Bytes per parameter a recipe implies. Optimizer state leaves out per-tensor step counters;
/// for Adafactor, whose factored state depends on the shapes, it is this model's average.
#[derive(Clone, Copy, Debug, Serialize, schemars::JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct BytesPerParam {
    /// The parameter itself.
    #[serde(serialize_with = "number")]
    pub weights: f64,
    /// Its gradient.
    #[serde(serialize_with = "number")]
    pub gradients: f64,
    /// Its float32 master copy.
    #[serde(serialize_with = "number")]
    pub master_weights: f64,
    /// Its optimizer state.
    #[serde(serialize_with = "number")]
    pub optimizer_state: f64,
    /// The sum.
    #[serde(serialize_with = "number")]
    pub total: f64,
}

/// Whole numbers as JSON integers (`16`, not `16.0`), others as they are.
#[allow(clippy::trivially_copy_pass_by_ref)] // serde's signature
fn number<S: serde::Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // checked whole and small
    if v.fract() == 0.0 && (0.0..9.0e15).contains(v) {
        s.serialize_u64(*v as u64)
    } else {
        s.serialize_f64(*v)
    }
}

impl BytesPerParam {
    /// The bytes per trainable parameter of `recipe` in `step`. The state's bytes over the
    /// trainable parameters give the average shown for an optimizer without a nominal figure
    /// (Adafactor), rounded to 3 decimals.
    #[must_use]
    pub fn new(recipe: &Recipe, step: StepUse) -> BytesPerParam {
        let StepUse {
            training,
            optimizer,
            state_bytes,
            trainable_params,
            stored_bytes_per_param,
            trainable_dtype,
        } = step;
        #[allow(clippy::cast_precision_loss)] // bit widths are small
        let bytes = |d: DType| d.bits() as f64 / 8.0;
        // Adapters of their own dtype: their gradients and state, without master copies.
        let state_dtype = trainable_dtype.unwrap_or_else(|| recipe.optimizer_dtype());
        let optimizer_state = optimizer.filter(|_| training).map_or(0.0, |o| {
            o.nominal_state_bytes_per_param(bytes(state_dtype))
                .unwrap_or_else(|| {
                    #[allow(clippy::cast_precision_loss)] // an average for display
                    let avg = state_bytes as f64 / trainable_params.max(1) as f64;
                    (avg * 1000.0).round() / 1000.0
                })
        });
        let weights = stored_bytes_per_param.unwrap_or_else(|| bytes(recipe.weights));
        let gradients = match trainable_dtype {
            _ if !training => 0.0,
            Some(d) => bytes(d),
            None => bytes(recipe.gradients),
        };
        let master_weights = match recipe.master_weights {
            Some(m) if training && trainable_dtype.is_none() => bytes(m),
            _ => 0.0,
        };
        BytesPerParam {
            weights,
            gradients,
            master_weights,
            optimizer_state,
            total: if stored_bytes_per_param.is_some() {
                // the average is rounded to 3 decimals: so is the sum
                ((weights + gradients + master_weights + optimizer_state) * 1000.0).round() / 1000.0
            } else {
                weights + gradients + master_weights + optimizer_state
            },
        }
    }
}

/// What the optimizer keeps and allocates in one step under a recipe: state, master weights,
/// temporaries, and the float32 copies of 16-bit gradients. `Id` names a parameter (the
/// caller's value id).
#[derive(Clone, Debug)]
pub struct OptimizerPlan<Id> {
    /// Optimizer state, shared state included.
    pub state_bytes: u64,
    /// Float32 master copies.
    pub master_bytes: u64,
    /// Temporaries of the step ([`OptimizerImpl::step_temporaries`]).
    pub temp_bytes: u64,
    /// Whether the state is bitsandbytes' paged state ([`OptimizerPlan::paged`]): it lives in
    /// CUDA unified memory, outside PyTorch's allocator.
    pub paged: bool,
    /// Per parameter with a master copy and 16-bit gradients: its id, the 16-bit gradient's
    /// bytes and the float32 copy's bytes.
    grad_copies: Vec<(Id, u64, u64)>,
    /// The same step tensor by tensor, as the caching allocator sees it
    /// ([`crate::alloc`]): per updated parameter, in `model.parameters()` order.
    pub tensors: Vec<PlanTensor<Id>>,
    /// State shared by all tensors ([`Optimizer::shared_state_bytes`]), on the device.
    pub shared_state_bytes: u64,
    /// Of `state_bytes`, the host `step` counters: a float32 scalar per parameter that
    /// `torch.optim`'s Adam, AdamW, Adagrad, RMSprop and Adafactor keep on the CPU
    /// (`_init_group`: `torch.tensor(0.0)`) unless fused or capturable. On a GPU the caching
    /// allocator never sees them: `torch.cuda.max_memory_allocated` leaves them out.
    pub host_state_bytes: u64,
    /// Whether the state exists before the first step ([`Optimizer::eager_state`]).
    pub eager_state: bool,
    /// Whether the step's temporaries are the `foreach` lists of [`PlanTensor::temporaries`];
    /// otherwise (for-loop) the step holds at most [`OptimizerPlan::temp_bytes`] at once.
    pub foreach: bool,
}

/// One parameter's part of an [`OptimizerPlan`], tensor by tensor.
#[derive(Clone, Debug)]
pub struct PlanTensor<Id> {
    /// The parameter (the caller's id).
    pub id: Id,
    /// Bytes of its float32 master copy (0 without one).
    pub master_bytes: u64,
    /// Bytes of the float32 copy of its gradient the optimizer gets, when one is made.
    pub grad_copy_bytes: Option<u64>,
    /// Its state's device tensors, in creation order ([`Optimizer::state_tensors`]).
    pub state: Vec<u64>,
    /// Its temporaries, one per `foreach` list ([`Optimizer::foreach_temporaries`]).
    pub temporaries: Vec<u64>,
}

impl<Id> Default for OptimizerPlan<Id> {
    fn default() -> Self {
        OptimizerPlan {
            state_bytes: 0,
            master_bytes: 0,
            temp_bytes: 0,
            paged: false,
            grad_copies: Vec::new(),
            tensors: Vec::new(),
            shared_state_bytes: 0,
            host_state_bytes: 0,
            eager_state: false,
            foreach: true,
        }
    }
}

impl<Id: Copy> OptimizerPlan<Id> {
    /// The plan for `optimizer` run as `implementation` under `recipe`, over the trainable
    /// parameters `params`: each one's id, tensor facts and dtype, in `model.parameters()`
    /// order. The optimizer updates a float32 master copy of each parameter in the recipe's
    /// 16-bit weight dtype under a `mixed-*` recipe, else the parameter itself; gradients not
    /// already in the master dtype (a float32 `main_grad` is) are copied to it, as Megatron's
    /// `_copy_model_grads_to_main_grads` does.
    #[must_use]
    pub fn new<'a>(
        optimizer: Optimizer,
        implementation: OptimizerImpl,
        recipe: &Recipe,
        params: impl IntoIterator<Item = (Id, TensorInfo<'a>, DType)>,
    ) -> OptimizerPlan<Id> {
        let mut plan = OptimizerPlan::default();
        let mut views = Vec::new();
        let device_step = implementation == OptimizerImpl::Fused;
        for (id, param, dtype) in params {
            let mut view = param;
            let mut master_bytes = 0;
            let mut grad_copy_bytes = None;
            if let Some(master) = recipe
                .master_weights
                .filter(|&m| m != dtype && dtype == recipe.weights)
            {
                view.bytes = master.bytes_for(param.numel).unwrap_or(u64::MAX);
                plan.master_bytes = plan.master_bytes.saturating_add(view.bytes);
                master_bytes = view.bytes;
                let grad_dtype = recipe.grad_dtype_override().unwrap_or(dtype);
                if grad_dtype != master {
                    let grad = grad_dtype.bytes_for(param.numel).unwrap_or(0);
                    plan.grad_copies.push((id, grad, view.bytes));
                    grad_copy_bytes = Some(view.bytes);
                }
            }
            let state_bytes = optimizer.state_bytes(view);
            let state = optimizer.state_tensors(view, device_step);
            plan.state_bytes = plan.state_bytes.saturating_add(state_bytes);
            plan.host_state_bytes = plan
                .host_state_bytes
                .saturating_add(state_bytes.saturating_sub(state.iter().sum()));
            plan.tensors.push(PlanTensor {
                id,
                master_bytes,
                grad_copy_bytes,
                state,
                temporaries: match implementation {
                    OptimizerImpl::Foreach => optimizer.foreach_temporaries(view),
                    OptimizerImpl::ForLoop | OptimizerImpl::Fused => Vec::new(),
                },
            });
            views.push(view);
        }
        plan.shared_state_bytes = optimizer.shared_state_bytes(&views);
        plan.state_bytes = plan.state_bytes.saturating_add(plan.shared_state_bytes);
        plan.eager_state = optimizer.eager_state();
        plan.foreach = implementation != OptimizerImpl::ForLoop;
        plan.temp_bytes = implementation.step_temporaries(optimizer, &views);
        plan
    }

    /// The plan of bitsandbytes' paged version of `optimizer` instead (`PagedAdamW`,
    /// `PagedAdamW8bit`, …): its state ([`Optimizer::paged_state_bytes`]) is allocated with
    /// `cudaMallocManaged` in unified memory (`bitsandbytes/functional.py`, `get_paged`, through
    /// `GlobalPageManager`), which PyTorch's caching allocator neither makes nor counts, and which
    /// the driver pages out to host memory when the GPU runs short; one fused kernel per tensor
    /// updates in place, so no temporaries. The optimizer updates `params` themselves (no master
    /// copies). `None` when bitsandbytes has no paged version of `optimizer`.
    #[must_use]
    pub fn paged<'a>(
        optimizer: Optimizer,
        params: impl IntoIterator<Item = (Id, TensorInfo<'a>, DType)>,
    ) -> Option<OptimizerPlan<Id>> {
        let mut plan = OptimizerPlan {
            paged: true,
            ..OptimizerPlan::default()
        };
        let mut views = Vec::new();
        for (_, param, _) in params {
            let bytes = optimizer.paged_state_bytes(param)?;
            plan.state_bytes = plan.state_bytes.saturating_add(bytes);
            views.push(param);
        }
        plan.state_bytes = plan
            .state_bytes
            .saturating_add(optimizer.shared_state_bytes(&views));
        Some(plan)
    }

    /// Bytes of the float32 gradient copies, and of the 16-bit gradients they replace, for
    /// the parameters that received a gradient.
    pub fn master_grad_copies(&self, has_grad: impl Fn(Id) -> bool) -> (u64, u64) {
        self.grad_copies
            .iter()
            .filter(|(id, _, _)| has_grad(*id))
            .fold((0, 0), |(c, f), &(_, grad, copy)| {
                (c.saturating_add(copy), f.saturating_add(grad))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::RecipeName;

    #[test]
    fn bytes_per_param_are_json_numbers() {
        let b = BytesPerParam {
            weights: 2.0,
            gradients: 2.0,
            master_weights: 4.0,
            optimizer_state: 2.03125,
            total: 10.03125,
        };
        assert_eq!(
            serde_json::to_string(&b).unwrap(),
            r#"{"weights":2,"gradients":2,"master_weights":4,"optimizer_state":2.03125,"total":10.03125}"#
        );
    }

    /// Under `mixed-bf16` the optimizer updates float32 master copies: its state and
    /// temporaries are float32, and each bfloat16 gradient is copied to float32.
    #[test]
    fn mixed_plan_updates_float32_master_copies() {
        let shape = [64u64, 1568];
        let t = TensorInfo {
            shape: &shape,
            numel: 100_352,
            bytes: 200_704,
        };
        let recipe = RecipeName::MixedBf16.recipe();
        let plan = OptimizerPlan::new(
            Optimizer::Adam,
            OptimizerImpl::Foreach,
            &recipe,
            [(7usize, t, DType::Bfloat16)],
        );
        assert_eq!(plan.master_bytes, 401_408);
        assert_eq!(plan.state_bytes, 2 * 401_408 + 4);
        assert_eq!(plan.temp_bytes, 401_408);
        assert_eq!(plan.master_grad_copies(|id| id == 7), (401_408, 200_704));
        assert_eq!(plan.master_grad_copies(|_| false), (0, 0));
        let step = StepUse {
            training: true,
            optimizer: Some(Optimizer::Adam),
            state_bytes: plan.state_bytes,
            trainable_params: 100_352,
            stored_bytes_per_param: None,
            trainable_dtype: None,
        };
        let bpp = BytesPerParam::new(&recipe, step);
        assert_eq!(bpp.total, 16.0);
    }
}
