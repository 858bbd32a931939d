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
//! A ring connects each rank to one peer to receive from (and one to send to, whose buffer
//! lives on the receiving GPU); a tree to up to three. memest counts the receive side of a ring
//! and a tree per channel: [`CONNECTIONS_PER_CHANNEL`] connections, each with the three
//! protocols' buffers, over [`DEFAULT_CHANNELS`] channels, plus NCCL's other device
//! allocations (work FIFOs, proxy state, `ncclDevComm`), which are small and not counted.
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
/// Receive connections per channel: one ring peer and, for the tree algorithm, up to two more
/// (parent and children share a channel's tree connections).
pub const CONNECTIONS_PER_CHANNEL: u64 = 2;

/// NCCL's buffers on one GPU of a communicator of `ranks` GPUs (0 for one rank: no
/// communicator is created).
#[must_use]
pub fn bytes(ranks: u64) -> u64 {
    if ranks <= 1 {
        return 0;
    }
    let per_connection = SIMPLE_BUFFSIZE + LL128_BUFFSIZE + LL_BUFFSIZE;
    per_connection * CONNECTIONS_PER_CHANNEL * DEFAULT_CHANNELS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_buffers() {
        assert_eq!(LL128_BUFFSIZE, 4_915_200);
        assert_eq!(LL_BUFFSIZE, 524_288);
        // (4,194,304 + 4,915,200 + 524,288) · 2 · 16 = 308,281,344 B (294 MiB).
        assert_eq!(bytes(8), 308_281_344);
        assert_eq!(bytes(1), 0);
    }
}
