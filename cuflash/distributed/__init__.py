"""Context parallelism: ring attention over NCCL for sequences longer than one GPU holds.

One process per GPU, each holding its zig-zag shard of the sequence::

    from cupy.cuda import nccl
    import cuflash.distributed as cfd

    group = cfd.NcclRing.from_unique_id(uid, rank, world)   # uid = nccl.get_unique_id() from the launcher
    q_r, k_r, v_r = (cfd.zigzag_shard(x, world, rank) for x in (q, k, v))
    out_r, lse_r = cfd.ring_forward(q_r, k_r, v_r, group, causal=True, return_lse=True)
    dq_r, dk_r, dv_r = cfd.ring_backward(dout_r, q_r, k_r, v_r, out_r, lse_r, group, causal=True)

``python -m cuflash.distributed.bench`` starts one process per GPU and times it against one GPU.
"""
from .api import local_ring_backward, local_ring_forward, ring_backward, ring_forward
from .plan import zigzag_shard, zigzag_unshard
from .transport import NcclRing

__all__ = ["NcclRing", "ring_forward", "ring_backward", "local_ring_forward", "local_ring_backward",
           "zigzag_shard", "zigzag_unshard"]
