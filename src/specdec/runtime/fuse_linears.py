"""One call for the projections of a compiled pass that read the same input, and packed weights where they pay.

A Llama-shaped layer projects one input three times (q, k, v) and another twice (gate, up). On the fast path each
projection is a call of the row-invariant linear (runtime/rowwise.py), and on a CPU a call costs ~2 µs of dispatch
beyond its arithmetic: ~40 calls a pass of the default target, of which a third can go. Inductor's own
`cpp.enable_concat_linear` does this for PyTorch's linears; this pass does it for ours.

It runs before freezing (inductor's `joint_custom_pre_pass`), when the model's parameters are still inputs of the
graph (and in a graph whose weights are constants): calls that share an input node and whose weights (and biases)
are fixed (`_fixed`: constants, or inputs that are the model's parameters or buffers) of one dtype and width become
one call on the concatenated weight, followed by a slice of its output for each (calls whose weight is any other
input stay). Since row_linear computes every output element in one fixed order whatever the weight's other rows are,
the outputs are the same bits as the separate calls' (tests/test_fuse_linears.py).

Calls with a fixed weight run `specdec::packed_linear` on a packed copy of it instead
(runtime/kernels/packed_linear.cpp; `packs`), where the CPU serves it: its panels are one sequential stream of
weights for a pass of a few rows and need no lane sums, so a decoding pass and a prefill both run faster than on
row_linear. A fused call packs the concatenation. Whether a weight is packed depends on the weight alone, never on
the pass, so every pass of a path gives a row the same bits.

The concatenated and packed weights are copies, made once per model object and shared by all its compiled passes
(`shared`, the model's entry in runtime/compiled.py). The pass inserts them as calls (`SharedCopy`) on the weights,
which freezing folds into constants of the graph: made (or taken from `shared`) whenever a graph is compiled or
loaded from inductor's cache, and never stored in the cache, so every compiled shape of a model reads the same
copies. (Constants added after freezing would be stored with each cached graph: a model's passes loaded from the
cache would each hold their own copies, one more set of weights in memory and in the CPU's caches per shape.) The
pass's cache key (`uuid`) still names the weights' values (`weights_fingerprint`). Only weights of at most `MAX_COPY_BYTES` are copied: there a
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


def _fixed(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> torch.Tensor | None:
    """The tensor (or, before freezing, its fake tensor) of a node fixed for the graph's life: a constant, or an
    input that is one of the model's parameters or buffers (freezing makes it a constant); None for any other."""
    if isinstance(node, torch.fx.Node) and node.op == "placeholder":
        desc = node.meta.get("desc")  # what the input is, as AOTAutograd describes it
        return node.meta.get("val") if desc is not None and (desc.is_param() or desc.is_buffer()) else None
    return _constant(graph_module, node)


