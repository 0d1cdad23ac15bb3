"""Which decoder layers are Llama's pre-norm layout, read from the installed transformers' source (the syntax
tree of the layer's forward), and the wrappers transformers puts around that forward (gradient checkpointing,
keyword renames). Used by the patched decoder layer (:mod:`fuselm.hf.decoder_layer`: the two-node layer and
the fused residual, both opt-in) and by :mod:`fuselm.hf.attention`; never by the default patch.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass

# Llama's decoder layer forward, statement by statement (transformers 5.x, comments and docstring aside).
# The self_attn call (statement _ATTN_CALL) passes hidden_states and, by name, some of the forward's own
# parameters (which ones varies by family: Mixtral's passes no use_cache) and **kwargs.
_LLAMA_LAYER = """
residual = hidden_states
hidden_states = self.input_layernorm(hidden_states)
hidden_states, _ = self.self_attn(hidden_states=hidden_states)
hidden_states = residual + hidden_states
residual = hidden_states
hidden_states = self.post_attention_layernorm(hidden_states)
hidden_states = self.mlp(hidden_states)
hidden_states = residual + hidden_states
return hidden_states
"""
_ATTN_CALL = 2


@dataclass(frozen=True, eq=False)
class LayerLayout:
    """How a decoder layer forward of Llama's layout (:func:`llama_layer_layout`) takes its arguments
    and what it passes on to ``self_attn``.

    Attributes:
        params: its parameters after ``self``, positional or keyword (``hidden_states`` first).
        defaults: the defaults of those that have one.
        var_kw: the name of its ``**kwargs``, or None.
        attn_args: the parameters it passes on to ``self_attn`` by name, besides ``hidden_states``.
        attn_var_kw: it passes its ``**kwargs`` on to ``self_attn`` too.
    """

    params: tuple[str, ...]
    defaults: dict
    var_kw: str | None
    attn_args: tuple[str, ...]
    attn_var_kw: bool

    def bind(self, args: tuple, kwargs: dict) -> tuple[dict, dict]:
        """(each parameter -> its value, the other keyword arguments) of a call ``forward(self, *args,
        **kwargs)``, as Python binds them (``kwargs`` is consumed); TypeError as the forward raises."""
        if len(args) > len(self.params):
            raise TypeError(f"forward() takes {len(self.params)} arguments after self, {len(args)} given")
        named = dict(zip(self.params[: len(args)], args, strict=True))
        for name in self.params[len(args) :]:
            if name in kwargs:
                named[name] = kwargs.pop(name)
            elif name in self.defaults:
                named[name] = self.defaults[name]
            else:
                raise TypeError(f"forward() missing required argument: {name!r}")
        twice = [name for name in self.params[: len(args)] if name in kwargs]
        if twice:
            raise TypeError(f"forward() got multiple values for argument {twice[0]!r}")
        if kwargs and self.var_kw is None:
            raise TypeError(f"forward() got an unexpected keyword argument {next(iter(kwargs))!r}")
        return named, kwargs


def _attention_call(stmt: ast.stmt, params: list[str], var_kw: str | None):
    """The self_attn statement with its keywords other than hidden_states taken out, and (the
    parameters passed by name, whether **kwargs is passed); None when a keyword is anything but a
    parameter passed under its own name (``attention_mask=attention_mask``) or the forward's **kwargs."""
    if not isinstance(stmt, ast.Assign) or not isinstance(stmt.value, ast.Call):
        return None
    stmt = copy.deepcopy(stmt)
    kept, attn_args, attn_var_kw = [], [], False
    for kw in stmt.value.keywords:
        value = kw.value.id if isinstance(kw.value, ast.Name) else None
        if kw.arg == "hidden_states":
            kept.append(kw)
        elif kw.arg is None and value is not None and value == var_kw:
            attn_var_kw = True
        elif kw.arg in params[2:] and value == kw.arg:
            attn_args.append(kw.arg)
        else:
            return None
    stmt.value.keywords = kept
    return stmt, (tuple(attn_args), attn_var_kw)


def _renames_kwargs(decorator: ast.expr) -> bool:
    """Is this decorator ``deprecate_kwarg(...)`` (transformers 5.24 puts it on the layers' forward to rename
    ``past_key_values``; fuselm keeps it around its own forward: :func:`split_checkpointing`)?"""
    func = decorator.func if isinstance(decorator, ast.Call) else None
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    return name == "deprecate_kwarg"


