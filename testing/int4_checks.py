"""Checks of an engine's INT4 weights (``MatMulNBits`` in the CPU engine's graph)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def assert_int4_weights_dequantize_to(engine_dir: str | Path, reference: dict[str, np.ndarray],
                                      linears: int) -> None:
    """Every ``MatMulNBits`` of ``engine_dir``'s model.onnx dequantizes (codes - zero point) * scale, bit for bit, to
    the float32 weights ``reference`` holds under the checkpoint's names (a packed node: its members stacked; the
    fused gate|up node interleaves rows, compared as sets), and ``linears`` checkpoint linears are covered."""
    import onnx
    from onnx import numpy_helper

    from llmc.passes.quantize import members_of

    m = onnx.load(str(Path(engine_dir) / "model.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    seen = 0
    for node in m.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        b, scales, zp = (inits[i] for i in node.input[1:4])
        nn, ng, half = b.shape
        q = np.stack([b & 15, b >> 4], -1).reshape(nn, ng, 2 * half).astype(np.float32)
        z = np.stack([zp & 15, zp >> 4], -1).reshape(nn, -1)[:, :ng].astype(np.float32)
        got = ((q - z[:, :, None]) * scales[:, :, None]).reshape(nn, -1).view(np.uint32)
        members = members_of(node.input[1].removesuffix(".int4"))
        want = np.concatenate([reference[x] for x in members], axis=0).view(np.uint32)
        if len(members) == 2:  # gate/up interleaved for the fused SwiGLU: compare the rows as sets
            got, want = got[np.lexsort(got.T[::-1])], want[np.lexsort(want.T[::-1])]
        assert np.array_equal(got, want), members
        seen += len(members)
    assert seen == linears, (seen, linears)
