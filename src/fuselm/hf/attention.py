"""The attention forward of Llama-style attention classes with the q, k, v projections and the rotary
embedding as one autograd node (:func:`fuselm.ops.rope.qkv_rotary`).

Hugging Face's attention forward (Llama's, and the ~150 modeling files that copy it) starts with

    query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

which autograd records as about twenty nodes (three linears, a view and a transpose node each, the
rotation), each costing host time in every step: at small batch the step is bound by that host time.
fuselm's forward (opt-in: ``fuselm.hf.patch(..., fused_layer=True)``; the default patch leaves the
attention HF's) is the installed transformers' own forward with those five statements replaced by one
call (:func:`attention_input`), made from its source when patching (the syntax tree, compared statement
for statement, so a transformers version that changes them is seen then: the class keeps HF's forward
and a warning says why). Everything else (the attention interface, the cache, the output projection)
is HF's code, run as HF runs it. At run time the fused node runs when q, k and v are plain ``nn.Linear``
layers without hooks holding plain tensors (not PEFT / bitsandbytes layers, not DTensors) and cos / sin
are ``[B, T, D]``; otherwise the five statements run as HF wrote them (with fuselm's RoPE).
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable

from ..nn.mlp import is_plain_linear
from ..ops.projections import linear_projections
from ..ops.rope import qkv_rotary
from ._common import is_plain_tensor, modeling_module, warn_once
from .layer_layout import split_checkpointing
from .registry import FamilySpec

_INPUT = """
query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
cos, sin = position_embeddings
query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
"""
_FUSED_INPUT = """
cos, sin = position_embeddings
query_states, key_states, value_states = _fuselm_attention_input(self, hidden_states, hidden_shape, cos, sin)
"""
_HIDDEN_SHAPE = "hidden_shape = (*input_shape, -1, self.head_dim)"


def attention_input(rope: Callable, attn, hidden_states, hidden_shape, cos, sin):
    """(q, k, v) in ``[B, heads, T, D]`` as HF's five statements compute them (``rope`` is the modeling
    module's ``apply_rotary_pos_emb``): through :func:`qkv_rotary` when the projections are plain
    ``nn.Linear`` layers of plain tensors and cos / sin are ``[B, T, D]``, else as HF wrote them."""
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    if (
        hidden_states.dim() == 3
        and cos.dim() == 3
        and all(is_plain_linear(p) and is_plain_tensor(p.weight) for p in projections)
    ):
        return qkv_rotary(
            hidden_states,
            *(p.weight for p in projections),
            cos,
            sin,
            head_dim=attn.head_dim,
            q_bias=attn.q_proj.bias,
            k_bias=attn.k_proj.bias,
            v_bias=attn.v_proj.bias,
        )
    q, k, v = (p(hidden_states).view(hidden_shape).transpose(1, 2) for p in projections)
    q, k = rope(q, k, cos, sin)
    return q, k, v


def _statements(source: str) -> list[str]:
    return [ast.dump(s) for s in ast.parse(source).body]


def projections_input(attn, hidden_states):
    """(q, k, v) projections of ``hidden_states`` as ``attn.q_proj(hidden_states)`` etc. compute them: one
    node (:func:`linear_projections`) when the three are plain ``nn.Linear`` layers of plain tensors, else
    the three modules (PEFT / bitsandbytes layers run their own forwards)."""
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    if all(is_plain_linear(p) and is_plain_tensor(p.weight) for p in projections):
        return linear_projections(
            hidden_states, tuple(p.weight for p in projections), tuple(p.bias for p in projections)
        )
    return tuple(p(hidden_states) for p in projections)


_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def _projection_call(node: ast.AST) -> str | None:
    """``q_proj`` (``k_proj``, ``v_proj``) when ``node`` is ``self.q_proj(hidden_states)``, else None."""
    if not (isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords):
        return None
    func, arg = node.func, node.args[0]
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"):
        return None
    if func.attr in _PROJECTIONS and isinstance(arg, ast.Name) and arg.id == "hidden_states":
        return func.attr
    return None


class _ProjectionCalls(ast.NodeTransformer):
    def visit_Call(self, node):
        name = _projection_call(node)
        if name is not None:
            return ast.copy_location(ast.Name(id=f"_fuselm_{name}", ctx=ast.Load()), node)
        return self.generic_visit(node)


def _fuse_projections(fn: ast.FunctionDef) -> str | None:
    """Replace the three ``self.<x>_proj(hidden_states)`` calls of ``fn`` by the outputs of one
    ``_fuselm_projections(self, hidden_states)`` call put before them (in place), or say why not: each call
    must appear once, in three consecutive statements."""
    where = {}
    for i, stmt in enumerate(fn.body):
        for node in ast.walk(stmt):
            name = _projection_call(node)
            if name is not None:
                if name in where:
                    return f"its forward calls self.{name}(hidden_states) more than once"
                where[name] = i
    if set(where) != set(_PROJECTIONS):
        return "its forward does not project hidden_states with q_proj, k_proj and v_proj"
    first = min(where.values())
    if sorted(where.values()) != [first, first + 1, first + 2]:
        return "its q, k and v projections are not three consecutive statements"
    fn.body[first : first + 3] = [_ProjectionCalls().visit(s) for s in fn.body[first : first + 3]]
    fn.body.insert(
        first,
        ast.parse(
            "_fuselm_q_proj, _fuselm_k_proj, _fuselm_v_proj = _fuselm_projections(self, hidden_states)"
        ).body[0],
    )
    return None


def _forward_tree(forward: Callable) -> ast.FunctionDef | str:
    """The syntax tree of ``forward``'s definition (a plain function without closure variables), or why
    it cannot be had."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError) as e:
        return f"its source cannot be read ({type(e).__name__})"
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, ast.FunctionDef):
        return "its forward is not a plain function"
    if forward.__code__.co_freevars:
        return "its forward uses closure variables"
    return fn


