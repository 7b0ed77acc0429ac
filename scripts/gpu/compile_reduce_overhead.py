"""torch.compile(mode="reduce-overhead") on a real transformers model: a 6-layer GPT-2 (random
weights, fp16, inference, batch 8 x 128 tokens), the workload of issue 22's table.

TREES=0 turns Inductor's CUDA graph trees off (what the shim's Python integration does), to
compare with PyTorch's allocator on the same graphs. Checks that the compiled (CUDA-graphed) model's logits equal eager's, then times CALLS calls
with CUDA events and prints one line:
    workload=compile_gpt2 label=L step_ms=X peak_reserved_mb=R peak_allocated_mb=A max_err=E ok=B
(`step_ms` is the median time per call over ROUNDS rounds of CALLS calls; the same seed in every
process, so `checksum` must agree between native and shim runs.)"""
import os
import statistics
import warnings

import torch

warnings.simplefilter("ignore")
label = os.environ.get("LABEL", "-")
rounds = int(os.environ.get("ROUNDS", "20"))
calls = int(os.environ.get("CALLS", "50"))
# TREES=0: Inductor records its CUDA graphs without graph trees, as it does under the shim.
trees = os.environ.get("TREES", "1") != "0"


def main():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=6, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)
    model = GPT2LMHeadModel(config).cuda().half().eval()
    ids = torch.randint(0, config.vocab_size, (8, 128), device="cuda")
    if not trees:
        from torch._inductor import config as inductor_config

        inductor_config.triton.cudagraph_trees = False
    compiled = torch.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        eager = model(ids).logits.float()
        for _ in range(5):  # warm-up: compile, record the graph, replay
            out = compiled(ids).logits
        torch.cuda.synchronize()
        err = (out.float() - eager).abs().max().item()
        checksum = out.float().sum().item()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                out = compiled(ids).logits
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
    ok = err < 5e-2
    print(
        f"workload=compile_gpt2 label={label} step_ms={statistics.median(times):.4f} "
        f"peak_reserved_mb={torch.cuda.max_memory_reserved() / 2**20:.0f} "
        f"peak_allocated_mb={torch.cuda.max_memory_allocated() / 2**20:.0f} "
        f"max_err={err:.2e} checksum={checksum:.4f} ok={ok}",
        flush=True,
    )


if __name__ == "__main__":
    main()
