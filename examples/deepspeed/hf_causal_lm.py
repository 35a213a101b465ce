"""A DeepSpeed script fine-tuning a Hugging Face causal LM: no-weight-decay parameter
groups, a torch optimizer built by the script, DeepSpeed's WarmupDecayLR scheduler built on
it, both handed to `initialize` (the pattern of many DeepSpeed fine-tuning scripts). Run
on fsdpx by changing one line: `import deepspeed` -> `import fsdpx.deepspeed as deepspeed`.

The model is a tiny Llama built from a config (nothing is downloaded), the text random
tokens with a learnable pattern. Needs `pip install 'fsdpx[hf]'` (a clone's
scripts/setup.sh installs it).

Launch, from the repository root:

    torchrun --standalone --nproc_per_node=2 examples/deepspeed/hf_causal_lm.py
    python examples/deepspeed/hf_causal_lm.py          # one rank

Options: --steps N (default 8), --out DIR (save_16bit_model writes there).
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fsdpx.deepspeed as deepspeed  # was: import deepspeed
from fsdpx.deepspeed.runtime.lr_schedules import WarmupDecayLR  # was: deepspeed.runtime...

DS_CONFIG = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3},
    "steps_per_print": 2,
}


def batches(steps, global_batch, seq=16, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, vocab, (global_batch, seq), generator=g)
        x[:, 1::2] = (x[:, 0::2] + 1) % vocab  # every other token is predictable
        yield x


def build_model():
    """A tiny Llama from a config (nothing is downloaded)."""
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def param_groups(model):
    """The usual pattern: no weight decay for biases and norm weights."""
    no_decay = ["bias", "norm.weight"]
    return [
        {
            "params": [
                p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)
            ],
            "weight_decay": 0.1,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
            "weight_decay": 0.0,
        },
    ]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="out/hf_causal_lm")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed()

    torch.manual_seed(0)
    model = build_model()
    groups = param_groups(model)
    optimizer = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95))
    scheduler = WarmupDecayLR(
        optimizer,
        total_num_steps=args.steps,
        warmup_max_lr=1e-3,
        warmup_num_steps=2,
        warmup_type="linear",
    )
    engine, optimizer, _, scheduler = deepspeed.initialize(
        args=args, model=model, optimizer=optimizer, lr_scheduler=scheduler, config=DS_CONFIG
    )
    assert engine.config.vocab_size == 128  # the model's config, as model code expects
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    micro = engine.train_micro_batch_size_per_gpu()
    for x in batches(args.steps * engine.gradient_accumulation_steps(), micro * world):
        ids = x[rank * micro : (rank + 1) * micro]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    engine.save_16bit_model(args.out)
    if rank == 0:
        print(f"steps {engine.global_steps} lr {engine.get_lr()} last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
