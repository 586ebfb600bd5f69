"""``benchmarks/inductor_kernel_sizes.py``: Triton kernels found in an Inductor cache, with sizes."""

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "inductor_kernel_sizes.py")

# The shape of a kernel file Inductor writes (decorator with the signature, then the kernel).
KERNEL_FILE = '''
@triton_heuristics.pointwise(
    size_hints={'y': 16384, 'x': 8192}, tile_hint=TileHint.DEFAULT,
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*bf16', 'in_ptr1': '*fp32', 'out_ptr0': '*fp8e4nv', 'ynumel': 'i32', 'xnumel': 'i32', 'YBLOCK': 'constexpr', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties()},
)
@triton.jit
def triton_poi_fused__to_copy_t_7(in_ptr0, in_ptr1, out_ptr0, ynumel, xnumel, YBLOCK : tl.constexpr, XBLOCK : tl.constexpr):
    ynumel = 16384
    xnumel = 8192
    yoffset = tl.program_id(1) * YBLOCK
    tmp0 = tl.load(in_ptr0 + (y0 + 16384*x1), xmask & ymask, eviction_policy='evict_last')
    tmp1 = tl.load(in_ptr1 + (0))
    tl.store(out_ptr0 + (x1 + 8192*y0), tmp3, xmask & ymask)
'''


def _script():
    spec = importlib.util.spec_from_file_location("inductor_kernel_sizes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kernels_are_listed_once_with_sizes_pointer_dtypes_and_accesses(tmp_path):
    for sub in ("ab", "cd"):  # the same kernel in two cache entries is listed once
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "k.py").write_text(KERNEL_FILE)
    (tmp_path / "ab" / "wrapper.py").write_text("def call(args):\n    return None\n")  # no @triton.jit: skipped
    (tmp_path / "ab" / "notes.txt").write_text(KERNEL_FILE)  # not a .py file: skipped
    out = tmp_path / "kernels.json"
    assert _script().main([str(tmp_path), "--out", str(out)]) == 0
    kernels = json.loads(out.read_text())
    assert [k["kernel"] for k in kernels] == ["triton_poi_fused__to_copy_t_7"]
    kernel = kernels[0]
    assert kernel["numels"] == {"ynumel": 16384, "xnumel": 8192}
    assert kernel["pointers"] == {"in_ptr0": "*bf16", "in_ptr1": "*fp32", "out_ptr0": "*fp8e4nv"}
    assert len(kernel["accesses"]) == 3 and kernel["accesses"][2].startswith("tl.store(out_ptr0")


def test_two_kernels_in_one_file_keep_their_own_sizes(tmp_path):
    second = KERNEL_FILE.replace("triton_poi_fused__to_copy_t_7", "triton_red_fused_amax_2").replace("16384", "64")
    (tmp_path / "k.py").write_text(KERNEL_FILE + second)
    kernels = {k["kernel"]: k for k in _script().kernels_in(str(tmp_path))}
    assert kernels["triton_poi_fused__to_copy_t_7"]["numels"]["ynumel"] == 16384
    assert kernels["triton_red_fused_amax_2"]["numels"]["ynumel"] == 64
