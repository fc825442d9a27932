"""Helper of the sync pass: global statistics for one ``FusedBatchNormV3`` in training mode.

See :mod:`replicate.passes.sync` for the formulas. Per tower the forward op is replaced by
the same op in inference mode fed with global statistics, and its gradient op by the
inference-mode gradient plus the correction through the global statistics.
"""

from __future__ import annotations

import logging

from tensorflow.python.framework import dtypes

from replicate.graph.ir import IR, Node, parse_tensor
from replicate.passes._combine import combine, weight

__all__ = ["FusedSync"]

log = logging.getLogger(__name__)


class _Ops:
    """Adds small ops under one scope on one device."""

    def __init__(self, ir: IR, scope: str, device: str, dtype):
        self.ir, self.scope, self.device, self.dtype = ir, scope, device, dtype

    def __call__(self, name: str, op: str, inputs: list[str], **attrs) -> str:
        attrs.setdefault("T", self.dtype)
        attrs = {k: v for k, v in attrs.items() if v is not None}
        return self.ir.add(f"{self.scope}/{name}", op, [_ref(i) for i in inputs], device=self.device,
                           attrs=attrs).name

    def const(self, name: str, value, dtype=None) -> str:
        return self.ir.const(f"{self.scope}/{name}", value, dtype or self.dtype, self.device)


