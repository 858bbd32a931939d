//! NCCL's own device memory per GPU: an approximation, stated as one.
//!
//! NCCL allocates, per communicator, a buffer per channel and per connected peer for each
//! protocol it may use (`src/transport/p2p.cc`, `net.cc` `*Setup`: one buffer of
//! `comm->buffSizes[p]` per protocol and connection), with the sizes of `src/init.cc`
//! (`computeBuffSizes`) and `src/include/device.h`:
//!
//! - Simple: `NCCL_BUFFSIZE`, default `1 << 22` = 4 MiB (`DEFAULT_BUFFSIZE`);
//! - LL128: `DEFAULT_LL128_BUFFSIZE = NCCL_LL128_ELEMS_PER_THREAD (120) ·
//!   NCCL_LL128_MAX_NTHREADS (640) · NCCL_STEPS (8) · sizeof(uint64_t)` = 4,915,200 B;
//! - LL: `DEFAULT_LL_BUFFSIZE = NCCL_LL_LINES_PER_THREAD (8) · NCCL_LL_MAX_NTHREADS (512) ·
//!   NCCL_STEPS (8) · sizeof(ncclLLFifoLine) (16)` = 524,288 B.
//!
//! Which peers a rank receives from, per channel (`src/init.cc`, `initTransportsRank`/
//! `ncclTreeConnect`): the ring connects each rank to receive from its previous rank and send to
//! its next (`channel->ring.prev`/`next`); the tree connects it both ways with its parent
//! (`tree.up`) and up to `NCCL_MAX_TREE_ARITY` (3) children (`tree.down`): two
//! `ncclTransportP2pConnect` calls, down→up and up→down. The buffers of a connection live on one
//! of its two ends (the receiver's; P2P read moves Simple's to the sender, which by symmetry
//! leaves each rank one set per connection), so a rank holds one set of the three protocols'
//! buffers per peer it receives from. Within a node NCCL's tree is a chain (one child, one
//! parent), so a middle rank receives from three peers per channel: its ring predecessor, its
//! tree child and its tree parent ([`CONNECTIONS_PER_CHANNEL`]); in a communicator of two ranks
//! the chain has one tree peer, two connections. Over [`DEFAULT_CHANNELS`] channels, per
//! communicator; each parallel dimension with more than one rank (data, tensor, context) has
//! its own communicator ([`plan_bytes`]). NCCL's other device allocations (work FIFOs, proxy
//! state, `ncclDevComm`) are small and not counted.
//!
//! What this leaves out, honestly: the channel count NCCL picks depends on the topology
//! (NVLink, PCIe, InfiniBand: 2 to 32 channels; `NCCL_MIN_NCHANNELS`/`NCCL_MAX_NCHANNELS`),
//! peer-to-peer operations (pipeline send/receive, all-to-all) connect more peers lazily, each
//! extra communicator (a process group per parallel dimension) pays again, and CUDA graphs or
//! `NCCL_NVLS_ENABLE` (NVLink SHARP buffers) add more. Measured figures on real clusters range
//! from a few hundred MiB to over 1 GiB per GPU; this is a floor-like estimate of the default
//! case, not a measurement.

/// `NCCL_BUFFSIZE`'s default (Simple protocol), bytes.
pub const SIMPLE_BUFFSIZE: u64 = 1 << 22;
/// `DEFAULT_LL128_BUFFSIZE`, bytes.
pub const LL128_BUFFSIZE: u64 = 120 * 640 * 8 * 8;
/// `DEFAULT_LL_BUFFSIZE`, bytes.
pub const LL_BUFFSIZE: u64 = 8 * 512 * 8 * 16;
/// Channels assumed: NCCL's typical count on an 8-GPU NVLink node (it reports 16 to 32 there,
/// 2 to 4 over PCIe); see the module's caveats.
pub const DEFAULT_CHANNELS: u64 = 16;
/// Receive connections per channel of a rank in a communicator of three or more: its ring
/// predecessor, and its tree child and parent (a chain within a node; a rank with three
/// children across nodes would have five).
pub const CONNECTIONS_PER_CHANNEL: u64 = 3;

/// NCCL's buffers on one GPU of a communicator of `ranks` GPUs (0 for one rank: no
/// communicator is created; two ranks: the ring peer and one tree peer).
#[must_use]
pub fn bytes(ranks: u64) -> u64 {
    let connections = match ranks {
        0 | 1 => return 0,
        2 => 2,
        _ => CONNECTIONS_PER_CHANNEL,
    };
    let per_connection = SIMPLE_BUFFSIZE + LL128_BUFFSIZE + LL_BUFFSIZE;
    per_connection * connections * DEFAULT_CHANNELS
}

/// NCCL's buffers on one GPU under `plan`: one communicator per parallel dimension of more than
/// one rank (the data-parallel group, the tensor-parallel group, the context-parallel group),
/// each sized by [`bytes`] of its own ranks.
#[must_use]
pub fn plan_bytes(plan: &super::Plan) -> u64 {
    let dp = plan.data_parallel().unwrap_or(1);
    [dp, plan.tp, plan.cp]
        .iter()
        .fold(0u64, |a, &r| a.saturating_add(bytes(r)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_buffers() {
        assert_eq!(LL128_BUFFSIZE, 4_915_200);
        assert_eq!(LL_BUFFSIZE, 524_288);
        // (4,194,304 + 4,915,200 + 524,288) · 3 · 16 = 462,422,016 B (441 MiB).
        assert_eq!(bytes(8), 462_422_016);
        // Two ranks: ring + one tree peer, · 2 · 16 = 308,281,344 B.
        assert_eq!(bytes(2), 308_281_344);
        assert_eq!(bytes(1), 0);
        let mut p = crate::parallel::Plan::data_parallel_only(
            8,
            crate::parallel::Sharding::Ddp(crate::parallel::Ddp::default()),
        );
        assert_eq!(plan_bytes(&p), 462_422_016);
        // --tp 2 over 8: a data-parallel group of 4 and a tensor-parallel group of 2.
        p.tp = 2;
        assert_eq!(plan_bytes(&p), 462_422_016 + 308_281_344);
        // --tp 8 over 8: the tensor-parallel group alone.
        p.tp = 8;
        assert_eq!(plan_bytes(&p), 462_422_016);
    }
}
