#!/usr/bin/env python3
"""Trains Kestrel's built-in model: a small Qwen3-MoE (4 layers, 8 experts, top-2, hidden 256,
tied embeddings; about 8 M parameters, 16 MB in bf16) on the documentation strings of the
Python standard library, which the script gathers itself by parsing the library's sources.

    python3 scripts/train-builtin-model.py OUT_DIR [--tokenizer DIR] [--steps N]
    # needs torch (a CUDA GPU: a few minutes on an H200), transformers, safetensors

Half of the training text is the docstrings as they are (separated by <|endoftext|>); the other
half is the same docstrings as one-turn chats in the tokenizer's ChatML template, the question
naming the documented object ("What does json.dumps do?") and the answer being its docstring, so
`kestrel run -p "What does os.path.join do?"` answers in the domain's style. Five percent of the
objects (chosen by a hash of their name) are held out; the checkpoint with the lowest held-out
loss is kept.

OUT_DIR receives what every Kestrel path loads: config.json and model.safetensors written by
`save_pretrained` (bf16), generation_config.json, the tokenizer files (from --tokenizer, default
the one `scripts/train-tokenizer.py` wrote for the tests), RECIPE.md with the settings, the
data, the losses and sample answers, and transformers-greedy.json with those answers' token ids
(transformers' greedy decoding of three prompts), which Kestrel's tests reproduce.
"""
import argparse
import importlib.util
import json
import math
import os
import shutil
import sys
import time
import zlib

import torch
import transformers
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TOKENIZER = os.path.join(HERE, "..", "crates", "kestrel-text", "tests", "tokenizer")