class SharedCopy:
    """A node's target: the `kind` copy ("pack": `pack_weight` of the concatenation; "cat": the concatenation) of
    the tensors it is called with, made the first time and then taken from `shared`, the model's copies. Its
    inputs are fixed (`_fixed`), so freezing folds the call into a constant of the graph: computed when a graph is
    compiled or loaded from inductor's cache, never stored in the cache, and one tensor for every pass of the
    model (a copy in each cached graph would put one per compiled shape in memory and in the CPU's caches)."""

    def __init__(self, shared: dict, kind: str):
        self.shared, self.kind = shared, kind
        self.__name__ = f"specdec_shared_{kind}"  # the node's name in the graph's code

    def __call__(self, *sources: torch.Tensor) -> torch.Tensor:
        key = (self.kind, *((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in sources))
        copy = self.shared.get(key)
        if copy is None:
            whole = torch.cat(sources) if len(sources) > 1 else sources[0]
            copy = torch.ops.specdec.pack_weight(whole) if self.kind == "pack" else whole.clone()
            try:
                copy.data_ptr()  # a fake tensor (the graph's shapes propagated under a fake mode) is never kept
            except RuntimeError:
                return copy
            self.shared[key] = copy
        return copy

    def fake(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """The copy's fake tensor, in the fake mode of `sources` (fake tensors)."""
        with sources[0].fake_mode:
            whole = torch.cat(sources) if len(sources) > 1 else sources[0]
            return torch.ops.specdec.pack_weight(whole) if self.kind == "pack" else torch.empty_like(whole)


def _copy_node(graph: torch.fx.Graph, shared: dict, kind: str, sources: list[torch.fx.Node],
               values: list[torch.Tensor], before: torch.fx.Node) -> torch.fx.Node:
    """A call (inserted before `before`) of the shared `kind` copy of the fixed nodes `sources` (whose tensors,
    or fake tensors, are `values`)."""
    target = SharedCopy(shared, kind)
    order = {node: i for i, node in enumerate(graph.nodes)}
    for source in sources:  # a constant read later in the graph is read from here on (it has no inputs)
        if source.op == "get_attr" and order[source] > order[before]:
            before.prepend(source)
    with graph.inserting_before(before):
        node = graph.call_function(target, tuple(sources))
    if all(source.op == "placeholder" for source in sources):  # before freezing: `values` are fake tensors
        node.meta["val"] = target.fake(values)
    return node


def _erase_call(graph: torch.fx.Graph, call: torch.fx.Node) -> None:
    """Erase a replaced call, and the constants it read that nothing else reads (inputs stay)."""
    _, weight, bias = _args(call)
    graph.erase_node(call)
    for old in (weight, bias):
        if old is not None and old.op == "get_attr" and not old.users:
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

    def __call__(self, graph: torch.fx.Graph) -> None:
        op = torch.ops.specdec.row_linear.default
        module = graph.owning_module
        groups: dict[torch.fx.Node, list[torch.fx.Node]] = defaultdict(list)  # input -> the calls reading it
        for node in graph.nodes:
            if node.op == "call_function" and node.target is op:
                groups[_args(node)[0]].append(node)
        for reading in groups.values():
            fixed = [(call, w) for call in reading if (w := _fixed(module, _args(call)[1])) is not None]
            calls = [call for call, _ in fixed]
            weights = [w for _, w in fixed]  # each [N_i, K]
            if len(calls) < 2 or len({(w.dtype, w.shape[1], w.device) for w in weights}) != 1:
                continue
            if sum(w.numel() * w.element_size() for w in weights) > MAX_COPY_BYTES:
                continue
            biases = [_args(call)[2] for call in calls]
            if any(b is not None for b in biases):  # all fixed, or no fusion
                if any(b is None or _fixed(module, b) is None for b in biases):
                    continue
                self._fuse(graph, module, calls, weights, biases)
            else:
                self._fuse(graph, module, calls, weights, None)
        self._pack(graph, module)

    def _fuse(self, graph, module, calls, weights, biases) -> None:
        first = calls[0]  # the earliest in the graph (groups are filled in graph order)
        x = _args(first)[0]
        fake_x = x.meta.get("val")
        mode = fake_x.fake_mode if fake_x is not None else None
        sources = [_args(call)[1] for call in calls]
        if packs(weights[0], nbytes=sum(w.numel() * w.element_size() for w in weights)):
            op, extra = torch.ops.specdec.packed_linear.default, (sum(w.shape[0] for w in weights),)  # (ΣN,)
            weight = _copy_node(graph, self.shared, "pack", sources, weights, first)
        else:
            op, extra = torch.ops.specdec.row_linear.default, ()
            weight = _copy_node(graph, self.shared, "cat", sources, weights, first)  # [ΣN, K]
        bias = None
        if biases is not None:
            bias = _copy_node(graph, self.shared, "cat", biases, [_fixed(module, b) for b in biases], first)  # [ΣN]
        with graph.inserting_before(first):
            fused = graph.call_function(op, (x, weight, bias, *extra))  # [..., ΣN]
            dim = fake_x.dim() - 1 if fake_x is not None else -1
            if mode is not None and "val" in weight.meta:
                with mode:
                    fused.meta["val"] = op(fake_x, weight.meta["val"], bias.meta["val"] if bias is not None else None,
                                           *extra)
            start = 0
            for call, w in zip(calls, weights):
                end = start + w.shape[0]
                part = graph.call_function(torch.ops.aten.slice.Tensor, (fused, dim, start, end))
                if "val" in fused.meta:
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
            weight = _fixed(module, weight_node)
            if weight is None or not packs(weight):
                continue
            packed = _copy_node(graph, self.shared, "pack", [weight_node], [weight], call)
            with graph.inserting_before(call):
                replacement = graph.call_function(packed_op, (x, packed, bias, weight.shape[0]))  # [..., N]
            if "val" in call.meta:
                replacement.meta["val"] = call.meta["val"]
            call.replace_all_uses_with(replacement)
            _erase_call(graph, call)

    def uuid(self) -> bytes:
        """What the graphs it leaves depend on beyond the graph itself: this file, rowwise.py (which weights the
        kernel serves), the kernels' version (their tier and sources: the packed layout), the weights' values. A
        graph compiled when a weight was not packed, or packed for another tier, is never served."""
        files = get_hash_for_files((str(Path(__file__).resolve()), str(Path(rowwise.__file__).resolve())))
        build = rowwise.kernels_version(rowwise.kernel_tier())
        return hashlib.sha256(files + build.encode() + self.weights.encode()).digest()
