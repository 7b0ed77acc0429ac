"""Peer access to pooled memory from PyTorch (2 GPUs): a copy between devices that needs a
kernel (a transposed source) runs on one device and reads or writes the other's memory
directly once PyTorch has enabled peer access, which memory mapped for expandable segments
allows only to the devices given access (backend/vmm.rs, Note [Peer access to mapped
memory]). Both directions, checked against the host's copy. Prints "OK peer_access.py", or
"OK peer_access.py (skipped ...)" without two devices that can reach each other."""
import torch

if torch.cuda.device_count() < 2 or not torch.cuda.can_device_access_peer(0, 1):
    print("OK peer_access.py (skipped: needs two GPUs with peer access)")
    raise SystemExit(0)
torch.manual_seed(0)
for src, dst in ((0, 1), (1, 0)):
    a = torch.randn(4096, 3000, device=f"cuda:{src}")
    b = a.t().to(f"cuda:{dst}")  # not contiguous: a kernel, across the devices
    c = torch.empty(3000, 4096, device=f"cuda:{dst}", dtype=torch.float16)
    c.copy_(a.t())  # a cast as well
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)
    host = a.t().cpu()
    assert torch.equal(b.cpu(), host), f"{src}->{dst}: wrong bytes"
    assert torch.equal(c.cpu(), host.half()), f"{src}->{dst}: wrong bytes (cast)"
print("OK peer_access.py")