def documented():
    """The standard library's (qualified name, docstring) pairs, gathered as the tokenizer's
    training text is (scripts/train-tokenizer.py)."""
    spec = importlib.util.spec_from_file_location("train_tokenizer", os.path.join(HERE, "train-tokenizer.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.documented()


def held_out(name):
    return zlib.crc32(name.encode()) % 20 == 0


def chat(name, doc):
    return f"<|im_start|>user\nWhat does {name} do?<|im_end|>\n<|im_start|>assistant\n{doc}<|im_end|>\n"


def stream(tok, items):
    """One long id sequence: each document followed by <|endoftext|>."""
    eot = tok.token_to_id("<|endoftext|>")
    ids = []
    for text in items:
        ids.extend(tok.encode(text).ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokenizer", default=DEFAULT_TOKENIZER)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.time()

    tok = Tokenizer.from_file(os.path.join(a.tokenizer, "tokenizer.json"))
    docs = documented()
    train = [(n, d) for n, d in docs if not held_out(n)]
    val = [(n, d) for n, d in docs if held_out(n)]
    texts = lambda part: [d for _, d in part] + [chat(n, d) for n, d in part]
    train_ids, val_ids = stream(tok, texts(train)), stream(tok, texts(val))
    print(f"Python {sys.version.split()[0]}: {len(docs)} docstrings ({len(train)} train, {len(val)} held out); "
          f"{len(train_ids)} train tokens, {len(val_ids)} held-out tokens")

    vocab = tok.get_vocab_size()
    config = Qwen3MoeConfig(
        vocab_size=(vocab + 63) // 64 * 64, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
        rope_theta=10000.0, rms_norm_eps=1e-6, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=256, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=True, output_router_logits=True, router_aux_loss_coef=0.01,
        bos_token_id=None, eos_token_id=tok.token_to_id("<|im_end|>"), pad_token_id=tok.token_to_id("<|endoftext|>"),
    )
    model = AutoModelForCausalLM.from_config(config).to(device)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, a.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / a.steps)))))

    def batch(ids, n):
        starts = torch.randint(0, len(ids) - a.seq - 1, (n,))
        x = torch.stack([ids[s:s + a.seq] for s in starts]).to(device)
        return x

    @torch.no_grad()
    def val_loss():
        model.eval()
        losses = []
        for s in range(0, len(val_ids) - a.seq - 1, a.seq):
            x = val_ids[s:s + a.seq].unsqueeze(0).to(device)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                # The language-model loss alone (no router balance term).
                losses.append(model(input_ids=x, labels=x, output_router_logits=False).loss.float().item())
        model.train()
        return sum(losses) / len(losses)

    best, best_step, log = float("inf"), 0, []
    best_state = None
    model.train()
    for step in range(a.steps + 1):
        if step % 50 == 0 or step == a.steps:
            v = val_loss()
            log.append((step, v))
            print(f"step {step}: held-out loss {v:.4f}")
            if v < best:
                best, best_step = v, step
                best_state = {k: t.detach().clone() for k, t in model.state_dict().items()}
        if step == a.steps:
            break
        x = batch(train_ids, a.batch)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            out = model(input_ids=x, labels=x)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    model.load_state_dict(best_state)
    model.config.output_router_logits = False
    model = model.to(torch.bfloat16)
    os.makedirs(a.out, exist_ok=True)
    model.save_pretrained(a.out, safe_serialization=True)
    generation = {"eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")],
                  "pad_token_id": tok.token_to_id("<|endoftext|>"), "do_sample": True,
                  "temperature": 0.7, "top_k": 40, "top_p": 0.95}
    with open(os.path.join(a.out, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2)
        f.write("\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(a.tokenizer, name), os.path.join(a.out, name))

    # Greedy answers for the recipe, and their ids as the reference Kestrel's CI compares with
    # (the bf16 weights as saved, computed in f32).
    model = model.float().eval()
    samples, reference = [], []
    for q in ["What does json.dumps do?", "What does os.path.join do?", "What does collections.Counter do?"]:
        prompt = f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
        x = torch.tensor([tok.encode(prompt).ids], device=device)
        with torch.no_grad():
            y = model.generate(x, max_new_tokens=60, do_sample=False, eos_token_id=generation["eos_token_id"])
        ids = y[0, x.shape[1]:].tolist()
        samples.append((q, tok.decode(ids, skip_special_tokens=True)))
        reference.append({"prompt": q, "prompt_ids": x[0].tolist(), "generated_ids": ids})
    with open(os.path.join(a.out, "transformers-greedy.json"), "w") as f:
        json.dump(reference, f, indent=1)
        f.write("\n")

    size = sum(os.path.getsize(os.path.join(a.out, f)) for f in os.listdir(a.out))
    with open(os.path.join(a.out, "RECIPE.md"), "w") as f:
        f.write("# kestrel-tiny: how it was made\n\n")
        f.write(f"Made by `scripts/train-builtin-model.py {' '.join(sys.argv[1:])}` on {device} "
                f"({torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}), torch {torch.__version__}, "
                f"transformers {transformers.__version__}, Python {sys.version.split()[0]}, "
                f"{time.time() - started:.0f} s.\n\n")
        f.write(f"- Data: {len(docs)} docstrings of the Python standard library's sources; {len(train)} for training, "
                f"{len(val)} held out (crc32 of the name mod 20 == 0); each as plain text and as a one-turn chat "
                f"(\"What does NAME do?\" → the docstring); {len(train_ids)} training tokens, {len(val_ids)} held out.\n")
        f.write(f"- Model: Qwen3-MoE, {params} parameters (hidden 256, 4 layers, 4 query / 2 KV heads of 64, "
                f"8 experts of width 256, top-2, tied embeddings), vocabulary {config.vocab_size} "
                f"(tokenizer: {vocab}); {size / 2**20:.1f} MiB on disk.\n")
        f.write(f"- Training: {a.steps} steps of {a.batch} x {a.seq} tokens, AdamW (lr {a.lr}, betas 0.9/0.95, "
                f"weight decay 0.1), warm-up then cosine to a tenth, bf16 autocast, router balance loss 0.01, "
                f"seed {a.seed}.\n")
        f.write(f"- **Held-out loss of the kept checkpoint: {best:.4f}** (step {best_step}; "
                f"perplexity {math.exp(best):.1f}).\n\n")
        f.write("| step | held-out loss |\n| --- | --- |\n")
        for s, v in log:
            f.write(f"| {s} | {v:.4f} |\n")
        f.write("\nGreedy answers (transformers):\n\n")
        for q, ans in samples:
            f.write(f"- {q}\n\n  > {ans.strip().replace(chr(10), ' ')}\n\n")
    print(f"kept step {best_step}, held-out loss {best:.4f}; {size / 2**20:.1f} MiB in {a.out}")


if __name__ == "__main__":
    main()
