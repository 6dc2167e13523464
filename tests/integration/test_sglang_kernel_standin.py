"""The ``sgl_kernel`` stand-in (backends/sglang_cpu/sgl_kernel_standin.py) as SGLang's CPU
engine calls it, run by the SGLang venv's python (torch): each op against the semantics of the
Triton kernels it replaces (their call sites in SGLang), on small tensors."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvgate.backends.sglang_cpu.layout import SglangLayout

pytestmark = pytest.mark.sglang

CHECK = r"""
import torch
import sgl_kernel

# assign_req_to_token_pool_cpu: request i's slots, taken in order from out_cache_loc, go to
# its row of the request-to-token table between its start and end offsets
table = torch.zeros((4, 16), dtype=torch.int32)
sgl_kernel.assign_req_to_token_pool_cpu(
    torch.tensor([2, 0]), table, torch.tensor([3, 0]), torch.tensor([7, 2]),
    torch.arange(100, 106, dtype=torch.int64), table.shape[1],
)
expected = torch.zeros((4, 16), dtype=torch.int32)
expected[2, 3:7] = torch.tensor([100, 101, 102, 103], dtype=torch.int32)
expected[0, 0:2] = torch.tensor([104, 105], dtype=torch.int32)
assert torch.equal(table, expected), table

# copy_all_layer_kv_cache_cpu: in every layer's buffer (address, row stride in bytes), rows
# src copied to rows tgt, all read before any write (a swap stays a swap)
torch.manual_seed(0)
layers = [torch.randn((10, 2, 8), dtype=torch.bfloat16) for _ in range(3)]
before = [layer.clone() for layer in layers]
pointers = torch.tensor([layer.data_ptr() for layer in layers], dtype=torch.uint64)
strides = torch.tensor([layer.stride(0) * layer.dtype.itemsize for layer in layers])
sgl_kernel.copy_all_layer_kv_cache_cpu(
    pointers, strides, torch.tensor([1, 5, 7]), torch.tensor([5, 1, 2])
)
for layer, old in zip(layers, before):
    want = old.clone()
    want[1], want[5], want[7] = old[5], old[1], old[2]
    assert torch.equal(layer, want)

try:
    sgl_kernel.verify_tree_greedy_cpu()
except NotImplementedError as refused:
    assert "speculative" in str(refused)
else:
    raise AssertionError("a speculative op ran")
print("ok")
"""


def test_the_standin_ops_do_what_sglang_calls_them_for(sglang_model_dir: Path) -> None:
    layout = SglangLayout.default()  # installed by the sglang_model_dir fixture
    done = subprocess.run(
        [str(layout.python), "-c", CHECK],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
