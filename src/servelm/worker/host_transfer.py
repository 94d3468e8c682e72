"""A step's small copies between the host and the device, without stalling the device's stream.

On CUDA a plain copy (`torch.tensor(values, device="cuda")`, `.cpu()`, `.tolist()`, `.item()`,
`bool(tensor)`) makes the host wait for every kernel queued before it. A step that does that in
the middle of its work idles the GPU while Python builds the next inputs. So the runner's
sampling path keeps to two functions:

    host → device   to_device(values)     staged in pinned memory, copied non_blocking: the copy
                                          queues behind the kernels and the host goes on
    device → host   copy_to_host(tensor)  the step's one wait, after the sampler, of ONE tensor
                                          into which everything the host needs was packed

(The pinned staging buffers come from torch's caching host allocator, which keeps a buffer
from reuse until the copy that reads it has run.) On CPU both are plain tensor operations.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float] | Sequence[bool] | Sequence[Sequence[int]],
              dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:  # fmt: skip
    """`values` as a tensor on `device`; on CUDA without making the host wait for the stream."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def host_noise_buffer(num_rows: int, num_columns: int, device: torch.device) -> torch.Tensor:
    """An uninitialised float32 [num_rows, num_columns] host tensor to fill and send to `device`
    with `.to(device, non_blocking=True)` (pinned when the device is CUDA, so the copy is async)."""
    return torch.empty(num_rows, num_columns, dtype=torch.float32, pin_memory=device.type == "cuda")


def copy_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the host, waiting for the device once. The one device-to-host copy of a step
    (tests count its calls): pack what the host needs into one tensor before calling it."""
    if tensor.device.type != "cuda":
        return tensor.cpu()  # CPU: the tensor itself; another accelerator: a blocking copy
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()
    return host