def _llama_input_at(fn: ast.FunctionDef) -> int | None:
    """Where Llama's five q, k, v + RoPE statements begin in ``fn``'s body (once, after ``hidden_shape =
    ...``), or None."""
    body = [ast.dump(s) for s in fn.body]
    want = _statements(_INPUT)
    starts = [i for i in range(len(body) - len(want) + 1) if body[i : i + len(want)] == want]
    if len(starts) == 1 and _statements(_HIDDEN_SHAPE)[0] in body[: starts[0]]:
        return starts[0]
    return None


def _module_of(fn: ast.FunctionDef, maker: str) -> ast.Module:
    """A module defining ``maker`` (a ``def ...: return forward`` source) with ``fn`` defined inside it,
    undecorated."""
    fn.decorator_list = []
    made = ast.parse(maker).body[0]
    made.body.insert(0, fn)
    return ast.fix_missing_locations(ast.Module(body=[made], type_ignores=[]))


def fused_attention_source(forward: Callable) -> tuple[ast.Module, str] | str:
    """(the syntax tree of a module defining ``_fuselm_make_forward(_fuselm_attention_input,
    _fuselm_projections)``, which returns ``forward`` (HF's attention forward, unwrapped) rewritten, and
    how: ``"qkv_rotary"`` when its five Llama input statements became one call of
    ``_fuselm_attention_input``, ``"projections"`` when only its three projection calls became one call
    of ``_fuselm_projections`` (q / k norms between the projections and the RoPE)); or why neither can be
    done."""
    fn = _forward_tree(forward)
    if isinstance(fn, str):
        return fn
    i = _llama_input_at(fn)
    if i is not None:
        fn.body[i : i + len(_statements(_INPUT))] = ast.parse(_FUSED_INPUT).body
        how = "qkv_rotary"
    else:
        reason = _fuse_projections(fn)
        if reason is not None:
            return reason
        how = "projections"
    maker = "def _fuselm_make_forward(_fuselm_attention_input, _fuselm_projections):\n    return forward\n"
    return _module_of(fn, maker), how


_CORE_INPUT = "query_states, key_states, value_states = _fuselm_qkv"
_CORE_TAIL = """
attn_output = self.o_proj(attn_output)
return attn_output, attn_weights
"""


