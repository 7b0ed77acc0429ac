"""A transformers GPT-2 (2 layers, random init, fixed seed) trained eagerly, then with its
forward compiled by Inductor, then with a compiled-autograd backward: what a user's training
script does with torch.compile, where Dynamo runs PyTorch's module code (and, under the shim,
the category hooks' wrapper of it). Prints one line: the losses and the parameters' sum, equal
natively and under the shim (scripts/gpu/check.sh compares them). Runs on the GPU if there is
one, else on the CPU.

    python3 scripts/gpu/compiled_model.py
"""
import torch
import transformers

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
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
