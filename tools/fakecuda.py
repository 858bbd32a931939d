"""Pieces for measuring a CUDA training step without a GPU, using FakeTensorMode.

What is here (each piece is needed; see README.md for why):
  * FakeCudaAutocast   - torch.autocast('cuda') disables itself when no GPU is present; this
                         sets the same thread-local autocast state by hand, so the AutocastCUDA
                         dispatch key (CUDA's cast lists) applies to fake cuda tensors.
  * SDPAEmulation      - without a GPU, ATen's CUDA _fused_sdp_choice answers "math"; this
                         TorchFunctionMode (plus a patch of F.scaled_dot_product_attention, for calls
                         made inside other torch functions such as nn.MultiheadAttention) re-implements
                         select_sdp_backend (sdp_utils.cpp) for a chosen GPU (default sm90, the
                         installed cuDNN version) and calls the fused op that the real kernel choice
                         would call, with attention.cpp's pre-processing.
  * run_backward       - the autograd engine refuses fake cuda tensors without a GPU
                         (GraphTask::stash_current_streams -> hasPrimaryContext(0)); this walks the
                         graph in Python in the engine's order (ready nodes by sequence_nr, highest
                         first), calls each Node, sums incoming grads like InputBuffer::accumulate and
                         emulates AccumulateGrad (steal or clone). Tensor/Node hooks are not run.
  * SavedHolder hooks  - saved_tensors_hooks whose holder drops the tensor once the node that
                         unpacked it has run, as Node::release_variables() does after apply().
  * AllocTracker       - TorchDispatchMode that sees every op's outputs, registers each new storage
                         of the tracked device, and drops it when the storage dies (weakref on the
                         preserved storage PyObject). Gives the live-bytes peak (raw and rounded to
                         512 B) with a split by category, and feeds CachingAllocatorSim.
  * CachingAllocatorSim - a model of c10's CUDACachingAllocator (one stream, default config):
                         512 B rounding, small/large pools, 2 MiB / 20 MiB / 2 MiB-rounded segments,
                         best fit, split rules, coalescing; gives max allocated (block sizes) and
                         max reserved.
  * ValueShadow        - (memest's copy) real values for integer tensors whose values are fixed
                         (factories, a balanced MoE routing), so that value-dependent code
                         (`nonzero`, `torch.where(mask)`, `bool(t)`) runs on fake tensors.
  * SDPAEmulation under autocast - (memest's copy) casts q, k, v and a float mask to the
                         autocast dtype before choosing, as the AutocastCUDA kernel does first
                         (the original chose on float32 inputs: math path for a tiny Mixtral).
  * transformers_value_checks, device_capability - (memest's copy) transformers' fake-tensor
                         shortcuts read the shadow values; the emulated GPU's capability.
"""
import bisect
import collections
import contextlib
import heapq
import math
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


# --------------------------------------------------------------------------------------------
# autocast('cuda') without a GPU
# --------------------------------------------------------------------------------------------
class FakeCudaAutocast:
    """Same state changes as torch.autocast('cuda', dtype).__enter__/__exit__, minus the
    'CUDA is not available' check that turns torch.autocast('cuda') off on a CPU-only machine."""

    def __init__(self, dtype=torch.bfloat16, enabled=True, cache_enabled=True):
        self.dtype, self.enabled, self.cache_enabled = dtype, enabled, cache_enabled

    def __enter__(self):
        self.prev = torch.is_autocast_enabled("cuda")
        self.prev_dtype = torch.get_autocast_dtype("cuda")
        self.prev_cache = torch.is_autocast_cache_enabled()
        torch.set_autocast_enabled("cuda", self.enabled)
        torch.set_autocast_dtype("cuda", self.dtype)
        torch.autocast_increment_nesting()
        torch.set_autocast_cache_enabled(self.cache_enabled)
        return self

    def __exit__(self, *exc):
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", self.prev)
        torch.set_autocast_dtype("cuda", self.prev_dtype)
        torch.set_autocast_cache_enabled(self.prev_cache)
        return False


# --------------------------------------------------------------------------------------------
# SDPA backend choice as a real GPU would make it
# --------------------------------------------------------------------------------------------
MATH, FLASH, EFFICIENT, CUDNN = 0, 1, 2, 3
BACKEND_NAMES = {MATH: "math", FLASH: "flash", EFFICIENT: "efficient", CUDNN: "cudnn"}