def attention_core_source(forward: Callable) -> ast.Module | str:
    """The syntax tree of a module defining ``_fuselm_make_core()``, which returns ``forward`` (HF's
    attention forward, unwrapped, of Llama's layout) cut to what lies between the q, k, v input and the
    output projection: the five input statements become ``query_states, key_states, value_states =
    _fuselm_qkv`` (a new keyword-only parameter) and the forward returns ``(attn_output, attn_weights)``
    before ``o_proj``; or why it cannot be cut so (its forward must end with ``attn_output =
    self.o_proj(attn_output)`` and ``return attn_output, attn_weights``)."""
    fn = _forward_tree(forward)
    if isinstance(fn, str):
        return fn
    i = _llama_input_at(fn)
    if i is None:
        return "its forward does not begin with Llama's q, k, v and RoPE statements"
    if [ast.dump(s) for s in fn.body[-2:]] != _statements(_CORE_TAIL):
        return "its forward does not end with Llama's output projection and return"
    fn.body[-2:] = fn.body[-1:]
    fn.body[i : i + len(_statements(_INPUT))] = ast.parse(_CORE_INPUT).body
    fn.args.kwonlyargs.append(ast.arg(arg="_fuselm_qkv"))
    fn.args.kw_defaults.append(ast.Constant(value=None))
    return _module_of(fn, "def _fuselm_make_core():\n    return forward\n")


def _attention_core(forward: Callable, rewrap: Callable, spec: FamilySpec) -> Callable | None:
    """HF's attention forward cut at the q, k, v input and the output projection
    (:func:`attention_core_source`), or None when it cannot be: what :mod:`fuselm.hf.decoder_layer`'s
    two-node layer calls between its nodes."""
    tree = attention_core_source(forward)
    if isinstance(tree, str):
        return None
    namespace: dict = {}
    origin = f"<fuselm: {forward.__qualname__} of {forward.__module__}, between q, k, v and o_proj>"
    exec(compile(tree, origin, "exec"), forward.__globals__, namespace)  # noqa: S102 - HF's own source, cut
    core = namespace["_fuselm_make_core"]()
    core.__defaults__ = forward.__defaults__
    core.__kwdefaults__ = {**(forward.__kwdefaults__ or {}), "_fuselm_qkv": None}
    core.__qualname__ = f"fuselm_{spec.attention}.core"
    core.__module__ = __name__
    return rewrap(core)


def has_attention_core(spec: FamilySpec) -> bool:
    """Can the family's attention class be cut between its q, k, v input and its o_proj
    (:func:`attention_core_source`)? Read from fuselm's forward of it (the class's own while fuselm patches
    it, else the one :func:`attention_forward` makes, and caches, from HF's). Where it cannot (Qwen 3's
    q / k norms), the two-node decoder layer is not installed."""
    cls = getattr(modeling_module(spec), spec.attention or "", None)
    if cls is None:
        return False
    forward = cls.forward
    if not hasattr(forward, "fuselm_core"):  # not class-patched: HF's own forward
        forward = attention_forward(spec, forward)
    return forward is not None and forward.fuselm_core is not None


@functools.cache
def attention_forward(spec: FamilySpec, original: Callable) -> Callable | None:
    """fuselm's forward for the family's attention class whose forward is ``original``, or None (warned
    once: the class keeps HF's forward, the RoPE still runs fuselm's kernel)."""
    split = split_checkpointing(original)
    reason = split if isinstance(split, str) else None
    made = None
    if reason is None:
        forward, _, rewrap = split
        made = fused_attention_source(forward)
        reason = made if isinstance(made, str) else None
    if reason is not None:
        warn_once(
            f"attention:{spec.model_type}",
            f"fuselm.hf: {spec.attention} keeps Hugging Face's attention forward ({reason}): its q, k, v "
            "projections and RoPE run as separate nodes (fuselm's RoPE kernel still runs)",
        )
        return None
    tree, _ = made
    module_globals = forward.__globals__
    rope_name = spec.rope

    def fused_input(attn, hidden_states, hidden_shape, cos, sin):
        return attention_input(module_globals[rope_name], attn, hidden_states, hidden_shape, cos, sin)

    namespace: dict = {}
    origin = f"<fuselm: {forward.__qualname__} of {forward.__module__}, its q, k, v and RoPE fused>"
    code = compile(tree, origin, "exec")
    exec(code, module_globals, namespace)  # noqa: S102 - HF's own source, five statements replaced
    fused = namespace["_fuselm_make_forward"](fused_input, projections_input)
    fused.__defaults__ = forward.__defaults__
    fused.__kwdefaults__ = forward.__kwdefaults__
    fused.__qualname__ = f"fuselm_{spec.attention}.forward"
    fused.__module__ = __name__
    fused = rewrap(fused)
    # the attention between its input and o_proj, for the two-node decoder layer (Llama's layout only)
    fused.fuselm_core = _attention_core(forward, rewrap, spec) if made[1] == "qkv_rotary" else None
    return fused
