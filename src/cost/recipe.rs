//! Precision recipes: which dtype the weights, gradients, master weights and optimizer state
//! take, and whether autocast runs.

use clap::ValueEnum;

use crate::dtype::DType;

/// Autocast precision (`torch.autocast`) with float32 weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, schemars::JsonSchema)]
#[schemars(rename_all = "lowercase")]
pub enum Amp {
    /// `torch.autocast(dtype=torch.bfloat16)`.
    Bf16,
    /// `torch.autocast(dtype=torch.float16)`.
    Fp16,
}
crate::vocab!(Amp, "autocast dtype");

impl Amp {
    /// The lower-precision dtype.
    #[must_use]
    pub const fn dtype(self) -> DType {
        match self {
            Amp::Bf16 => DType::Bfloat16,
            Amp::Fp16 => DType::Float16,
        }
    }
}

/// A named precision recipe (`--recipe`): which dtype the weights, gradients, master weights and
/// optimizer state take, and whether autocast runs. Tools disagree on what "mixed precision"
/// costs, so memest names the recipe and prints its bytes per parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, schemars::JsonSchema)]
#[schemars(rename_all = "kebab-case")]
pub enum RecipeName {
    /// Everything float32: 4 (weights) + 4 (gradients) + optimizer state in float32.
    Fp32,
    /// Pure bfloat16 (`model.to(torch.bfloat16)`): bfloat16 weights, gradients, optimizer state
    /// and activations; no master copy.
    Bf16,
    /// Pure float16 (`model.half()`), as `bf16` with float16.
    Fp16,
    /// `torch.autocast(dtype=torch.bfloat16)`: float32 weights, gradients and state; 16-bit
    /// copies for matmuls and convolutions (the same as `--amp bf16`).
    AmpBf16,
    /// `torch.autocast(dtype=torch.float16)` (the same as `--amp fp16`).
    AmpFp16,
    /// Megatron/DeepSpeed style: bfloat16 weights, gradients and activations, float32 master
    /// weights and float32 optimizer state (2 + 2 + 4 + 8 = 16 bytes per parameter with Adam).
    MixedBf16,
    /// As `mixed-bf16` with float16 (and loss scaling, which costs no memory).
    MixedFp16,
    /// bfloat16 weights and activations, a float32 gradient accumulation buffer (Megatron's
    /// `main_grad`), float32 master weights and state (2 + 4 + 4 + 8 = 18 with Adam).
    MixedBf16Fp32Grads,
}
crate::vocab!(RecipeName, "recipe");

impl RecipeName {
    /// The dtypes this recipe fixes.
    #[must_use]
    pub fn recipe(self) -> Recipe {
        let (weights, gradients, master, amp) = match self {
            RecipeName::Fp32 => (DType::Float32, DType::Float32, None, None),
            RecipeName::Bf16 => (DType::Bfloat16, DType::Bfloat16, None, None),
            RecipeName::Fp16 => (DType::Float16, DType::Float16, None, None),
            RecipeName::AmpBf16 => (DType::Float32, DType::Float32, None, Some(Amp::Bf16)),
            RecipeName::AmpFp16 => (DType::Float32, DType::Float32, None, Some(Amp::Fp16)),
            RecipeName::MixedBf16 => (DType::Bfloat16, DType::Bfloat16, Some(DType::Float32), None),
            RecipeName::MixedFp16 => (DType::Float16, DType::Float16, Some(DType::Float32), None),
            RecipeName::MixedBf16Fp32Grads => {
                (DType::Bfloat16, DType::Float32, Some(DType::Float32), None)
            }
        };
        Recipe {
            name: RecipeId::Named(self),
            weights,
            gradients,
            master_weights: master,
            autocast: amp,
            explicit: true,
        }
    }
}

/// What a recipe is called: one of the named recipes, or `pure-<dtype>` for a model dtype
/// without one (float64, …).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecipeId {
    /// A named recipe.
    Named(RecipeName),
    /// The whole model in this dtype (`pure-float64`).
    Pure(DType),
}

impl std::fmt::Display for RecipeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecipeId::Named(n) => n.fmt(f),
            RecipeId::Pure(d) => f.pad(&format!("pure-{d}")),
        }
    }
}

/// A resolved precision recipe: named by `--recipe`, or derived from `--dtype` and `--amp`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recipe {
    /// `fp32`, `bf16`, `amp-bf16`, `mixed-bf16`, … (`pure-<dtype>` for other model dtypes).
    pub name: RecipeId,
    /// dtype of the model's parameters.
    pub weights: DType,
    /// dtype of the parameters' gradients.
    pub gradients: DType,
    /// dtype of the master copy the optimizer updates, if any (`mixed-*`: float32).
    pub master_weights: Option<DType>,
    /// Autocast, if any.
    pub autocast: Option<Amp>,
    /// Whether `--recipe` named it; `false` when it follows from `--dtype` and `--amp`.
    pub explicit: bool,
}

impl Recipe {
    /// The recipe a model dtype and autocast setting imply: `fp32`, `bf16`, `fp16`,
    /// `amp-bf16`, `amp-fp16`, or `pure-<dtype>`.
    #[must_use]
    pub fn derived(dtype: DType, amp: Option<Amp>) -> Recipe {
        let recipe = match (dtype, amp) {
            (_, Some(Amp::Bf16)) => RecipeName::AmpBf16.recipe(),
            (_, Some(Amp::Fp16)) => RecipeName::AmpFp16.recipe(),
            (DType::Float32, None) => RecipeName::Fp32.recipe(),
            (DType::Bfloat16, None) => RecipeName::Bf16.recipe(),
            (DType::Float16, None) => RecipeName::Fp16.recipe(),
            (other, None) => Recipe {
                name: RecipeId::Pure(other),
                weights: other,
                gradients: other,
                master_weights: None,
                autocast: None,
                explicit: false,
            },
        };
        Recipe {
            explicit: false,
            ..recipe
        }
    }

    /// dtype of the tensors the optimizer updates, and so of its state: the master copy when
    /// there is one, else the weights.
    #[must_use]
    pub fn optimizer_dtype(&self) -> DType {
        self.master_weights.unwrap_or(self.weights)
    }

    /// dtype activations are computed in outside autocast regions (the weights' dtype).
    #[must_use]
    pub fn activations(&self) -> DType {
        self.weights
    }

    /// The dtype parameter gradients take when the recipe says so (`mixed-bf16-fp32-grads`:
    /// float32 for bfloat16 weights); `None` when gradients have their parameter's dtype.
    #[must_use]
    pub fn grad_dtype_override(&self) -> Option<DType> {
        (self.gradients != self.weights).then_some(self.gradients)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recipe_names_round_trip() {
        for &name in RecipeName::value_variants() {
            let r = name.recipe();
            assert_eq!(
                <RecipeName as ValueEnum>::from_str(&r.name.to_string(), false),
                Ok(name)
            );
            assert_eq!(serde_json::to_string(&name).unwrap(), format!("\"{name}\""));
        }
        assert_eq!(
            RecipeName::MixedBf16Fp32Grads.to_string(),
            "mixed-bf16-fp32-grads"
        );
        assert_eq!(RecipeName::AmpBf16.to_string(), "amp-bf16");
        assert_eq!(
            Recipe::derived(DType::Float64, None).name.to_string(),
            "pure-float64"
        );
    }
}