class SDPAEmulation(TorchFunctionMode):
    """Route F.scaled_dot_product_attention on cuda tensors to the fused op that
    sdp::select_sdp_backend would pick on GPU `sm` (major, minor) with cuDNN `cudnn_version`.

    Mirrors aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (priority_order,
    can_use_cudnn_attention / flash / mem_efficient) and attention.cpp (mask conversion,
    flash head-dim padding, efficient-attention bias padding and expansion)."""

    def __init__(self, sm=(9, 0), cudnn_version=None, cuda_version=None, log=None):
        super().__init__()
        self.sm = sm
        self.cudnn_version = cudnn_version if cudnn_version is not None else (torch.backends.cudnn.version() or 0)
        self.cuda_version = cuda_version or torch.version.cuda or "0"
        self.log = log if log is not None else []

    # ---- priority ------------------------------------------------------------------------
    def prefer_cudnn(self):
        import os
        if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").lower() in ("1", "true", "on", "yes"):
            return False
        major, minor = self.sm
        cuda_major = int(str(self.cuda_version).split(".")[0])
        if cuda_major < 13:
            return self.cudnn_version > 91500 and major in (9, 10) and (not minor or minor == 3)
        return self.cudnn_version > 91500 and major in (9, 10)

    def priority(self):
        order = list(torch._C._get_sdp_priority_order())
        default = [FLASH, EFFICIENT, MATH, CUDNN, 4]
        if order[: len(default)] == default and self.prefer_cudnn():
            return [CUDNN, FLASH, EFFICIENT, MATH]
        return [b for b in order if b in (MATH, FLASH, EFFICIENT, CUDNN)]

    # ---- shared checks ---------------------------------------------------------------------
    @staticmethod
    def _requires_grad(q, k, v):
        return (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled()

    @staticmethod
    def _shapes4(q, k, v):
        return q.dim() == k.dim() == v.dim() == 4

    @staticmethod
    def _batch_heads(q, k, v, enable_gqa, supports_gqa, requires_same_heads):
        if not (q.size(0) == k.size(0) == v.size(0)):
            return False
        if enable_gqa and supports_gqa:
            return k.size(-3) == v.size(-3) and q.size(-3) % k.size(-3) == 0
        same = q.size(-3) == k.size(-3) == v.size(-3)
        if same:
            return True
        if requires_same_heads:
            return False
        return k.size(-3) == v.size(-3) and q.size(-3) % k.size(-3) == 0

    @staticmethod
    def _nonzero_seq(q, k):
        return q.size(-2) != 0 and k.size(-2) != 0

    @staticmethod
    def _last_stride1(q, k, v, mask, ignore_singleton):
        ok = q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
        if ignore_singleton:
            ok = ok or q.size(-1) == 1
        if mask is not None and mask.stride(-1) != 1:
            return False
        return ok

    @staticmethod
    def _mask_shape(q, k, mask):
        if mask is None:
            return True
        if mask.requires_grad:
            return False
        if mask.size(-2) not in (q.size(2), 1) or mask.size(-1) not in (k.size(2), 1):
            return False
        if mask.dim() == 2:
            return True
        if mask.dim() == 4:
            return mask.size(0) in (1, q.size(0)) and mask.size(1) in (1, q.size(1))
        return False

    def _sm_in(self, lo, hi):
        return lo <= self.sm <= hi

    # ---- per-backend gates -----------------------------------------------------------------
    def can_cudnn(self, q, k, v, mask, dropout, is_causal, enable_gqa):
        cv = self.cudnn_version
        if cv < 90000:
            return False, "cudnn < 9"
        if dropout > 0.0 and 91100 < cv < 91400:
            return False, "cudnn 9.11-9.13 dropout"
        if not torch.backends.cuda.cudnn_sdp_enabled():
            return False, "disabled"
        if not self._shapes4(q, k, v):
            return False, "not 4d"
        if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
            return False, "deterministic"
        if not (q.dtype == k.dtype == v.dtype and q.dtype in ((torch.float16, torch.bfloat16) if self.sm[0] >= 8 else (torch.float16,))):
            return False, f"dtype {q.dtype}"
        if not self._mask_shape(q, k, mask):
            return False, "mask shape"
        if not self._sm_in((8, 0), (12, 1)):
            return False, "sm"
        if dropout * 16.0 != math.floor(dropout * 16.0):
            return False, f"dropout {dropout} not a multiple of 1/16"
        if not self._nonzero_seq(q, k):
            return False, "zero seq"
        if not self._last_stride1(q, k, v, mask, True):
            return False, "last stride"
        if not self._batch_heads(q, k, v, enable_gqa, True, False):
            return False, "batch/heads"
        b, h, s_q, d_qk = q.shape
        s_k, d_v = k.size(2), v.size(3)
        if b > 65535 or h > 65535:
            return False, "b/h > 65535"
        limit = 128
        sm90_10x = (self.sm[0] == 9 and self.sm[1] == 0) or self.sm[0] == 10
        sm107_old = self.sm == (10, 7) and cv <= 92500
        if sm90_10x and not sm107_old and cv > 92200:
            limit = 256
        elif sm90_10x and cv >= 91100 and d_qk == 192 and d_v == 128:
            limit = 192
        if d_qk > limit or d_v > limit:
            return False, "head dim limit"
        if d_qk % 8 or d_v % 8:
            return False, "head dim % 8"
        if s_k == 1:
            return False, "s_k == 1"
        if dropout != 0.0 and s_q == 1:
            return False, "s_q == 1 with dropout"
        if self._requires_grad(q, k, v) and sm90_10x and not sm107_old and cv > 92200:
            ok = (d_qk <= 128 and d_v <= 128) or (d_qk == 192 and d_v == 128) or (d_qk == 256 and d_v == 256)
            if not ok:
                return False, "d256 bprop"
        return True, ""

    def can_flash(self, q, k, v, mask, dropout, is_causal, enable_gqa):
        if not torch.backends.cuda.flash_sdp_enabled():
            return False, "disabled"
        if not self._shapes4(q, k, v):
            return False, "not 4d"
        if mask is not None:
            return False, "attn_mask"
        if not (q.size(-1) == k.size(-1) == v.size(-1) and q.size(-1) <= 256):
            return False, "head dim"
        if not self._sm_in((8, 0), (12, 1)):
            return False, "sm"
        if self._requires_grad(q, k, v) and (self._sm_in((8, 6), (8, 9)) or self._sm_in((12, 0), (12, 1))):
            hd = q.size(-1)
            if not (hd <= 192 or (dropout == 0.0 and hd > 224)):
                return False, "sm86-89 head dim"
        if is_causal and q.size(-2) != k.size(-2):
            return False, "causal non-square"
        if not (q.dtype == k.dtype == v.dtype and q.dtype in ((torch.float16, torch.bfloat16) if self.sm[0] >= 8 else (torch.float16,))):
            return False, f"dtype {q.dtype}"
        if not self._batch_heads(q, k, v, enable_gqa, True, True):
            return False, "batch/heads"
        if not self._nonzero_seq(q, k):
            return False, "zero seq"
        if not self._last_stride1(q, k, v, None, True):
            return False, "last stride"
        return True, ""

    def can_efficient(self, q, k, v, mask, dropout, is_causal, enable_gqa):
        if not torch.backends.cuda.mem_efficient_sdp_enabled():
            return False, "disabled"
        if not self._sm_in((5, 0), (12, 1)):
            return False, "sm"
        if not self._shapes4(q, k, v):
            return False, "not 4d"
        half = q.dtype in (torch.float16, torch.bfloat16)
        use_tc = self.sm[0] >= 8 or (self.sm[0] >= 7 and half)
        align = 4 if self.sm[0] >= 8 else 1
        if use_tc:
            align = max(align, 128 // (16 if half else 32))
        if not (q.size(-1) == k.size(-1) and q.size(-1) % align == 0 and q.size(-1) > 0
                and v.size(-1) % align == 0 and v.size(-1) > 0):
            return False, "head dim alignment"
        if self.sm[0] >= 8:
            for t in (q, k, v):
                if t.numel() and (t.storage_offset() % align) != 0:
                    return False, "storage offset alignment"
        if not self._nonzero_seq(q, k):
            return False, "zero seq"
        if not self._last_stride1(q, k, v, mask, False):
            return False, "last stride"
        if not self._batch_heads(q, k, v, enable_gqa, True, True):
            return False, "batch/heads"
        ok_dtypes = (torch.float16, torch.float32, torch.bfloat16) if self.sm[0] >= 8 else (torch.float16, torch.float32)
        if not (q.dtype == k.dtype == v.dtype and q.dtype in ok_dtypes):
            return False, f"dtype {q.dtype}"
        return True, ""

    def choose(self, q, k, v, mask, dropout, is_causal, enable_gqa):
        reasons = {}
        for b in self.priority():
            if b == CUDNN:
                ok, why = self.can_cudnn(q, k, v, mask, dropout, is_causal, enable_gqa)
            elif b == FLASH:
                ok, why = self.can_flash(q, k, v, mask, dropout, is_causal, enable_gqa)
            elif b == EFFICIENT:
                ok, why = self.can_efficient(q, k, v, mask, dropout, is_causal, enable_gqa)
            else:
                ok, why = torch.backends.cuda.math_sdp_enabled(), "disabled"
            if ok:
                return b, reasons
            reasons[BACKEND_NAMES[b]] = why
        raise RuntimeError(f"No available kernel: {reasons}")

    # ---- attention.cpp ---------------------------------------------------------------------
    @staticmethod
    def _convert_bool_mask(mask, dtype, cudnn):
        if mask is None or mask.dtype != torch.bool:
            return mask
        fill = -65504.0 if cudnn else -math.inf
        return torch.where(mask.logical_not(), fill, torch.scalar_tensor(0.0, dtype=dtype, device=mask.device))

    @staticmethod
    def _pad_last_dim(t, align, slice_back):
        last = t.size(-1)
        if last % align == 0:
            return t
        out = F.pad(t, (0, align - last % align))
        return out[..., :last] if slice_back else out

    @staticmethod
    def _preprocess_mask(mask, q, k):
        align = 8
        aligned = all(mask.stride(i) % align == 0 for i in range(mask.dim() - 1)) and mask.stride(-1) == 1
        if not aligned:
            last = mask.size(-1)
            mask = F.pad(mask, (0, align - last % align))[..., :last]
        return mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))

    # Direct calls reach __torch_function__ (the builtin checks for torch-function modes). Calls
    # made inside another torch function (F.multi_head_attention_forward calls the module-level
    # name while the mode is switched off) reach the module attribute, patched on __enter__.
    _ORIG = torch._C._nn.scaled_dot_product_attention

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is self._ORIG:
            q = args[0]
            if isinstance(q, torch.Tensor) and q.device.type == "cuda":
                return self._sdpa(*args, **kwargs)
        return func(*args, **kwargs)

    def __enter__(self):
        self._saved_attr = F.scaled_dot_product_attention
        emu = self

        def scaled_dot_product_attention(query, *args, **kwargs):
            # (memest's copy) diffusers' `dispatch_attention_fn` passes key and value by name
            if "key" in kwargs:
                args = (kwargs.pop("key"), kwargs.pop("value"), *args)
            if isinstance(query, torch.Tensor) and query.device.type == "cuda":
                return emu._sdpa(query, *args, **kwargs)
            return emu._ORIG(query, *args, **kwargs)

        F.scaled_dot_product_attention = scaled_dot_product_attention
        return super().__enter__()

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = self._saved_attr
        return super().__exit__(*exc)

    def _sdpa(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if torch.is_autocast_enabled("cuda"):
            # (memest's copy) SDPA is on CUDA autocast's lower-precision list: the AutocastCUDA
            # kernel casts every eligible input (floating, on cuda, not float64) before the
            # backend is chosen, as this function is reached before that kernel runs
            dt = torch.get_autocast_dtype("cuda")

            def cast(t):
                if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type == "cuda"
                        and t.dtype not in (dt, torch.float64)):
                    return t.to(dt)
                return t
            q, k, v, attn_mask = cast(q), cast(k), cast(v), cast(attn_mask)
        b, _ = self.choose(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)
        self.log.append((BACKEND_NAMES[b], tuple(q.shape), tuple(k.shape), str(q.dtype), dropout_p, is_causal,
                         attn_mask is not None, enable_gqa))
        need_lse = self._requires_grad(q, k, v)
        if b == CUDNN:
            mask = self._convert_bool_mask(attn_mask, q.dtype, True)
            return aten._scaled_dot_product_cudnn_attention(q, k, v, mask, need_lse, dropout_p, is_causal, False,
                                                            scale=scale)[0]
        if b == FLASH:
            og = q.size(-1)
            qp, kp, vp = (self._pad_last_dim(t, 8, False) for t in (q, k, v))
            og_scale = scale if scale is not None else 1.0 / math.sqrt(og)
            out = aten._scaled_dot_product_flash_attention(qp, kp, vp, dropout_p, is_causal, False, scale=og_scale)[0]
            return out[..., :og] if out.size(-1) != og else out
        if b == EFFICIENT:
            mask = self._convert_bool_mask(attn_mask, q.dtype, False)
            if mask is not None:
                mask = self._preprocess_mask(mask, q, k)
            return aten._scaled_dot_product_efficient_attention(q, k, v, mask, need_lse, dropout_p, is_causal,
                                                                scale=scale)[0]
        # math: the composite op already takes the math path for a device-less cuda tensor
        return self._ORIG(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


# --------------------------------------------------------------------------------------------
# CUDA caching allocator model
# --------------------------------------------------------------------------------------------
class _Block:
    __slots__ = ("seg", "addr", "size", "free", "prev", "next", "small")

    def __init__(self, seg, addr, size, small):
        self.seg, self.addr, self.size, self.small = seg, addr, size, small
        self.free, self.prev, self.next = True, None, None


class CachingAllocatorSim:
    K_MIN_BLOCK = 512
    K_SMALL_SIZE = 1 << 20
    K_SMALL_BUFFER = 2 << 20
    K_LARGE_BUFFER = 20 << 20
    K_MIN_LARGE_ALLOC = 10 << 20
    K_ROUND_LARGE = 2 << 20

    def __init__(self):
        self.pools = {True: [], False: []}  # small? -> sorted list of (size, addr, id(block), block)
        self.allocated = 0
        self.reserved = 0
        self.max_allocated = 0
        self.max_reserved = 0
        self.next_addr = 1 << 40
        self.live = {}  # key -> block
        self.segments = 0
        self.events = None  # when a list: ["a"|"f", key, bytes, reserved after, phase, op] per event (--trace)
        self.where = None  # () -> (phase, op) for the events, when set

    @classmethod
    def round_size(cls, n):
        if n < cls.K_MIN_BLOCK:
            return cls.K_MIN_BLOCK
        return cls.K_MIN_BLOCK * ((n + cls.K_MIN_BLOCK - 1) // cls.K_MIN_BLOCK)

    @classmethod
    def allocation_size(cls, size):
        if size <= cls.K_SMALL_SIZE:
            return cls.K_SMALL_BUFFER
        if size < cls.K_MIN_LARGE_ALLOC:
            return cls.K_LARGE_BUFFER
        return cls.K_ROUND_LARGE * ((size + cls.K_ROUND_LARGE - 1) // cls.K_ROUND_LARGE)

    def _pool_add(self, blk):
        bisect.insort(self.pools[blk.small], (blk.size, blk.addr, id(blk), blk))

    def _pool_remove(self, blk):
        pool = self.pools[blk.small]
        i = bisect.bisect_left(pool, (blk.size, blk.addr, id(blk), blk))
        assert pool[i][3] is blk
        pool.pop(i)

    def malloc(self, key, nbytes):
        size = self.round_size(nbytes)
        small = size <= self.K_SMALL_SIZE
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            blk = pool.pop(i)[3]
        else:
            seg_size = self.allocation_size(size)
            blk = _Block(self.segments, self.next_addr, seg_size, small)
            self.segments += 1
            self.next_addr += seg_size + (1 << 30)
            self.reserved += seg_size
            self.max_reserved = max(self.max_reserved, self.reserved)
        remaining = blk.size - size
        split = remaining >= self.K_MIN_BLOCK if small else remaining > self.K_SMALL_SIZE
        if split:
            rest = _Block(blk.seg, blk.addr + size, remaining, small)
            rest.prev, rest.next = blk, blk.next
            if blk.next is not None:
                blk.next.prev = rest
            blk.next = rest
            blk.size = size
            self._pool_add(rest)
        blk.free = False
        self.live[key] = blk
        self.allocated += blk.size
        self.max_allocated = max(self.max_allocated, self.allocated)
        if self.events is not None:
            self.events.append(["a", key, nbytes, self.reserved, *(self.where() if self.where else ())])

    def free(self, key):
        blk = self.live.pop(key, None)
        if blk is None:
            return
        self.allocated -= blk.size
        if self.events is not None:
            self.events.append(["f", key, blk.size, self.reserved, *(self.where() if self.where else ())])
        blk.free = True
        for nb in (blk.prev, blk.next):
            if nb is not None and nb.free:
                self._pool_remove(nb)
                if nb is blk.prev:
                    blk.addr = nb.addr
                    blk.prev = nb.prev
                    if nb.prev is not None:
                        nb.prev.next = blk
                else:
                    blk.next = nb.next
                    if nb.next is not None:
                        nb.next.prev = blk
                blk.size += nb.size
        self._pool_add(blk)

    def reset_peak(self):
        self.max_allocated = self.allocated
        self.max_reserved = self.reserved


# --------------------------------------------------------------------------------------------
# live-storage tracker
# --------------------------------------------------------------------------------------------
CATEGORIES = ("parameter", "optimizer_state", "input", "gradient", "activation", "other")
_PRIORITY = {c: i for i, c in enumerate(CATEGORIES)}


class _Rec:
    __slots__ = ("uid", "nbytes", "rounded", "base_cat", "saved", "is_grad", "cat", "wr")


class AllocTracker(TorchDispatchMode):
    """Counts live storages of one device type, op by op."""

    def __init__(self, device_type="cuda", allocator_sim=True):
        super().__init__()
        self.device_type = device_type
        self.recs = {}  # storage cdata -> _Rec
        self.uid = 0
        self.cur = 0
        self.cur_rounded = 0
        self.cat_bytes = dict.fromkeys(CATEGORIES, 0)
        self.peak = 0
        self.peak_rounded = 0
        self.peak_cats = dict(self.cat_bytes)
        self.peak_where = None
        self.sim = CachingAllocatorSim() if allocator_sim else None
        self.phase = ""
        self.op_count = 0
        self.last_op = None
        self.timeline = []  # (op_count, phase, cur) sampled at each new peak

    # category bookkeeping
    def _cat_of(self, r):
        if r.base_cat in ("parameter", "optimizer_state", "input"):
            return r.base_cat
        if r.is_grad:
            return "gradient"
        if r.saved > 0:
            return "activation"
        return r.base_cat or "other"

    def _recat(self, r):
        new = self._cat_of(r)
        if new != r.cat:
            self.cat_bytes[r.cat] -= r.nbytes
            self.cat_bytes[new] += r.nbytes
            r.cat = new

    def _on_free(self, key, uid):
        r = self.recs.get(key)
        if r is None or r.uid != uid:
            return
        del self.recs[key]
        self.cur -= r.nbytes
        self.cur_rounded -= r.rounded
        self.cat_bytes[r.cat] -= r.nbytes
        if self.sim is not None:
            self.sim.free(uid)

    def track(self, t, base_cat=None):
        """Register t's storage if new; return its record (None if another device)."""
        if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
            return None
        if t.is_sparse or t.is_nested:
            return None
        st = t.untyped_storage()
        key = st._cdata
        r = self.recs.get(key)
        if r is None:
            r = _Rec()
            self.uid += 1
            r.uid = self.uid
            r.nbytes = st.nbytes()
            r.rounded = CachingAllocatorSim.round_size(r.nbytes) if r.nbytes else 0
            r.base_cat = base_cat
            r.saved = 0
            r.is_grad = False
            r.cat = self._cat_of(r)
            uid = r.uid
            r.wr = weakref.ref(st, lambda _w, key=key, uid=uid: self._on_free(key, uid))
            self.recs[key] = r
            self.cur += r.nbytes
            self.cur_rounded += r.rounded
            self.cat_bytes[r.cat] += r.nbytes
            if self.sim is not None and r.nbytes:
                self.sim.malloc(uid, r.nbytes)
            self._check_peak()
        elif base_cat is not None and (r.base_cat is None or _PRIORITY[base_cat] < _PRIORITY.get(r.base_cat, 99)):
            r.base_cat = base_cat
            self._recat(r)
        return r

    def _check_peak(self):
        if self.cur > self.peak:
            self.peak = self.cur
            self.peak_cats = dict(self.cat_bytes)
            self.peak_where = (self.phase, self.op_count, self.last_op)
        if self.cur_rounded > self.peak_rounded:
            self.peak_rounded = self.cur_rounded

    def mark_saved(self, t, delta):
        r = self.track(t)
        if r is not None:
            r.saved += delta
            self._recat(r)

    def mark_grad(self, t, flag=True):
        r = self.track(t)
        if r is not None:
            r.is_grad = flag
            self._recat(r)

    def reset_peak(self):
        self.peak = self.cur
        self.peak_rounded = self.cur_rounded
        self.peak_cats = dict(self.cat_bytes)
        self.peak_where = (self.phase, self.op_count, "start")
        if self.sim is not None:
            self.sim.reset_peak()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # inputs first: storages made outside the mode (rare) become known before the outputs
        for a in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor):
                self.track(a)
        out = func(*args, **kwargs)
        self.op_count += 1
        self.last_op = str(func)
        for o in torch.utils._pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor):
                self.track(o)
        return out


# --------------------------------------------------------------------------------------------
# saved tensors that are released when their node runs
# --------------------------------------------------------------------------------------------
class SavedHolder:
    __slots__ = ("t",)


class SavedRecorder:
    """saved_tensors_hooks factory. record: storage -> bytes for the measured forward."""

    def __init__(self, tracker=None, exclude_keys=()):
        self.tracker = tracker
        self.exclude = set(exclude_keys)
        self.saved = {}
        self.recording = False
        self.inspecting = False
        self.node_holders = None

    def pack(self, t):
        h = SavedHolder()
        h.t = t
        if self.recording:
            st = t.untyped_storage()
            key = st._cdata
            if key not in self.exclude:
                self.saved[key] = (st.nbytes(), t.device.type)
        if self.tracker is not None:
            self.tracker.mark_saved(t, +1)
        return h

    def unpack(self, h):
        t = h.t
        if t is None:
            raise RuntimeError("saved tensor used after its node released it")
        if self.node_holders is not None and not self.inspecting:
            # run_backward is executing a node: free the tensor when that node is done, as
            # Node::release_variables() does after apply() (a node may unpack more than once)
            self.node_holders.append(h)
        return t

    def release(self, holders):
        for h in holders:
            t = h.t
            if t is not None:
                h.t = None
                if self.tracker is not None:
                    self.tracker.mark_saved(t, -1)
            del t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def saved_by_node(loss, recorder):
    """Walk the graph after forward; list (node name, attribute, shape, dtype, storage key, bytes)."""
    out = []
    seen = set()
    stack = [loss.grad_fn]
    recorder.inspecting = True
    try:
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            for name in dir(fn):
                if not name.startswith("_saved_"):
                    continue
                try:
                    val = getattr(fn, name)
                except Exception:
                    continue
                vals = val if isinstance(val, (tuple, list)) else [val]
                for i, t in enumerate(vals):
                    if isinstance(t, torch.Tensor):
                        st = t.untyped_storage()
                        out.append((fn.name(), name[len("_saved_"):] + (f"[{i}]" if len(vals) > 1 else ""),
                                    tuple(t.shape), str(t.dtype).replace("torch.", ""), st._cdata, st.nbytes()))
            for nfn, _ in fn.next_functions:
                if nfn is not None:
                    stack.append(nfn)
    finally:
        recorder.inspecting = False
    return out


# --------------------------------------------------------------------------------------------
# backward without the autograd engine
# --------------------------------------------------------------------------------------------
def _non_overlapping_and_dense(t):
    from torch._prims_common import is_non_overlapping_and_dense_or_false
    return is_non_overlapping_and_dense_or_false(t)


def _storage_use_count(t):
    # the temporary Python storage object holds one reference of its own
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1


def _obeys_layout_contract(grad, var):
    if _non_overlapping_and_dense(var):
        for s, gs, vs in zip(grad.shape, grad.stride(), var.stride()):
            if s != 1:
                if gs != vs:
                    return False
            elif gs == 0:
                return False
        return True
    return grad.is_contiguous()


def _clone_obey_contract(grad, var):
    if _non_overlapping_and_dense(var):
        return grad.new_empty_strided(var.shape, var.stride()).copy_(grad)
    return grad.clone(memory_format=torch.contiguous_format)


class _SlotCount:
    """How many engine containers (input buffers, a node's pending outputs) hold each tensor: the
    part of the engine's use_count() that Python cannot see (one PyObject per TensorImpl)."""

    def __init__(self):
        self.n = {}

    def add(self, t):
        if t is not None:
            self.n[id(t)] = self.n.get(id(t), 0) + 1

    def sub(self, t):
        if t is not None:
            k = id(t)
            self.n[k] -= 1
            if not self.n[k]:
                del self.n[k]

    def count(self, t):
        return self.n.get(id(t), 0)


def _can_accumulate_inplace(t, slots):
    # InputBuffer's can_accumulate_inplace: dense, non-overlapping, use_count()==1 and
    # storage().use_count()==1. `slots.count(t) == 1` is the one container reference being replaced.
    return (not t.is_sparse and _non_overlapping_and_dense(t) and t._use_count() == 1
            and slots.count(t) == 1 and _storage_use_count(t) == 1)


def run_backward(loss, grad=None, tracker=None, on_node=None, recorder=None):
    """loss.backward() for graphs the C++ engine will not run (fake cuda tensors, no GPU).

    Follows torch/csrc/autograd/engine.cpp: dependencies counted over next_functions, ready nodes
    run highest sequence_nr first, incoming grads summed as InputBuffer::accumulate does (in place
    when the buffer holds the only reference), validate_outputs' sum_to / dtype cast, and
    AccumulateGrad's steal-or-clone. Tensor/Node hooks are not run (none are used here)."""
    if grad is None:
        grad = torch.ones_like(loss, memory_format=torch.preserve_format)
    root = loss.grad_fn
    deps = {}
    seen = {root}
    stack = [root]
    while stack:
        fn = stack.pop()
        for nfn, _ in fn.next_functions:
            if nfn is None:
                continue
            deps[nfn] = deps.get(nfn, 0) + 1
            if nfn not in seen:
                seen.add(nfn)
                stack.append(nfn)
    del seen, stack
    slots = _SlotCount()
    buffers = {root: [grad]}
    slots.add(grad)
    root_grad = grad  # torch.autograd.backward keeps grad_tensors alive until it returns
    del grad
    counter = 0
    heap = [(-root._sequence_nr(), counter, root)]
    global _GRAPH_TASK_ID
    _GRAPH_TASK_ID += 1
    orig_gid = torch._C._current_graph_task_id
    # torch.utils.checkpoint (non-reentrant) keys its recomputation on the current graph task id;
    # outside the C++ engine that id is -1 and it would recompute on every unpack
    torch._C._current_graph_task_id = lambda: _GRAPH_TASK_ID
    try:
        with torch.no_grad():
            _run_loop(heap, buffers, deps, slots, counter, tracker, on_node, recorder)
    finally:
        torch._C._current_graph_task_id = orig_gid
    del root_grad
    return None


_GRAPH_TASK_ID = 1 << 40


def _call_python_node(fn, inputs):
    """A custom autograd.Function node: PyNode::apply materializes undefined grads as zeros
    (unless ctx.set_materialize_grads(False)) and drops the outputs of non-tensor forward inputs."""
    if getattr(fn, "materialize_grads", True):
        inputs = [torch.zeros(tuple(m.shape), dtype=m.dtype, device=m.device) if g is None else g
                  for g, m in zip(inputs, fn._input_metadata)]
    outs = fn.apply(*inputs)
    if not isinstance(outs, tuple):
        outs = (outs,)
    n = len(fn.next_functions)
    if len(outs) != n:
        raise NotImplementedError(
            f"{fn.name()}: backward returned {len(outs)} values for {n} tensor inputs; "
            "custom Functions with non-tensor arguments are not supported by run_backward")
    return outs


def _run_loop(heap, buffers, deps, slots, counter, tracker, on_node, recorder):
    if True:
        while heap:
            _, _, fn = heapq.heappop(heap)
            inputs = buffers.pop(fn, None)
            n_in = len(fn._input_metadata)
            if inputs is None:
                inputs = [None] * n_in
            for t in inputs:
                slots.sub(t)
            if on_node is not None:
                on_node(fn)
            if type(fn).__name__ == "AccumulateGrad":
                g = inputs[0]
                del inputs
                if g is not None:
                    var = fn.variable
                    if var.grad is None:
                        if g._use_count() == 1 and slots.count(g) == 0 and _obeys_layout_contract(g, var):
                            var.grad = g.detach()
                        else:
                            var.grad = _clone_obey_contract(g, var)
                        if tracker is not None:
                            tracker.mark_grad(var.grad)
                    else:
                        var.grad += g
                    del g
                continue
            if recorder is not None:
                recorder.node_holders = []
            if isinstance(fn, torch.autograd.function.BackwardCFunction):
                outs = _call_python_node(fn, inputs)
            else:
                outs = fn(*inputs)
            del inputs
            if recorder is not None:
                holders, recorder.node_holders = recorder.node_holders, None
                recorder.release(holders)
                del holders
            if not isinstance(outs, tuple):
                outs = (outs,)
            outs = list(outs)
            for g in outs:
                slots.add(g)
            for i, (nfn, idx) in enumerate(fn.next_functions):
                g = outs[i] if i < len(outs) else None
                if i < len(outs):
                    outs[i] = None
                if nfn is None:
                    slots.sub(g)
                    del g
                    continue
                if g is not None:
                    meta = nfn._input_metadata[idx]
                    g2 = g
                    if tuple(g2.shape) != tuple(meta.shape):
                        g2 = g2.sum_to_size(tuple(meta.shape))
                    if g2.dtype != meta.dtype:
                        g2 = g2.to(meta.dtype)
                    if g2 is not g:
                        slots.sub(g)
                        slots.add(g2)
                        g = g2
                    del g2
                buf = buffers.get(nfn)
                if buf is None:
                    buf = buffers[nfn] = [None] * len(nfn._input_metadata)
                if g is not None:
                    old = buf[idx]
                    if old is None:
                        buf[idx] = g
                    else:
                        # InputBuffer::accumulate: in place into the buffered grad when this buffer
                        # holds the last reference (a real engine run has no dispatch mode active;
                        # with one active, isTensorSubclassLike() is true and it never adds in place)
                        if _can_accumulate_inplace(old, slots):
                            new = old.add_(g)
                        else:
                            new = old + g
                        slots.sub(old)
                        slots.sub(g)
                        buf[idx] = new
                        slots.add(new)
                        del old, new
                del g
                deps[nfn] -= 1
                if deps[nfn] == 0:
                    counter += 1
                    heapq.heappush(heap, (-nfn._sequence_nr(), counter, nfn))
            del outs
    return None


# --------------------------------------------------------------------------------------------
# optimizer step tensors on the CPU under fake mode
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def fake_item_patch():
    """Adam/AdamW (capturable=False) read `step` with .item(); a fake tensor has no value.
    Memory does not depend on the value, so answer 1.0."""
    import torch.optim.adam as adam_mod
    import torch.optim.optimizer as opt_mod
    from torch._subclasses.fake_tensor import FakeTensor

    orig = opt_mod._get_value

    def _get_value(x):
        if isinstance(x, FakeTensor):
            return 1.0
        return orig(x)

    mods = [opt_mod, adam_mod]
    try:
        import torch.optim.adamw as adamw_mod
        mods.append(adamw_mod)
    except ImportError:
        pass
    saved = [(m, getattr(m, "_get_value", None)) for m in mods]
    for m in mods:
        if hasattr(m, "_get_value"):
            m._get_value = _get_value
    try:
        yield
    finally:
        for m, f in saved:
            if f is not None:
                m._get_value = f


# --------------------------------------------------------------------------------------------
# MoE routing with data-dependent shapes (added in memest's copy)
# --------------------------------------------------------------------------------------------
def balanced_routing(rows, k, experts):
    """The fixed routing used for MoE models: routed slot j of token t goes to expert
    (t·k + j) mod E. The k experts of a token are distinct when k <= E, and every expert gets
    T·k/E rows (±1 when E does not divide T·k): the balanced routing memest assumes
    (src/trace/moe.rs)."""
    t = torch.arange(rows, dtype=torch.int64).unsqueeze(1) * k + torch.arange(k, dtype=torch.int64)
    return t % experts


class ValueShadow(TorchDispatchMode):
    """Gives integer tensors whose values are fixed a real "shadow" value, so that code that
    reads values can run on fake tensors: the ops whose output shape depends on values
    (`nonzero`, `torch.where(mask)`), `bool(tensor)` / `.item()`, and transformers' checks that
    skip work on a fake tensor (see `transformers_value_checks`).

    Shadows start at integer factories without tensor inputs (`arange`: position ids, one_hot's
    classes) and, for MoE models (`experts` given), at every `aten.topk`'s indices output, which
    gets `balanced_routing` over its rows (the router's top-k; the only top-k these models run).
    From there, any op whose tensor inputs all have shadows is also computed on the real CPU
    shadows (outside every mode), and its outputs get the results as shadows: the values are
    exactly what PyTorch would compute. An op that fake tensors cannot run (data-dependent output
    shape, `.item()`) is answered from the shadow: `_local_scalar_dense` returns the real scalar,
    a tensor output is allocated with `empty_strided` at the real result's shape on the fake
    device (so the tracker sees the allocation that the CUDA kernel makes). Everything else runs
    on the fake tensors as before, so no memory figure is computed from shadows: only decisions
    are. The router's softmax, top-k values and weights stay fake (and are saved as usual)."""

    def __init__(self, experts=None, top_k=None):
        super().__init__()
        from torch.utils.weak import WeakIdKeyDictionary
        self.experts, self.top_k = experts, top_k
        self.shadow = WeakIdKeyDictionary()
        self.answered = collections.Counter()

    def known(self, t):
        return t in self.shadow

    def _real(self, x):
        if isinstance(x, torch.Tensor):
            # a real constant (`torch.tensor([...])` lifted into the fake mode) is its own value
            return self.shadow[x] if x in self.shadow else x
        if isinstance(x, torch.device) and x.type == "cuda":
            return torch.device("cpu")
        return x

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
        from torch.utils._python_dispatch import _disable_current_modes
        kwargs = kwargs or {}
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        tensors = [a for a in leaves if isinstance(a, torch.Tensor)]
        from torch._subclasses.fake_tensor import FakeTensor
        known = bool(tensors) and all(t in self.shadow or not isinstance(t, FakeTensor) for t in tensors)
        real = None
        if known:
            rargs, rkwargs = torch.utils._pytree.tree_map(self._real, (args, kwargs))
            try:
                with _disable_current_modes():
                    real = func(*rargs, **rkwargs)
            except (RuntimeError, NotImplementedError):
                real = None  # no CPU kernel for it (e.g. histc on int32): no shadow
        try:
            out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            if real is None:
                raise
            self.answered[str(func)] += 1
            if not isinstance(real, (torch.Tensor, tuple, list)):
                return real
            dev = tensors[0].device

            def make(r):
                if not isinstance(r, torch.Tensor):
                    return r
                return torch.empty_strided(tuple(r.shape), tuple(r.stride()), dtype=r.dtype, device=dev)
            out = torch.utils._pytree.tree_map(make, real)
        if not tensors and func not in (aten.empty.memory_format, aten.empty_strided.default):
            # a factory (position ids' and one_hot's arange): shadow small integer results,
            # whose values are fixed
            outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
            if outs and all(not o.is_floating_point() and not o.is_complex() and o.numel() <= 1 << 20
                            for o in outs):
                rargs, rkwargs = torch.utils._pytree.tree_map(self._real, (args, kwargs))
                with _disable_current_modes():
                    real = func(*rargs, **rkwargs)
        if func is aten.topk.default and self.experts and not known:
            idx = out[1]
            rows = idx.numel() // idx.size(-1)
            with _disable_current_modes():
                value = balanced_routing(rows, idx.size(-1), self.experts).reshape(tuple(idx.shape))
            self.shadow[idx] = value
            self.answered["routing top-k"] += 1
        elif real is not None:
            for o, r in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(real)):
                if isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor):
                    self.shadow[o] = r
        else:
            # an in-place op with an input we do not know: its shadow would go stale
            for t in tensors:
                if t in self.shadow and func._schema.is_mutable:
                    del self.shadow[t]
        return out


