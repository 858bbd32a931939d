//! Which kernel `F.scaled_dot_product_attention` runs on a CUDA (or ROCm) GPU, following
//! `select_sdp_backend` in PyTorch's `aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`: the
//! backends in priority order (`priority_order`: cuDNN first on sm 9.0 / 10.x when
//! `check_prefer_cudnn_attention` holds, else flash, memory-efficient, math), each taken when
//! its `can_use_*` constraints pass. `../shared/groundtruth/fakecuda.py`'s `SDPAEmulation`
//! mirrors the same checks for the measured CUDA references.
//!
//! Only the constraints that a dense, contiguous-last-dimension call from a model can fail are
//! checked: dtype, compute capability, head dimensions, an attention mask, dropout, causal
//! masking with unequal lengths. The cuDNN version is taken as PyTorch 2.15's wheels ship it
//! (9.26: cuDNN preferred on sm 9.0 / 10.0 / 10.3, head dimensions up to 256 there).

use crate::dtype::DType;
use crate::gpu::Arch;

/// A fused SDPA backend (`at::SDPBackend`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SdpaKernel {
    /// `_scaled_dot_product_cudnn_attention`: keeps Q, K, V, the output and a float32
    /// log-sum-exp `[B, heads, S, 1]`.
    Cudnn,
    /// `_scaled_dot_product_flash_attention`: keeps Q, K, V, the output and a float32
    /// log-sum-exp `[B, heads, S]`.
    Flash,
    /// `_scaled_dot_product_efficient_attention`: keeps Q, K, V, the mask, the output and a
    /// float32 log-sum-exp `[B, heads, S]` padded to a multiple of 32 (`kAlignLSE`) when it
    /// computes one for backward.
    Efficient,
    /// `_scaled_dot_product_attention_math`: matmul, softmax, dropout, matmul, keeping what they
    /// keep (the tracer's `sdpa_math`).
    Math,
}

/// The facts of one SDPA call that the choice depends on.
#[derive(Clone, Copy, Debug)]
pub struct SdpaCall {
    /// dtype of Q, K and V (after autocast).
    pub dtype: DType,
    /// Head dimension of Q and K.
    pub head_dim_qk: u64,
    /// Head dimension of V.
    pub head_dim_v: u64,
    /// Query length.
    pub s_q: u64,
    /// Key length.
    pub s_k: u64,
    /// Whether a float attention mask (bias) is passed.
    pub mask: bool,
    /// Whether that mask requires grad (a learned bias such as T5's relative positions):
    /// cuDNN refuses it (`check_attn_mask_shape`).
    pub mask_requires_grad: bool,
    /// Query heads.
    pub heads_q: u64,
    /// Key/value heads (fewer under grouped-query or multi-query attention).
    pub heads_kv: u64,
    /// `enable_gqa=True` is passed.
    pub enable_gqa: bool,
    /// Attention dropout probability.
    pub dropout: f64,
    /// `is_causal=True`.
    pub causal: bool,
    /// Whether autograd records the call (Q, K or V requires grad).
    pub requires_grad: bool,
}

impl SdpaCall {
    fn half(&self) -> bool {
        matches!(self.dtype, DType::Float16 | DType::Bfloat16)
    }

    /// `check_batch_size_and_num_heads_dense`: equal heads, or fewer K/V heads dividing the
    /// query heads when `enable_gqa` is passed or the kernel does not require equal heads
    /// (cuDNN).
    fn heads_ok(&self, requires_same_heads: bool) -> bool {
        let divides = self.heads_kv > 0 && self.heads_q.is_multiple_of(self.heads_kv);
        self.heads_q == self.heads_kv || (divides && (self.enable_gqa || !requires_same_heads))
    }

    /// `check_dtypes_low_precision`: float16, and bfloat16 from sm 8.0.
    fn low_precision(&self, major: u32) -> bool {
        self.dtype == DType::Float16 || (self.dtype == DType::Bfloat16 && major >= 8)
    }
}

/// The kernel PyTorch picks for `call` on `arch`.
#[must_use]
pub fn select(arch: &Arch, call: &SdpaCall) -> SdpaKernel {
    match arch.sm() {
        Some(sm) => select_cuda(sm, call),
        None => select_rocm(call),
    }
}

fn in_sm(sm: (u32, u32), lo: (u32, u32), hi: (u32, u32)) -> bool {
    lo <= sm && sm <= hi
}

fn select_cuda(sm: (u32, u32), c: &SdpaCall) -> SdpaKernel {
    // check_prefer_cudnn_attention (CUDA 12 wheels: minor 0 or 3).
    let prefer_cudnn = matches!(sm.0, 9 | 10) && (sm.1 == 0 || sm.1 == 3);
    if prefer_cudnn && can_cudnn(sm, c) {
        return SdpaKernel::Cudnn;
    }
    if can_flash(sm, c) {
        return SdpaKernel::Flash;
    }
    if can_efficient(sm, c) {
        return SdpaKernel::Efficient;
    }
    SdpaKernel::Math
}