class FusedSync:
    """Rewrites the tower copies of one FusedBatchNormV3 and its gradient op."""

    def __init__(self, ir: IR, controller: str, name: str, grad_nodes: list[str]):
        self.ir, self.controller, self.name = ir, controller, name
        #: one gradient op per gradient computation (a GAN's two train ops each have one)
        self.grads = [g for g in grad_nodes if ir.nodes[g].op == "FusedBatchNormGradV3"]

    def run(self) -> None:
        ir, name = self.ir, self.name
        towers, copies = ir.facts["towers"], ir.facts["copies"]
        analysis = ir.facts["analysis"]
        node = ir.nodes[name]
        u = dtypes.as_dtype(node.attr("U", dtypes.float32.as_datatype_enum))
        t = dtypes.as_dtype(node.attr("T", dtypes.float32.as_datatype_enum))
        nchw = node.attr("data_format", "NHWC").startswith("NC")
        axes = [0, 2, 3] if nchw else [0, 1, 2]
        n = len(towers.devices)
        scope = f"replicate/sync/{name}"
        shared = _Ops(ir, scope, self.controller, u)
        local = [_Ops(ir, f"{scope}/{towers.prefixes[k]}", towers.devices[k], u) for k in range(n)]
        x = [self._input(copies[k][name], 0, t, u, local[k]) for k in range(n)]
        for k in range(n):
            local[k].const("axes", axes, dtypes.int32)
            local[k]("mean", "Mean", [x[k], f"{local[k].scope}/axes"], Tidx=dtypes.int32, keep_dims=False)
        mean = combine(ir, towers, f"{scope}/mean", [f"{o.scope}/mean" for o in local], "mean",
                       u.as_datatype_enum, self.controller, self.controller)
        mean_b = self._broadcast(shared, mean, nchw, "mean_b")
        for k in range(n):
            sq = local[k]("sq", "SquaredDifference", [x[k], mean_b])
            local[k]("var", "Mean", [sq, f"{local[k].scope}/axes"], Tidx=dtypes.int32, keep_dims=False)
            size = local[k]("size", "Size", [x[k]], out_type=dtypes.int64)
            channels = local[k]("channels", "Size", [f"{local[k].scope}/mean"], out_type=dtypes.int64)
            count = local[k]("count_i", "FloorDiv", [size, channels], T=dtypes.int64)
            local[k]("count", "Cast", [count], SrcT=dtypes.int64, DstT=u, T=None)
        var = combine(ir, towers, f"{scope}/variance", [f"{o.scope}/var" for o in local], "mean",
                      u.as_datatype_enum, self.controller, self.controller)
        total = shared("count", "AddN", [f"{o.scope}/count" for o in local], N=n) if n > 1 else \
            shared("count", "Identity", [f"{local[0].scope}/count"])
        one = shared.const("one", 1.0)
        denom = shared("count_minus_one", "Maximum", [shared("cm1", "Sub", [total, one]), one])
        unbiased = shared("unbiased_variance", "Mul", [var, shared("bessel", "RealDiv", [total, denom])])
        forward = []
        for k in range(n):
            forward.append(self._forward(copies[k][name], mean, var, unbiased, towers.devices[k]))
        ir.facts.setdefault("synced_outputs", {})[name] = {1: mean, 2: unbiased}
        for i, grad in enumerate(self.grads):
            sub = _Ops(ir, f"{scope}/grad_{i}", self.controller, u) if i else shared
            self._backward(grad, copies, towers, analysis, sub, local, x, mean_b, var, total, forward,
                           nchw, u, i)
        log.info("sync: %s uses global statistics in %d towers", name, n)

    def _input(self, copy: str, pos: int, t, u, ops: _Ops) -> str:
        ref = self.ir.nodes[copy].inputs[pos]
        return ref if t == u else ops("x_cast", "Cast", [ref], SrcT=t, DstT=u, T=None)

    def _broadcast(self, ops: _Ops, tensor: str, nchw: bool, name: str) -> str:
        if not nchw:
            return tensor
        shape = ops.const(f"{name}_shape", [1, -1, 1, 1], dtypes.int32)
        return ops(name, "Reshape", [tensor, shape], Tshape=dtypes.int32)

    def _forward(self, copy: str, mean: str, var: str, unbiased: str, device: str) -> str:
        """Point the moving-average readers at the global statistics, then swap the tower's op
        for the same op in inference mode (same name) fed with them."""
        ir = self.ir
        for idx, target in ((1, mean), (2, unbiased)):
            ir.replace_uses(f"{copy}:{idx}", target)
        node = ir.nodes[copy]
        attrs = dict(node.attrs)
        attrs["is_training"] = _attr(False)
        attrs["exponential_avg_factor"] = _attr(1.0)
        inputs = node.inputs[:3] + [_ref(mean), _ref(var)]
        ir.remove_many([copy])
        ir.add_node(Node(copy, node.op, inputs, list(node.control), device, attrs))
        return copy

    def _backward(self, grad: str, copies, towers, analysis, shared, local, x, mean_b, var, total,
                  forward, nchw, u, index: int) -> None:
        ir = self.ir
        n = len(towers.devices)
        grads = [copies[k][grad] for k in range(n)]
        node = ir.nodes[grad]
        eps = shared.const("epsilon", float(node.attr("epsilon", 1e-3)))
        rstd = shared("rstd", "Rsqrt", [shared("var_eps", "AddV2", [var, eps])])
        # One copy of the scale feeds every tower's kernel and ``gamma_rstd``: the copy is a data
        # ancestor of the scale's gradient, so it is taken before the optimizer updates the scale
        # (a ref variable's read aliases its buffer; a control gate would not survive Grappler).
        scale_copy = shared("scale", "Snapshot", [ir.nodes[grads[0]].inputs[2]])
        new = []
        for k in range(n):
            g = ir.nodes[grads[k]]
            fwd = ir.nodes[forward[k]]
            attrs = dict(g.attrs)
            attrs["is_training"] = _attr(False)
            inputs = g.inputs[:2] + [scale_copy, fwd.inputs[3], fwd.inputs[4], f"{forward[k]}:5"]
            new.append(ir.add_node(Node(f"{grads[k]}_inference", g.op, inputs, list(g.control),
                                        towers.devices[k], attrs)).name)
        scope = next(s for s in analysis.scopes if grad.startswith(s.prefix + "/"))
        s1 = combine(ir, towers, f"{shared.scope}/offset_grad", [f"{g}:2" for g in new], "dense",
                     u.as_datatype_enum, self.controller, self.controller, scope.weights)
        s2 = combine(ir, towers, f"{shared.scope}/scale_grad", [f"{g}:1" for g in new], "dense",
                     u.as_datatype_enum, self.controller, self.controller, scope.weights)
        gamma_r = shared("gamma_rstd", "Mul", [scale_copy, rstd])
        s1_b, s2_b = self._broadcast(shared, s1, nchw, "s1_b"), self._broadcast(shared, s2, nchw, "s2_b")
        for k in range(n):
            ops = local[k] if not index else _Ops(ir, f"{local[k].scope}/grad_{index}", local[k].device, u)
            c_k = weight(ir, towers, k, u.as_datatype_enum, self.controller, scope.weights)
            xhat = ops("xhat", "Mul", [ops("centered", "Sub", [x[k], mean_b]),
                                       self._broadcast(ops, rstd, nchw, "rstd_b")])
            inner = ops("inner", "AddV2", [s1_b, ops("xhat_s2", "Mul", [xhat, s2_b])])
            scale = ops("scale", "DivNoNan", [gamma_r, ops("cm", "Mul", [c_k, total])])
            corr = ops("correction", "Mul", [inner, self._broadcast(ops, scale, nchw, "scale_b")])
            dx = f"{new[k]}:0"
            t = dtypes.as_dtype(ir.nodes[grads[k]].attr("T"))
            if t != u:
                corr = ops("correction_cast", "Cast", [corr], SrcT=u, DstT=t, T=None)
            fixed = ir.add(f"{ops.scope}/dx", "Sub", [_ref(dx), corr], device=towers.devices[k],
                           attrs={"T": t}).name
            outputs = [fixed] + [f"{new[k]}:{i}" for i in range(1, 5)]
            types = [ir.output_dtype(o) for o in outputs]
            ir.remove_many([grads[k]])
            ir.add(grads[k], "IdentityN", [_ref(o) for o in outputs], device=towers.devices[k],
                   attrs={"T": types})


def _attr(value):
    from replicate.graph.ir import make_attr

    return make_attr(value)


def _ref(tensor: str) -> str:
    node, idx = parse_tensor(tensor)
    return node if idx == 0 else f"{node}:{idx}"
