"""Variable-batch fp16 inference: the GPT-2 of gpt2_train.py (6 layers, random init) serving a
stream of requests whose batch size and sequence length change every time (160 requests drawn
from 1..48 × 32..1024 with a fixed seed), the way a server sees traffic. Activations of every
shape come and go, which fragments a caching allocator's fixed segments. Prints one line:
workload=infer label=… step_ms (per request) checksum torch_max_reserved_MB torch_max_alloc_MB."""
import os, random, time, torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging

logging.set_verbosity_error()
torch.manual_seed(0)
cfg = GPT2Config(n_layer=6, n_embd=768, n_head=12, vocab_size=32000, n_positions=1024,
                 bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(cfg).cuda().half().eval()
rng = random.Random(0)
SHAPES = [(rng.randint(1, 48), rng.choice(range(32, 1025, 32))) for _ in range(160)]


@torch.no_grad()
def serve(batch, length):
    ids = torch.randint(0, 32000, (batch, length), device="cuda")
    logits = model(input_ids=ids).logits
    return logits[:, -1].float().softmax(-1).max(-1).values.sum()


for b, l in SHAPES[:8]:
    serve(b, l)
torch.cuda.synchronize()
t = time.perf_counter()
checksum = 0.0
for b, l in SHAPES:
    checksum += serve(b, l).item()
torch.cuda.synchronize()
dt = time.perf_counter() - t
print(f"workload=infer label={os.environ.get('LABEL', '-')} step_ms={dt / len(SHAPES) * 1e3:.3f} "
      f"loss={checksum:.6f} torch_max_reserved_MB={torch.cuda.max_memory_reserved() / 1e6:.1f} "
      f"torch_max_alloc_MB={torch.cuda.max_memory_allocated() / 1e6:.1f}")