/// `can_use_cudnn_attention`: 16-bit, sm 8.0–12.1, no mask that requires grad, dropout a
/// multiple of 1/16
/// (`check_cudnn_dropout`), head dimensions multiples of 8 up to 128 (256 on sm 9.0 / 10.x,
/// and then for backward only 128/128, 192/128 or 256/256: `check_cudnn_d256_bprop_head_dim`),
/// more than one key, no dropout with a single query.
fn can_cudnn(sm: (u32, u32), c: &SdpaCall) -> bool {
    #[allow(clippy::float_cmp)] // the check PyTorch makes
    let dropout_ok = (c.dropout * 16.0).floor() == c.dropout * 16.0;
    let sm90_10x = sm == (9, 0) || sm.0 == 10;
    let limit = if sm90_10x { 256 } else { 128 };
    let (d, dv) = (c.head_dim_qk, c.head_dim_v);
    let bprop_ok = !(c.requires_grad && sm90_10x)
        || (d <= 128 && dv <= 128)
        || (d, dv) == (192, 128)
        || (d, dv) == (256, 256);
    c.low_precision(sm.0)
        && in_sm(sm, (8, 0), (12, 1))
        && !c.mask_requires_grad
        && c.heads_ok(false)
        && dropout_ok
        && d <= limit
        && dv <= limit
        && d.is_multiple_of(8)
        && dv.is_multiple_of(8)
        && c.s_k != 1
        && !(c.dropout > 0.0 && c.s_q == 1)
        && bprop_ok
}

/// `can_use_flash_attention`: no attention mask, equal heads unless `enable_gqa`, equal head dimensions up to 256, sm 8.0–12.1,
/// on sm 8.6–8.9 and 12.x a backward only with head dimension ≤ 192 (or > 224 without dropout),
/// causal only with equal lengths, 16-bit.
fn can_flash(sm: (u32, u32), c: &SdpaCall) -> bool {
    let d = c.head_dim_qk;
    let consumer = in_sm(sm, (8, 6), (8, 9)) || in_sm(sm, (12, 0), (12, 1));
    let grad_ok = !(c.requires_grad && consumer) || d <= 192 || (c.dropout == 0.0 && d > 224);
    !c.mask
        && c.heads_ok(true)
        && d == c.head_dim_v
        && d <= 256
        && in_sm(sm, (8, 0), (12, 1))
        && grad_ok
        && !(c.causal && c.s_q != c.s_k)
        && c.low_precision(sm.0)
}

/// `can_use_mem_efficient_attention`: sm 5.0–12.1, equal heads unless `enable_gqa`, head dimensions multiples of the GEMM
/// alignment (`minimum_gemm_alignment`: 8 for 16-bit and 4 for float32 on tensor cores, sm 8.0
/// up, or 16-bit on sm 7.x; 1 otherwise), float16 or float32, bfloat16 from sm 8.0.
fn can_efficient(sm: (u32, u32), c: &SdpaCall) -> bool {
    let use_tc = sm.0 >= 8 || (sm.0 >= 7 && c.half());
    let mut align = if sm.0 >= 8 { 4 } else { 1 };
    if use_tc {
        align = align.max(if c.half() { 8 } else { 4 });
    }
    let dtype_ok = match c.dtype {
        DType::Float16 | DType::Float32 => true,
        DType::Bfloat16 => sm.0 >= 8,
        _ => false,
    };
    in_sm(sm, (5, 0), (12, 1))
        && c.heads_ok(true)
        && c.head_dim_qk > 0
        && c.head_dim_qk.is_multiple_of(align)
        && c.head_dim_v > 0
        && c.head_dim_v.is_multiple_of(align)
        && dtype_ok
}

