"""ops.triton_launch: the cached launch path keys compiled kernels by everything Triton specialises on, and
passes the arguments in the kernel's parameter order. A stand-in kernel records what each launch sent
where (CPU, no Triton needed); tests/test_kernels_gpu.py checks real launches bit for bit."""
import torch

from ops import triton_launch as TL


class _Compiled:
    function = object()  # what a CompiledKernel has and the interpreter's result lacks

    def __init__(self, calls):
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *args: self.calls.append(("fast", grid, args))


class _Kernel:
    """Parameters (x, n, BLOCK: constexpr, FLAG: constexpr), like a @triton.jit function."""
    arg_names = ["x", "n", "BLOCK", "FLAG"]
    constexprs = [2, 3]
    pre_run_hooks = []

    def __init__(self, compiled=True):
        self.calls = []
        self.compiled = compiled

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.calls.append(("jit", grid, args, kw))
            return _Compiled(self.calls) if self.compiled else None
        return run


def _launch(k, x, n, **kw):
    TL.launch(k, (2, 3), x, n, BLOCK=kw.get("BLOCK", 16), FLAG=kw.get("FLAG", True), num_warps=4)


def test_second_launch_of_a_key_skips_the_jit_with_arguments_in_parameter_order():
    TL._KERNELS.clear()
    k = _Kernel()
    x = torch.zeros(64)
    _launch(k, x, 5)
    _launch(k, x, 7)  # same width, not 1, not a multiple of 16: the same specialisation
    assert [c[0] for c in k.calls] == ["jit", "fast"]
    assert k.calls[1] == ("fast", (2, 3, 1), (x, 7, 16, True))


def test_every_specialisation_change_takes_the_jit():
    TL._KERNELS.clear()
    k = _Kernel()
    x = torch.zeros(64)
    _launch(k, x, 5)
    _launch(k, x[1:], 5)        # 4-byte offset: not 16-byte aligned
    _launch(k, x.double(), 5)   # dtype
    _launch(k, x, 32)           # divisible by 16
    _launch(k, x, 1)            # == 1
    _launch(k, x, 2 ** 40)      # 64-bit
    _launch(k, x, 5, BLOCK=32)  # constexpr value
    _launch(k, x, 5, FLAG=False)
    assert [c[0] for c in k.calls] == ["jit"] * 8
    for args in [(x[1:], 5), (x.double(), 5), (x, 32), (x, 1), (x, 2 ** 40)]:
        _launch(k, *args)
    assert [c[0] for c in k.calls[8:]] == ["fast"] * 5


def test_the_interpreter_and_unkeyed_arguments_always_take_the_jit():
    TL._KERNELS.clear()
    k = _Kernel(compiled=False)  # the interpreter returns no compiled kernel
    x = torch.zeros(64)
    for _ in range(3):
        _launch(k, x, 5)
    k2 = _Kernel()
    for _ in range(3):
        TL.launch(k2, (1,), x, "not keyed", BLOCK=16, FLAG=True)
    k3 = _Kernel()
    for _ in range(3):  # a constexpr by position
        TL.launch(k3, (1,), x, 5, 16, FLAG=True)
    assert {c[0] for c in k.calls + k2.calls + k3.calls} == {"jit"}
    assert len(k.calls) == len(k2.calls) == len(k3.calls) == 3


def test_disabled_path_always_takes_the_jit():
    TL._KERNELS.clear()
    k = _Kernel()
    x = torch.zeros(64)
    TL.ENABLED = False
    try:
        for _ in range(3):
            _launch(k, x, 5)
    finally:
        TL.ENABLED = True
    assert [c[0] for c in k.calls] == ["jit"] * 3


class _CudaStandIn:
    """What the guard reads of a CUDA tensor: is_cuda and its device."""
    is_cuda = True

    def __init__(self, index):
        self.device = torch.device("cuda", index)


def test_ops_run_on_their_inputs_device_not_the_current_one(monkeypatch):
    """Triton launches on the current device: an op given tensors on cuda:1 while cuda:0 is current must
    switch to cuda:1 for its launches and back afterwards, and not touch the device when they agree."""
    current = [0]
    switches = []

    class _Device:
        def __init__(self, device):
            self.index = device.index

        def __enter__(self):
            switches.append(self.index)
            self.before, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.before

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", _Device)

    @TL.on_input_device
    def op(x: torch.Tensor, n: int) -> int:
        return current[0] * 10 + n

    assert op(_CudaStandIn(1), 3) == 13 and current[0] == 0 and switches == [1]
    assert op(_CudaStandIn(0), 4) == 4 and switches == [1]        # already current: no switch
    assert op(torch.zeros(1), 5) == 5 and switches == [1]         # a CPU tensor (the interpreter): none
    # the schema torch.library.custom_op reads: the op's own parameters with their annotations resolved
    import inspect
    params = inspect.signature(op).parameters
    assert list(params) == ["x", "n"] and params["x"].annotation is torch.Tensor and params["n"].annotation is int
