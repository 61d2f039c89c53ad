"""What the CUDA caching allocator holds beyond tensors once matmuls have run (the BLAS libraries' workspaces).

``tiledmlp plan`` counts this as a fixed term on CUDA (``plan.model.CUDA_BLAS_WORKSPACE_BYTES``): a tiny model's
step is mostly this, a long-sequence step barely notices it. Needs a CUDA device.

    python benchmarks/gpu_probe.py
"""

from __future__ import annotations

import torch

MiB = 2**20


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_probe.py needs a CUDA device")
    d = torch.device("cuda")
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(64, 64, device=d, dtype=dtype, requires_grad=True)
        w = torch.randn(64, 64, device=d, dtype=dtype, requires_grad=True)
        (a @ w).sum().backward()  # forward and both backward products
        torch.cuda.synchronize()
        tensors = sum(t.numel() * t.element_size() for t in (a, w, a.grad, w.grad))
        print(f"{dtype}: allocator holds {(torch.cuda.memory_allocated() - tensors) / MiB:.1f} MiB beyond tensors")
    lin = torch.nn.Linear(64, 64).to(d)  # addmm with a bias: cuBLASLt
    lin(torch.randn(64, 64, device=d)).sum().backward()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.randn(64, 64, device=d) @ torch.randn(64, 64, device=d)
    torch.cuda.synchronize()
    print(f"a matmul on a second stream adds {(torch.cuda.memory_allocated() - before) / MiB:.1f} MiB "
          f"({torch.cuda.get_device_name()}, torch {torch.__version__})")


if __name__ == "__main__":
    main()
