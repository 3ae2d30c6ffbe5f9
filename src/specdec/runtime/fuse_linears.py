"""One call for the projections of a compiled pass that read the same input, and packed weights where they pay.

A Llama-shaped layer projects one input three times (q, k, v) and another twice (gate, up). On the fast path each
projection is a call of the row-invariant linear (runtime/rowwise.py), and on a CPU a call costs ~2 µs of dispatch
beyond its arithmetic: ~40 calls a pass of the default target, of which a third can go. Inductor's own
`cpp.enable_concat_linear` does this for PyTorch's linears; this pass does it for ours.

It runs after freezing (inductor's `post_grad_custom_pre_pass`), when the weights are constants of the graph: calls
that share an input node and whose weights (and biases) are constants of one dtype and width become one call on the
concatenated weight, followed by a slice of its output for each (calls whose weight is an input of the graph stay).
Since row_linear computes every output element in one fixed order whatever the weight's other rows are, the outputs
are the same bits as the separate calls' (tests/test_fuse_linears.py).

Calls with a constant weight run `specdec::packed_linear` on a packed copy of it instead
(runtime/kernels/packed_linear.cpp; `packs`), where the CPU serves it: its panels are one sequential stream of
weights for a pass of a few rows and need no lane sums, so a decoding pass and a prefill both run faster than on
row_linear. A fused call packs the concatenation. Whether a weight is packed depends on the weight alone, never on
the pass, so every pass of a path gives a row the same bits.

The concatenated and packed weights are copies, made once per model object and shared by all its compiled passes
(`shared`, the model's entry in runtime/compiled.py). They become constants of the compiled graph, which inductor's
cache stores with it, so the pass's cache key (`uuid`) names their values (`weights_fingerprint`): a model of the
same shape with other weights must not get a cached graph holding another model's copies. Only weights of at most `MAX_COPY_BYTES` are copied: there a
call's dispatch and the weights' layout are what cost, and the copies stay small (the default target's are ~28 MB
in bfloat16 and ~55 MB in float32: packed copies only, as every weight is packed); a larger model's projections take
long enough that ~2 µs does not matter, and its copies would not fit beside it.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from specdec.runtime import rowwise
from specdec.runtime.rowwise import packed_linear_serves

#: The largest weight (or concatenation of weights) this pass copies, in bytes (the default target's float32 LM
#: head is 12.6 MB).
MAX_COPY_BYTES = 16 << 20


def packs(weight: torch.Tensor, nbytes: int | None = None) -> bool:
    """Whether compiled passes run this constant weight (of `nbytes`, a concatenation's, when given) on
    `specdec::packed_linear`: where the kernel serves its dtype on this CPU and its copy is at most MAX_COPY_BYTES.
    It depends on the weight alone, so every pass of a path (prefill, decoding, verification, a tree's, a batch's)
    decides alike and a row's bits do not depend on which pass computed it."""
    nbytes = weight.numel() * weight.element_size() if nbytes is None else nbytes
    return packed_linear_serves(weight) and nbytes <= MAX_COPY_BYTES


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A hash of the values of every tensor of `model` this pass may copy (CPU parameters and buffers of at most
    MAX_COPY_BYTES; the parts of a concatenation are each within it), with their names, shapes and dtypes: what the
    constants of its compiled graphs hold beyond the graph's own inputs."""
    digest = hashlib.sha256()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device.type != "cpu" or nbytes > MAX_COPY_BYTES:
            continue
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _constant(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> torch.Tensor | None:
    """The tensor a get_attr node reads, or None for any other node."""
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    value = graph_module
    for part in node.target.split("."):
        value = getattr(value, part)
    return value if isinstance(value, torch.Tensor) else None


def _add_constant(graph: torch.fx.Graph, module: torch.nn.Module, prefix: str, before: torch.fx.Node, mode,
                  value: torch.Tensor) -> torch.fx.Node:
    """A get_attr node (inserted before `before`) reading `value`, a new constant of the graph's module under a
    free name `prefix`_i; with its fake tensor when the graph has a fake mode."""
    index = 0
    while hasattr(module, f"{prefix}_{index}"):
        index += 1
    name = f"{prefix}_{index}"
    module.register_buffer(name, value, persistent=False)
    with graph.inserting_before(before):
        node = graph.get_attr(name)
    if mode is not None:
        node.meta["val"] = mode.from_tensor(value, static_shapes=True)
    return node


def _erase_call(graph: torch.fx.Graph, call: torch.fx.Node) -> None:
    """Erase a replaced call, and the constants it read that nothing else reads."""
    _, weight, bias = _args(call)
    graph.erase_node(call)
    for old in (weight, bias):
        if old is not None and not old.users:
            graph.erase_node(old)


def _args(node: torch.fx.Node) -> tuple:
    """(input, weight, bias) of a row_linear call node, bias None when not given."""
    args = list(node.args) + [None] * (3 - len(node.args))
    return args[0], args[1], node.kwargs.get("bias", args[2])


class FuseRowLinears(CustomGraphPass):
    """The inductor graph pass (see the module's docstring); `uuid` keys inductor's cache on this file, the kernels'
    build and the values of the weights it copies (`weights`: `weights_fingerprint` of the model whose passes it
    compiles)."""

    def __init__(self, shared: dict | None = None, weights: str = ""):
        self.shared = {} if shared is None else shared  # (kind, source tensors' identities) -> the copy
        self.weights = weights

    def _copy(self, kind: str, sources: list[torch.Tensor], make) -> torch.Tensor:
        """The `kind` copy of `sources` (made by `make()` the first time): one per model, shared by its passes."""
        key = (kind, *((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in sources))
        if key not in self.shared:
            self.shared[key] = make()
        return self.shared[key]

    def __call__(self, graph: torch.fx.Graph) -> None:
        op = torch.ops.specdec.row_linear.default
        module = graph.owning_module
        groups: dict[torch.fx.Node, list[torch.fx.Node]] = defaultdict(list)  # input -> the calls reading it
        for node in graph.nodes:
            if node.op == "call_function" and node.target is op:
                groups[_args(node)[0]].append(node)
        for reading in groups.values():
            constant = [(call, w) for call in reading if (w := _constant(module, _args(call)[1])) is not None]
            calls = [call for call, _ in constant]
            weights = [w for _, w in constant]  # each [N_i, K]
            if len(calls) < 2 or len({(w.dtype, w.shape[1], w.device) for w in weights}) != 1:
                continue
            if sum(w.numel() * w.element_size() for w in weights) > MAX_COPY_BYTES:
                continue
            biases = [_args(call)[2] for call in calls]
            bias_values = None
            if any(b is not None for b in biases):  # all constants, or no fusion
                bias_values = [_constant(module, b) if b is not None else None for b in biases]
                if any(b is None for b in bias_values):
                    continue
            self._fuse(graph, module, calls, weights, bias_values)
        self._pack(graph, module)

    def _fuse(self, graph, module, calls, weights, bias_values) -> None:
        first = calls[0]  # the earliest in the graph (groups are filled in graph order)
        x = _args(first)[0]
        fake_x = x.meta.get("val")
        mode = fake_x.fake_mode if fake_x is not None else None
        before = _args(first)[1]  # new constants go beside the ones the graph reads
        if packs(weights[0], nbytes=sum(w.numel() * w.element_size() for w in weights)):
            op, extra = torch.ops.specdec.packed_linear.default, (sum(w.shape[0] for w in weights),)  # (ΣN,)
            weight = _add_constant(graph, module, "_specdec_packed_weight", before, mode,
                                   self._copy("pack", weights,
                                              lambda: torch.ops.specdec.pack_weight(torch.cat(weights))))
        else:
            op, extra = torch.ops.specdec.row_linear.default, ()
            weight = _add_constant(graph, module, "_specdec_fused_row_linear", before, mode,
                                   self._copy("cat", weights, lambda: torch.cat(weights)))  # [ΣN, K]
        bias = None
        if bias_values is not None:
            bias = _add_constant(graph, module, "_specdec_fused_row_linear_bias", before, mode,
                                 self._copy("cat", bias_values, lambda: torch.cat(bias_values)))  # [ΣN]
        with graph.inserting_before(first):
            fused = graph.call_function(op, (x, weight, bias, *extra))  # [..., ΣN]
            dim = fake_x.dim() - 1 if fake_x is not None else -1
            if mode is not None:
                with mode:
                    fused.meta["val"] = op(fake_x, weight.meta["val"], bias.meta["val"] if bias is not None else None,
                                           *extra)
            start = 0
            for call, w in zip(calls, weights):
                end = start + w.shape[0]
                part = graph.call_function(torch.ops.aten.slice.Tensor, (fused, dim, start, end))
                if mode is not None:
                    with mode:
                        part.meta["val"] = torch.ops.aten.slice.Tensor(fused.meta["val"], dim, start, end)
                call.replace_all_uses_with(part)
                start = end
        for call in calls:  # after the insertions, which go before the first of them
            _erase_call(graph, call)

    def _pack(self, graph, module) -> None:
        op = torch.ops.specdec.row_linear.default
        packed_op = torch.ops.specdec.packed_linear.default
        for call in [n for n in graph.nodes if n.op == "call_function" and n.target is op]:
            x, weight_node, bias = _args(call)
            weight = _constant(module, weight_node)
            if weight is None or not packs(weight):
                continue
            fake_x = x.meta.get("val")
            packed = _add_constant(graph, module, "_specdec_packed_weight", weight_node,
                                   fake_x.fake_mode if fake_x is not None else None,
                                   self._copy("pack", [weight], lambda: torch.ops.specdec.pack_weight(weight)))
            with graph.inserting_before(call):
                replacement = graph.call_function(packed_op, (x, packed, bias, weight.shape[0]))  # [..., N]
            if "val" in call.meta:
                replacement.meta["val"] = call.meta["val"]
            call.replace_all_uses_with(replacement)
            _erase_call(graph, call)

    def uuid(self) -> bytes:
        """What the graphs it leaves depend on beyond the graph itself: this file, rowwise.py (which weights the
        kernel serves), the kernels' build (their tier and sources: the packed layout), the weights' values. A
        graph compiled when a weight was not packed, or packed for another tier, is never served."""
        files = get_hash_for_files((str(Path(__file__).resolve()), str(Path(rowwise.__file__).resolve())))
        build = rowwise.build_name(rowwise.kernel_tier())
        return hashlib.sha256(files + build.encode() + self.weights.encode()).digest()
