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
  them seed the CPU generator recurses through torch's own seeding).

`activate()` does nothing when `torch.cuda.is_available()`: the shim is never used on a
GPU, where Megatron runs as shipped. It is idempotent.
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
        return func(*args, **kwargs)


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
    torch.cuda.current_device = _stand_in(lambda: 0)
    mrandom._get_cuda_rng_state = _stand_in(_get_rng)
    mrandom._set_cuda_rng_state = _stand_in(_set_rng)
    _active = _CudaToCpu()
    _active.__enter__()
    return True


def is_active() -> bool:
    return _active is not None