@contextlib.contextmanager
def transformers_value_checks(shadow):
    """transformers skips value checks on fake tensors (`is_tracing(t)` is true for any FakeTensor)
    and then takes the path that works without values. One such path changes memory:
    `masking_utils.find_packed_sequence_indices` then keeps a packed-sequence mask, so
    `create_causal_mask` builds a 4-D boolean mask instead of SDPA's `is_causal` (seen with
    gradient checkpointing, where no cache is made: +B·S·S bytes kept by every checkpointed
    layer, and a masked SDPA kernel). A real run reads the values; here a fake tensor with a
    shadow (ValueShadow) counts as not tracing, so the same check reads the shadow."""
    try:
        import transformers.masking_utils as mu
    except ImportError:
        yield
        return
    orig = mu.is_tracing

    def is_tracing(tensor=None):
        if tensor is not None and shadow.known(tensor):
            return orig(None)
        return orig(tensor)

    mu.is_tracing = is_tracing
    try:
        yield
    finally:
        mu.is_tracing = orig


@contextlib.contextmanager
def device_capability(sm):
    """torch.cuda.get_device_capability answers the emulated GPU (transformers' grouped_mm
    experts ask it before choosing torch.nn.functional.grouped_mm)."""
    orig = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda device=None: tuple(sm)
    try:
        yield
    finally:
        torch.cuda.get_device_capability = orig
