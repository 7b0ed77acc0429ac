"""A transformers GPT-2 (2 layers, random init, fixed seed) trained eagerly, then with its
forward compiled by Inductor, then with a compiled-autograd backward: what a user's training
script does with torch.compile, where Dynamo runs PyTorch's module code (and, under the shim,
the category hooks' wrapper of it). Prints one line: the losses and the parameters' sum, equal
natively and under the shim up to the GPU's nondeterministic reductions (scripts/gpu/check.sh
compares them with `--compare`). Runs on the GPU if there is one, else on the CPU.

    python3 scripts/gpu/compiled_model.py --compare "NATIVE LINE" "SHIM LINE"

    python3 scripts/gpu/compiled_model.py
"""
import re
import sys

if sys.argv[1:2] == ["--compare"]:
    # Losses within 1e-3 and parameter sums within 1e-2: far tighter than a wrong allocation
    # would leave them, looser than atomics' reordering in attention's backward.
    def numbers(line):
        m = re.search(r"losses=\[(.*)\] param_sum=(\S+)", line)
        if not m:
            sys.exit(f"no compiled_model line: {line!r}")
        return [float(x) for x in m.group(1).split(",")], float(m.group(2))

    (a, sa), (b, sb) = numbers(sys.argv[2]), numbers(sys.argv[3])
    same = len(a) == len(b) and all(abs(x - y) <= 1e-3 for x, y in zip(a, b))
    sys.exit(0 if same and abs(sa - sb) <= 1e-2 else 1)

import torch
import transformers

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
# "gelu", not GPT-2's "gelu_new": torch 2.11's compiled autograd fails on gelu_new's backward on
# CUDA natively ("aten::_local_scalar_dense() Expected a value of type 'Tensor' ... found type
# 'float'", H200, transformers 5.17), which is PyTorch's bug, not what this script checks.
config = transformers.GPT2Config(
    n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, activation_function="gelu",
    bos_token_id=0, eos_token_id=0,
)
model = transformers.GPT2LMHeadModel(config).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 256, (2, 32), device=device)


def step(forward, backward):
    loss = forward(ids, labels=ids).loss
    opt.zero_grad()
    backward(loss)
    opt.step()
    return round(loss.item(), 5)


losses = [step(model, torch.Tensor.backward) for _ in range(3)]
compiled = torch.compile(model)
losses += [step(compiled, torch.Tensor.backward) for _ in range(2)]
torch._dynamo.config.compiled_autograd = True


@torch.compile
def compiled_backward(loss):
    loss.backward()


losses += [step(model, compiled_backward) for _ in range(2)]
total = sum(p.double().sum().item() for p in model.parameters())
print(f"compiled_model device={device} losses={losses} param_sum={total:.3f}")
