"""Device, dtype and compile-backend choice: ``cpu``, ``cuda`` or ``neuron``, picked by config.

TorchNeuron (Neuron 2.33+, Trn2/Trn3) registers Trainium as PyTorch's PrivateUse1 device named
``neuron`` and is autoloaded by torch when installed, so the Neuron path is the ordinary one with
``device="neuron"`` and ``torch.compile(backend="neuron")``; it needs the static shapes the engine
keeps everywhere. Nothing here imports a vendor package.
"""

from __future__ import annotations

import torch

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}  # fmt: skip


def accelerator_type() -> str | None:
    """The available accelerator's device type ("cuda", "neuron", ...), or None on a plain CPU."""
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator().type
    return None


def resolve_device(name: str = "auto") -> torch.device:
    """"auto" takes the accelerator if there is one, else the CPU; a named device must exist."""
    if name == "auto":
        return torch.device(accelerator_type() or "cpu")
    if name not in ("cpu", "cuda", "neuron"):
        raise ValueError(f"device={name!r} is not one of auto, cpu, cuda, neuron")
    if name != "cpu" and accelerator_type() != name:
        raise RuntimeError(
            f"device={name!r} was asked for but this machine has {accelerator_type() or 'no accelerator'}; "
            "use device=cpu (or auto)"
        )
    return torch.device(name)


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype={name!r} is not one of {sorted(set(DTYPES))}") from None


def compile_backend(device: torch.device) -> str:
    """The torch.compile backend for a device: Neuron has its own; CPU and CUDA use inductor."""
    return "neuron" if device.type == "neuron" else "inductor"


def synchronize(device: torch.device) -> None:
    """Wait for queued work, so host timers measure it (CPU work is already synchronous)."""
    if device.type != "cpu":
        torch.accelerator.synchronize()


def release_host_memory() -> None:
    """Hand memory freed on the host back to the OS: collect garbage cycles (a dropped engine or
    model copy often sits in one), then glibc's ``malloc_trim``. PyTorch's CPU allocations below
    glibc's mmap threshold come from malloc arenas, which keep freed pages resident; after an
    evaluation or a model conversion that is a gigabyte or more that the next phase cannot use.
    Elsewhere than glibc it only collects."""
    import gc

    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _libc():
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def steady_host_allocator(mmap_threshold: int = 1 << 20) -> bool:
    """Serve every host allocation of at least ``mmap_threshold`` bytes with its own mapping, which
    goes back to the OS when freed. glibc raises its threshold each time such a block is freed (up
    to 32 MB), after which large tensors come from malloc's heap and stay resident as fragments:
    train-draft alternates training steps with engine evaluations, and with the dynamic threshold
    its resident memory crept up at every step; fixed at 1 MiB it stays flat (the measurements:
    docs/experiments/main-job.md). Costs a page fault per fresh page of a large tensor. Returns
    whether it applied (glibc only)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, int(mmap_threshold)))


def _cpuinfo_field(key: str) -> str | None:
    """The first ``key : value`` line of /proc/cpuinfo (None where there is none to read)."""
    from pathlib import Path

    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith(key)), None)


def cpu_flags() -> set[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (avx2, avx512_vnni, amx_int8, ...);
    empty where there is none to read."""
    return set((_cpuinfo_field("flags") or "").split())


def describe_machine(with_threads: bool = False) -> str:
    """The CPU model, its vector extensions that change the kernels' speed, cores and torch: what
    a benchmark record names as its machine (``with_threads``: and torch's thread count, which a
    timed script's numbers depend on)."""
    import os
    import platform

    name, flags = _cpuinfo_field("model name") or platform.processor() or "unknown CPU", cpu_flags()
    isa = ", ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "amx_tile") if f in flags) or "no AVX2"
    line = f"{name} ({isa}), {os.cpu_count()} cores, torch {torch.__version__}"
    return f"{line}, {torch.get_num_threads()} threads" if with_threads else line