/// ROCm (AOTriton): no cuDNN; flash for 16-bit without a mask and equal head dimensions up to
/// 256; memory-efficient for float16, bfloat16 and float32 with head dimensions a multiple of
/// 8 up to 256 (`check_head_dim_size_flash_nested<true>` for AOTriton before 0.12); else math.
fn select_rocm(c: &SdpaCall) -> SdpaKernel {
    let d = c.head_dim_qk;
    let dims = d == c.head_dim_v && d <= 256;
    if c.half() && !c.mask && dims && !(c.causal && c.s_q != c.s_k) {
        return SdpaKernel::Flash;
    }
    let dtype_ok = matches!(c.dtype, DType::Float16 | DType::Bfloat16 | DType::Float32);
    // AOTriton's memory-efficient kernel supports neither GQA nor MQA.
    if dtype_ok && dims && d.is_multiple_of(8) && c.heads_q == c.heads_kv {
        return SdpaKernel::Efficient;
    }
    SdpaKernel::Math
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(dtype: DType) -> SdpaCall {
        SdpaCall {
            dtype,
            head_dim_qk: 64,
            head_dim_v: 64,
            s_q: 256,
            s_k: 256,
            mask: false,
            mask_requires_grad: false,
            heads_q: 8,
            heads_kv: 8,
            enable_gqa: true,
            dropout: 0.0,
            causal: true,
            requires_grad: true,
        }
    }

    fn sm(major: u32, minor: u32) -> Arch {
        Arch::Cuda { major, minor }
    }

    #[test]
    fn hopper_picks_cudnn_for_16_bit_without_dropout() {
        assert_eq!(select(&sm(9, 0), &call(DType::Bfloat16)), SdpaKernel::Cudnn);
        // Dropout 0.1 is not a multiple of 1/16: flash.
        let c = SdpaCall {
            dropout: 0.1,
            ..call(DType::Bfloat16)
        };
        assert_eq!(select(&sm(9, 0), &c), SdpaKernel::Flash);
        // Blackwell too.
        assert_eq!(select(&sm(10, 0), &call(DType::Float16)), SdpaKernel::Cudnn);
    }

    #[test]
    fn ampere_and_ada_pick_flash_for_16_bit() {
        assert_eq!(select(&sm(8, 0), &call(DType::Bfloat16)), SdpaKernel::Flash);
        assert_eq!(select(&sm(8, 9), &call(DType::Float16)), SdpaKernel::Flash);
    }

    #[test]
    fn float32_runs_memory_efficient_everywhere() {
        for a in [sm(7, 0), sm(7, 5), sm(8, 0), sm(8, 9), sm(9, 0)] {
            assert_eq!(select(&a, &call(DType::Float32)), SdpaKernel::Efficient);
        }
    }

    #[test]
    fn before_ampere_no_flash_and_no_bfloat16_kernel() {
        // V100 / T4: float16 goes memory-efficient, bfloat16 to math.
        assert_eq!(
            select(&sm(7, 0), &call(DType::Float16)),
            SdpaKernel::Efficient
        );
        assert_eq!(select(&sm(7, 5), &call(DType::Bfloat16)), SdpaKernel::Math);
    }

    #[test]
    fn a_learned_mask_rules_out_cudnn() {
        // T5's relative position bias requires grad: memory-efficient, which returns its grad.
        let c = SdpaCall {
            mask: true,
            mask_requires_grad: true,
            ..call(DType::Bfloat16)
        };
        assert_eq!(select(&sm(9, 0), &c), SdpaKernel::Efficient);
        let c = SdpaCall {
            mask_requires_grad: false,
            ..c
        };
        assert_eq!(select(&sm(9, 0), &c), SdpaKernel::Cudnn);
    }

    #[test]
    fn multi_query_without_enable_gqa_falls_back_to_math() {
        // Falcon calls SDPA with one K/V head and no enable_gqa: float32 has no fused kernel
        // left; bfloat16 on sm 9.0 runs cuDNN, which does not require equal heads.
        let c = SdpaCall {
            heads_kv: 1,
            enable_gqa: false,
            ..call(DType::Float32)
        };
        assert_eq!(select(&sm(9, 0), &c), SdpaKernel::Math);
        let c = SdpaCall {
            dtype: DType::Bfloat16,
            ..c
        };
        assert_eq!(select(&sm(9, 0), &c), SdpaKernel::Cudnn);
        assert_eq!(select(&sm(8, 0), &c), SdpaKernel::Math);
        let c = SdpaCall {
            enable_gqa: true,
            ..c
        };
        assert_eq!(select(&sm(8, 0), &c), SdpaKernel::Flash);
    }

    #[test]
    fn a_mask_rules_out_flash() {
        let c = SdpaCall {
            mask: true,
            ..call(DType::Bfloat16)
        };
        assert_eq!(select(&sm(8, 0), &c), SdpaKernel::Efficient);
    }

    #[test]
    fn consumer_cards_limit_backward_head_dims() {
        // sm 8.9, head dim 256 with dropout in training: not flash, memory-efficient instead.
        let c = SdpaCall {
            head_dim_qk: 256,
            head_dim_v: 256,
            dropout: 0.1,
            ..call(DType::Bfloat16)
        };
        assert_eq!(select(&sm(8, 9), &c), SdpaKernel::Efficient);
        assert_eq!(select(&sm(8, 0), &c), SdpaKernel::Flash);
    }

    #[test]
    fn rocm_has_no_cudnn() {
        let mi300 = Arch::Rocm("gfx942".into());
        assert_eq!(select(&mi300, &call(DType::Bfloat16)), SdpaKernel::Flash);
        assert_eq!(select(&mi300, &call(DType::Float32)), SdpaKernel::Efficient);
    }
}
