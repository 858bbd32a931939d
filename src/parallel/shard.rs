//! How a tensor or a flat buffer is split across ranks, with each engine's padding, and the
//! ZeRO paper's model-state formulas.

/// Elements one rank holds of a parameter of shape `shape` under FSDP2's `Shard(0)` over
/// `ranks` ranks, padding included: dim 0 is cut with `torch.chunk` into chunks of
/// `ceil(dim0 / ranks)` rows and every shard is padded to that size
/// (`torch/distributed/fsdp/_fully_shard/_fsdp_param.py`, `FSDPParam._init_sharded_param`:
/// `padded_sharded_param_size`). A 0-d tensor counts as one row.
#[must_use]
pub fn fsdp_shard_numel(shape: &[u64], ranks: u64) -> u64 {
    let ranks = ranks.max(1);
    let (rows, rest) = match shape.split_first() {
        Some((&d0, rest)) => (d0, rest.iter().product::<u64>()),
        None => (1, 1),
    };
    rows.div_ceil(ranks).saturating_mul(rest)
}

/// Elements one rank holds of a parameter of `numel` elements under DeepSpeed ZeRO-3: each
/// parameter is flattened and padded to a multiple of the world size, and each rank keeps one
/// equal part, its `ds_tensor` (`deepspeed/runtime/zero/partition_parameters.py`,
/// `_partition_param`: `partition_size = tensor_size // world_size` with
/// `tensor_size = ds_numel + _padding_size`).
#[must_use]
pub fn zero3_partition_numel(numel: u64, ranks: u64) -> u64 {
    numel.div_ceil(ranks.max(1))
}

/// Elements one rank holds of a ZeRO-1/2 parameter group of `numel` elements in all: the group
/// is flattened into one buffer padded to a multiple of `2 · ranks` (`nccl_start_alignment_factor
/// = 2`, "4-byte alignment/sizeof(fp16)", times the data-parallel world size: `DeepSpeedZeroOptimizer`
/// in `deepspeed/runtime/zero/stage_1_and_2.py` calls `flatten_dense_tensors_aligned` with that
/// alignment) and cut into `ranks` equal partitions.
#[must_use]
pub fn zero12_partition_numel(numel: u64, ranks: u64) -> u64 {
    let ranks = ranks.max(1);
    let align = 2u64.saturating_mul(ranks);
    numel.div_ceil(align).saturating_mul(align) / ranks
}

/// Model-state bytes per GPU in the ZeRO paper's accounting (Rajbhandari et al. 2020, §3.1 and
/// Figure 1): mixed-precision training keeps 2Ψ bytes of 16-bit parameters, 2Ψ of 16-bit
/// gradients and KΨ of optimizer state (K = 12 for mixed-precision Adam: float32 master
/// weights, momentum and variance); stage 1 divides the optimizer state by the data-parallel
/// degree `nd`, stage 2 the gradients too, stage 3 the parameters too. Exact (in bytes, before
/// the paper rounds to GB); `None` on overflow.
#[must_use]
pub fn paper_model_states(psi: u64, nd: u64, k: u64, stage: u8) -> Option<u64> {
    let nd = nd.max(1);
    let div = |bytes: u64, split: bool| if split { bytes / nd } else { bytes };
    let params = div(psi.checked_mul(2)?, stage >= 3);
    let grads = div(psi.checked_mul(2)?, stage >= 2);
    let optimizer = div(psi.checked_mul(k)?, stage >= 1);
    params.checked_add(grads)?.checked_add(optimizer)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ZeRO paper, Figure 1 (Ψ = 7.5B, Nd = 64, K = 12): 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.
    /// Its figures are the exact bytes in GB (10⁹ bytes) rounded to one decimal: 120,
    /// 31.40625, 16.640625 and 1.875.
    #[test]
    fn zero_paper_figure_1() {
        let psi = 7_500_000_000;
        let exact: Vec<u64> = (0..=3)
            .map(|s| paper_model_states(psi, 64, 12, s).unwrap())
            .collect();
        assert_eq!(
            exact,
            [
                120_000_000_000,
                31_406_250_000,
                16_640_625_000,
                1_875_000_000
            ]
        );
        // One decimal in GB, half away from zero, as the paper prints them.
        let gb = |b: u64| (b + 50_000_000) / 100_000_000;
        assert_eq!(
            exact.iter().map(|&b| gb(b)).collect::<Vec<_>>(),
            [1200, 314, 166, 19]
        );
    }

    #[test]
    fn fsdp_pads_dim0_chunks() {
        // [32000, 512] over 2: 16000 rows each; [5, 3] over 2: 3 rows (padded) of 3.
        assert_eq!(fsdp_shard_numel(&[32_000, 512], 2), 8_192_000);
        assert_eq!(fsdp_shard_numel(&[5, 3], 2), 9);
        assert_eq!(fsdp_shard_numel(&[], 4), 1);
    }

    #[test]
    fn deepspeed_partitions_pad() {
        assert_eq!(zero3_partition_numel(513, 2), 257);
        // 44,044,800 over 2: already a multiple of 4.
        assert_eq!(zero12_partition_numel(44_044_800, 2), 22_022_400);
        // 10 over 4: padded to 16, 4 each.
        assert_eq!(zero12_partition_numel(10, 4), 4);
    }
}