def llama_layer_layout(forward: Callable) -> LayerLayout | str:
    """The :class:`LayerLayout` of a decoder layer ``forward`` (HF's own function, not a checkpointing
    wrapper) whose body is Llama's pre-norm layout statement for statement, or why it is not.

    Llama's layout: ``residual = hidden_states``; ``input_layernorm``; ``hidden_states, _ =
    self.self_attn(hidden_states=hidden_states, <its parameters by name>, **kwargs)``; ``residual +
    hidden_states``; ``post_attention_layernorm``; ``mlp``; ``residual + hidden_states``; return. The
    forward's signature: ``self, hidden_states``, then parameters (positional or keyword) and optionally
    ``**kwargs``; no decorator but ``deprecate_kwarg``. Compared on the syntax tree of the installed source,
    so a transformers version that changes the layer is seen when patching, not at the first wrong result.
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError) as e:
        return f"its source cannot be read ({type(e).__name__})"
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, ast.FunctionDef) or not all(map(_renames_kwargs, fn.decorator_list)):
        return "its forward is not a plain function"
    sig = fn.args
    params = [a.arg for a in sig.args]
    if sig.posonlyargs or sig.vararg or sig.kwonlyargs or params[:2] != ["self", "hidden_states"]:
        return "its forward's signature is not (self, hidden_states, <parameters>, **kwargs)"
    var_kw = sig.kwarg.arg if sig.kwarg else None
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    template = ast.parse(_LLAMA_LAYER).body
    if len(body) != len(template):
        return "its forward is not Llama's pre-norm layout"
    attn = None
    for i, (got, want) in enumerate(zip(body, template, strict=True)):
        if i == _ATTN_CALL:
            found = _attention_call(got, params, var_kw)
            if found is None:
                return "its self_attn call is not Llama's"
            got, attn = found
        if ast.dump(got) != ast.dump(want):
            return "its forward is not Llama's pre-norm layout"
    defaults = {
        name: p.default
        for name, p in inspect.signature(forward).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    return LayerLayout(tuple(params[1:]), defaults, var_kw, *attn)


def split_checkpointing(forward: Callable) -> tuple[Callable, bool, Callable] | str:
    """(HF's own forward, whether the class's forward checkpoints, ``rewrap``) of a decoder layer class's
    ``forward``; ``rewrap(fn)`` puts around ``fn`` the argument-renaming wrappers HF's forward had.

    transformers 5.23's ``GradientCheckpointingLayer`` wraps every subclass's forward in
    ``forward_with_checkpointing`` (so module hooks stay outside the checkpoint), 5.17's checkpoints in
    ``__call__`` around an unwrapped forward. 5.24 also decorates the forward with ``deprecate_kwarg``
    (``past_key_values`` renamed ``cache``) and 5.25 the attention's with ``kernels``' ``use_kernelized_func``
    (which routes the module-level rotary function to the module's own kernel): such wrappers
    (:data:`_KEPT_WRAPPERS`) are kept, around fuselm's forward too. Any other wrapper: a reason (the layer
    stays HF's)."""
    checkpoints = False
    code = getattr(forward, "__code__", None)
    if code is not None and code.co_name == "forward_with_checkpointing" and hasattr(forward, "__wrapped__"):
        forward, checkpoints = forward.__wrapped__, True
    renaming = []
    while getattr(forward, "__wrapped__", None) is not None:
        if _wrapped_cell(forward) is None:
            if getattr(getattr(forward, "__code__", None), "co_name", None) == "forward_with_checkpointing":
                return "its forward is wrapped twice"
            return f"its forward is wrapped ({getattr(forward, '__qualname__', forward)!r})"
        renaming.append(forward)
        forward = forward.__wrapped__

    def rewrap(fn: Callable) -> Callable:
        for wrapper in reversed(renaming):
            fn = _with_wrapped(wrapper, fn)
        return fn

    return forward, checkpoints, rewrap


# wrappers HF puts around forwards that fuselm keeps around its own: (file, function name, the closure
# cell holding the wrapped function). transformers' deprecate_kwarg renames or warns about keyword
# arguments; kernels' use_kernelized_func routes module-level functions to the module's own kernels.
_KEPT_WRAPPERS = (
    ("transformers/utils/deprecation.py", "wrapped_func", "func"),
    ("kernels/_internals/layer/layer.py", "new_forward", "orig_forward"),
)


def _wrapped_cell(fn: Callable) -> str | None:
    """The closure cell of ``fn`` holding the function it wraps, when ``fn`` is one of the wrappers fuselm
    keeps (:data:`_KEPT_WRAPPERS`); else None."""
    code = getattr(fn, "__code__", None)
    if code is None or fn.__closure__ is None:
        return None
    path = code.co_filename.replace("\\", "/")
    for file, name, cell in _KEPT_WRAPPERS:
        if code.co_name == name and path.endswith(file) and cell in code.co_freevars:
            return cell
    return None


def _with_wrapped(wrapper: Callable, fn: Callable) -> Callable:
    """A copy of a kept wrapper (:data:`_KEPT_WRAPPERS`) that calls ``fn`` instead of the function it
    wrapped (the same code and settings, that one cell replaced)."""
    cells = list(wrapper.__closure__)
    cells[wrapper.__code__.co_freevars.index(_wrapped_cell(wrapper))] = types.CellType(fn)
    copy_ = types.FunctionType(
        wrapper.__code__, wrapper.__globals__, wrapper.__name__, wrapper.__defaults__, tuple(cells)
    )
    copy_.__kwdefaults__ = wrapper.__kwdefaults__
    return functools.update_wrapper(copy_, fn)
