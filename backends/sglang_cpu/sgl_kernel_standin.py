"""A pure-torch stand-in for SGLang's ``sgl_kernel`` package on a CPU without its build.

Installed into the SGLang venv as ``sgl_kernel/__init__.py`` (never imported by kvgate).
SGLang 0.5.23's CPU engine imports two ops from ``sgl_kernel`` whatever the CPU; their
signatures are those of SGLang's call sites:

* ``assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
  out_cache_loc, pool_len)`` (``sglang/srt/mem_cache/allocation.py``): request ``i``'s slots
  ``out_cache_loc[sum(len_<i) : sum(len_<=i)]`` go to ``req_to_token[req_pool_indices[i],
  start_offset[i]:end_offset[i]]``;
* ``copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc)``
  (``sglang/kernels/ops/kvcache/cache_move.py``): in every KV buffer (a base address and a row
  stride in bytes), rows ``src_loc`` copied to rows ``tgt_loc`` (all read before any write).

The speculative-decoding ops SGLang imports at module level refuse when called.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch  # type: ignore[import-not-found]

__version__ = "0.0.0+kvgate.standin"


def assign_req_to_token_pool_cpu(  # noqa: PLR0917 (SGLang's call site passes six)
    req_pool_indices: Any,
    req_to_token: Any,
    start_offset: Any,
    end_offset: Any,
    out_cache_loc: Any,
    pool_len: int,
) -> None:
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    taken = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        length = end - start
        if length <= 0:
            continue
        if end > pool_len:
            raise ValueError(f"slot range {start}:{end} past the pool length {pool_len}")
        source = out_cache_loc[taken : taken + length]
        req_to_token[row, start:end] = source.to(req_to_token.dtype)
        taken += length


def _rows(address: int, stride: int, count: int) -> Any:
    """``count`` rows of ``stride`` bytes at ``address``, as a (count, stride) uint8 view."""
    memory = (ctypes.c_uint8 * (stride * count)).from_address(address)
    return torch.frombuffer(memory, dtype=torch.uint8).view(count, stride)


def copy_all_layer_kv_cache_cpu(data_ptrs: Any, strides: Any, tgt_loc: Any, src_loc: Any) -> None:
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64)
    src = src_loc.to(torch.int64)
    count = int(torch.maximum(tgt.max(), src.max()).item()) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = _rows(int(address), int(stride), count)
        rows[tgt] = rows[src].clone()


def _refuse(name: str) -> Any:
    def refused(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"sgl_kernel.{name}: not provided by kvgate's CPU stand-in (no speculative decoding)"
        )

    refused.__name__ = name
    return refused


# speculative decoding (EAGLE, trees, multi-layer drafts): imported at module level, never
# called unless a speculative algorithm is configured
assign_draft_cache_locs_contiguous_cpu = _refuse("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _refuse("assign_extend_cache_locs_cpu")
build_tree_kernel_efficient_cpu = _refuse("build_tree_kernel_efficient_cpu")
fill_accept_out_cache_loc_cpu = _refuse("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _refuse("fill_bonus_tokens_cpu")
rotate_input_ids_cpu = _refuse("rotate_input_ids_cpu")
verify_tree_greedy_cpu = _refuse("verify_tree_greedy_cpu")
