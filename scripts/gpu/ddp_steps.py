"""Where a DDP step's time goes, step by step: the model and steps of the workload ddp_gpt2.py
(copied here), each step synchronized and timed alone, with the allocator's maps and unmaps in it
(`memory_stats()`'s `num_device_alloc`, `num_device_free`: segments, or maps under expandable
segments). It found the drains of issue 27 (BENCHMARKS.md, "DDP: recycling without a wait").

Run (2 GPUs):  LABEL=L [STEPS=60] torchrun --nproc_per_node=2 scripts/gpu/ddp_steps.py
               (natively, or with LD_PRELOAD=libcachealloc.so)
Rank 0 prints, per sequence length, the median and minimum step ms, then one line with the
whole's total, maps, unmaps and the first steps that called the device (`length:ms:maps/unmaps`).
The per-step synchronization changes the timing against ddp_gpt2.py's: compare these lines
between configurations, not with ddp.sh's."""
import os, time, statistics, torch, torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging
logging.set_verbosity_error()
dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(rank)
torch.manual_seed(0)
cfg = GPT2Config(n_layer=6, n_embd=768, n_head=12, vocab_size=32000, n_positions=1024, bos_token_id=0, eos_token_id=0)
model = torch.nn.parallel.DistributedDataParallel(GPT2LMHeadModel(cfg).cuda(), device_ids=[rank])
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
LENS = [128, 512, 256, 1024, 384]
gen = torch.Generator(device="cuda").manual_seed(rank)
def step(i):
    ids = torch.randint(0, 32000, (8, LENS[i % len(LENS)]), device="cuda", generator=gen)
    out = model(input_ids=ids, labels=ids)
    opt.zero_grad(set_to_none=True)
    out.loss.backward()
    opt.step()
    return out.loss
def counts():
    s = torch.cuda.memory_stats()
    return s.get("num_device_alloc", 0), s.get("num_device_free", 0)
for i in range(5):
    step(i)
torch.cuda.synchronize(); dist.barrier()
per = {}
rows = []
for i in range(int(os.environ.get("STEPS", "60"))):
    a0, f0 = counts()
    t = time.perf_counter(); step(i); torch.cuda.synchronize()
    dt = (time.perf_counter() - t) * 1e3
    a1, f1 = counts()
    rows.append((LENS[i % 5], dt, a1 - a0, f1 - f0))
if rank == 0:
    lab = os.environ.get("LABEL", "-")
    for L in LENS:
        xs = [r[1] for r in rows if r[0] == L]
        print(f"steps label={lab} len={L} median_ms={statistics.median(xs):.3f} min_ms={min(xs):.3f}")
    busy = [r for r in rows if r[2] or r[3]]
    print(f"steps label={lab} total_ms={sum(r[1] for r in rows):.1f} maps={sum(r[2] for r in rows)} unmaps={sum(r[3] for r in rows)} "
          f"steps_with_driver={len(busy)} " + " ".join(f"{r[0]}:{r[1]:.2f}:{r[2]}/{r[3]}" for r in busy[:12]))
dist.destroy_process_group()
