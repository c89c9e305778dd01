"""Run Megatron-core on a machine without a GPU (the CPU test tier and CPU runs).

Megatron-core hard-codes CUDA in a few hundred places: factories with
`device="cuda"` or `torch.cuda.current_device()`, `.cuda()`, `torch.cuda.synchronize`,
and the CUDA RNG state of its tensor-parallel RNG tracker. `activate()` makes those
calls work on CPU:

- a `TorchFunctionMode`, entered for the life of the process, rewrites any CUDA device
  given to a tensor factory or to `.to()` into `cpu`, makes `.cuda()` return the tensor
  itself and drops `pin_memory=True` (pinning needs a GPU driver);
- `torch.cuda.synchronize`, `current_device`, `set_device` become CPU stand-ins, and the
  CUDA RNG functions (torch's and Megatron's `_get_cuda_rng_state`/`_set_cuda_rng_state`)
  read and write the CPU generator. `torch.cuda.manual_seed(_all)` become no-ops (making
  them seed the CPU generator recurses through torch's own seeding);
- streams and events (`current_stream`, `Stream`, `stream(...)`, `Event`; the DDP
  gradient buffers order their collectives with them) become objects whose waits and
  records do nothing: on CPU every operation is synchronous;
- the MoE token dispatcher's device-to-host copy of the all-to-all split sizes
  (`moe_utils.maybe_move_tensor_to_cpu`, which converts only CUDA tensors, to numpy)
  converts CPU tensors too: `all_to_all_single` takes the sizes as a sequence;
- `tensor.type()` names a CPU tensor as its CUDA twin (`torch.cuda.BFloat16Tensor`):
  Megatron's mixed-precision and distributed optimizers sort parameters by those names
  and refuse any other.

The collectives themselves need nothing: gloo in torch 2.13 has every one Megatron's
DDP, distributed optimizer, sequence parallelism and expert all-to-all call
(`reduce_scatter_tensor`, `all_gather_into_tensor` in bf16 and fp32,
`all_to_all_single`, `ReduceOp.AVG`, coalesced calls).

`activate()` does nothing when `torch.cuda.is_available()`: the shim is never used on a
GPU, where Megatron runs as shipped. It is idempotent. `import_megatron()` (called by
`train.megatron.tree` before its import of Megatron) turns Megatron's JIT fuser off on
CPU: its fusable functions run as plain PyTorch, with nothing compiled.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_active: TorchFunctionMode | None = None
_CPU = torch.device("cpu")


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # a bare index means cuda:i


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if kwargs.get("device") is not None and _is_cuda(kwargs["device"]):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs \
                and isinstance(out, str) and out.startswith("torch.") and ".cuda." not in out:
            return "torch.cuda." + out[len("torch."):]
        return out


class _Stream:
    """A CPU stand-in for a CUDA stream or event: every wait and record is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs) -> None:
        return None

    def wait_stream(self, *args, **kwargs) -> None:
        return None

    def record_event(self, *args, **kwargs):
        return _Stream()

    def record(self, *args, **kwargs) -> None:
        return None

    def wait(self, *args, **kwargs) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _StreamContext:
    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


# Each patched name gets its own function object: torch.compile's rule table (built on
# first use) refuses one object registered under two names with different rules.
def _get_rng(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng(new_state, *args, **kwargs) -> None:
    torch.set_rng_state(new_state.cpu())


def _stand_in(fn):
    def call(*args, **kwargs):
        return fn(*args, **kwargs)

    return call


def _noop(*args, **kwargs) -> None:
    return None


def _move_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        return tensor.numpy() if as_numpy else tensor
    return tensor


def _no_compile(model=None, **kwargs):
    return model if model is not None else (lambda fn: fn)


def import_megatron() -> bool:
    """Import megatron.core with Megatron's JIT fuser off, when no GPU is available
    (call it before anything imports Megatron). Returns whether it did.

    Megatron decorates its fusable functions with `megatron.core.jit.jit_fuser`, which is
    `torch.compile` as Megatron is imported: decorating imports TorchDynamo and Inductor
    (~2 s of CPU, 40% of a rank process's start-up), and a call compiles the function
    for the CPU. Megatron's own switch, `megatron.core.jit.disable_jit_fuser()` (its
    no-op decorator), only reaches modules imported after it, and `megatron.core.jit`
    cannot be imported before the rest (its package imports all of megatron.core): so
    `torch.compile` is that no-op decorator while megatron.core is imported, and is
    restored after. On a GPU, Megatron is imported as shipped."""
    import sys

    if torch.cuda.is_available() or "megatron.core" in sys.modules:
        return False
    real = torch.compile
    torch.compile = _no_compile
    try:
        from megatron.core import jit
    finally:
        torch.compile = real
    jit.disable_jit_fuser()
    return True


def activate() -> bool:
    """Install the shim (once) when no GPU is available. Returns whether it is active."""
    global _active
    if torch.cuda.is_available():
        return False
    if _active is not None:
        return True
    import torch.cuda.random as cuda_random
    from megatron.core.tensor_parallel import random as mrandom

    for module in (torch.cuda, cuda_random):
        module.get_rng_state = _stand_in(_get_rng)
        module.set_rng_state = _stand_in(_set_rng)
        module.manual_seed = _stand_in(_noop)
        module.manual_seed_all = _stand_in(_noop)
    torch.cuda.synchronize = _stand_in(_noop)
    torch.cuda.set_device = _stand_in(_noop)
    # a device object, not the index 0: a bare index means cuda:0 wherever the mode is
    # not in effect (autograd runs custom backward functions outside it)
    torch.cuda.current_device = _stand_in(lambda: _CPU)
    torch.cuda.current_stream = _stand_in(lambda *a, **k: _Stream())
    torch.cuda.default_stream = _stand_in(lambda *a, **k: _Stream())
    torch.cuda.is_current_stream_capturing = _stand_in(lambda: False)
    torch.cuda.empty_cache = _stand_in(_noop)
    torch.cuda.Stream = _Stream
    torch.cuda.Event = _Stream
    torch.cuda.stream = _StreamContext
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    for module in (moe_utils, token_dispatcher):
        module.maybe_move_tensor_to_cpu = _move_to_cpu
    mrandom._get_cuda_rng_state = _stand_in(_get_rng)
    mrandom._set_cuda_rng_state = _stand_in(_set_rng)
    _active = _CudaToCpu()
    _active.__enter__()
    return True


def is_active() -> bool:
    return _active is not None
