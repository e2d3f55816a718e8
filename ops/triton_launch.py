"""Kernel launches with less host time than `JITFunction.run`.

At small shapes an eager GLA fwd+bwd is a dozen or more launches that the GPU finishes faster than the host
issues them, so the host time of each launch is the op's time. `JITFunction.run` binds and specialises the
arguments, builds the compiled-kernel cache key from them and the options, checks globals and then
launches; `launch` keys the compiled kernel by what the specialisation depends on (each tensor's dtype
and 16-byte alignment, each int's width, == 1 and divisibility by 16, the constexpr keywords and launch
options, the device) and launches it directly (`CompiledKernel[grid]`). The first launch of each key goes
through `JITFunction.run`, which compiles and returns the kernel kept here. Anything this path does not
handle (the CPU interpreter, a constexpr passed by position, a parameter left to its default, an argument
of another type) always takes `JITFunction.run`.
"""
from __future__ import annotations

import functools
import inspect
import typing

import torch

ENABLED = True  # the test seam: tests compare launches through JITFunction.run with this path
_KERNELS: dict = {}  # key -> (compiled kernel, constexpr names in parameter order), or None: JITFunction.run
_MISS = object()
_SLOW = object()  # an argument type this path does not key: never cached
_I32 = 2 ** 31


_CUDA: list = []


def _device() -> int:
    """The current CUDA device (-1 without CUDA: the interpreter), which the launch goes to."""
    if not _CUDA:
        _CUDA.append(torch.cuda.is_available())
    return torch.cuda.current_device() if _CUDA[0] else -1


def on_input_device(fn):
    """Run `fn` with the current CUDA device set to that of its first argument (a tensor). Triton launches
    on the current device and on its current stream: a model loaded on cuda:1 while the process's
    current device is cuda:0 (`--device cuda:1`, lm-eval's one-model-per-GPU runs) would otherwise launch
    its kernels on cuda:0 with pointers into cuda:1's memory. Costs one device query when they agree."""
    @functools.wraps(fn)
    def guarded(x, *args, **kw):
        if x.is_cuda and x.device.index != torch.cuda.current_device():
            with torch.cuda.device(x.device):
                return fn(x, *args, **kw)
        return fn(x, *args, **kw)
    # torch.library.custom_op reads the schema from the signature, evaluating string annotations in the
    # function's module: give the wrapper fn's signature with the annotations already resolved there
    hints = typing.get_type_hints(fn)
    sig = inspect.signature(fn)
    guarded.__signature__ = sig.replace(
        parameters=[p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values()],
        return_annotation=hints.get("return", sig.return_annotation))
    return guarded


def _spec(x):
    t = type(x)
    if t is torch.Tensor:
        return x.dtype, x.data_ptr() % 16 == 0
    if t is int:
        return x == 1, x % 16 == 0, -_I32 <= x < _I32, x >= 0
    if t is float or t is bool or x is None:
        return t
    return _SLOW


def _prepare(kernel, compiled, n_args: int, kw: dict):
    """(compiled kernel, names of the keyword arguments in parameter order), or None where the fast path
    does not apply (nothing compiled was returned: the interpreter; constexprs by position; defaults)."""
    if compiled is None or not hasattr(compiled, "function") or getattr(kernel, "pre_run_hooks", None):
        return None
    names = list(getattr(kernel, "arg_names", ()))[n_args:]
    constexprs = set(getattr(kernel, "constexprs", ()))
    if any(i in constexprs for i in range(n_args)) or any(n not in kw for n in names):
        return None
    return compiled, names


def launch(kernel, grid: tuple, *args, **kw) -> None:
    """kernel[grid](*args, **kw): runtime arguments by position, constexprs and launch options by
    keyword, as every launch of `ops.triton_linear_attn` passes them."""
    if not ENABLED:
        kernel[grid](*args, **kw)
        return
    specs = tuple(map(_spec, args))
    if _SLOW in specs:
        kernel[grid](*args, **kw)
        return
    key = (kernel, _device(), specs, tuple(kw.items()))
    try:
        hit = _KERNELS.get(key, _MISS)
    except TypeError:  # an unhashable keyword value
        kernel[grid](*args, **kw)
        return
    if hit is _MISS:
        _KERNELS[key] = _prepare(kernel, kernel[grid](*args, **kw), len(args), kw)
        return
    if hit is None:
        kernel[grid](*args, **kw)
        return
    compiled, names = hit
    g = tuple(grid) + (1,) * (3 - len(grid))
    compiled[g](*args, *[kw[n] for n in names])
