"""A DeepSpeed masked-language-model script (the shape of DeepSpeed's BERT pre-training
example: no-weight-decay parameter groups, ZeRO-2 with the optimizer offloaded to the
CPU, save_checkpoint every N steps and resume with load_checkpoint), run on fsdpx by
changing one line: `import deepspeed` -> `import fsdpx.deepspeed as deepspeed`.

The model is a small Transformer encoder built from torch.nn; the text is random tokens
with 15% masked (nothing is downloaded).

Launch, from the repository root:

    torchrun --standalone --nproc_per_node=2 examples/deepspeed/masked_lm.py \
        --deepspeed_config examples/deepspeed/masked_lm_ds_config.json --ckpt out/mlm
    # stop it, run the same command again: it resumes from out/mlm

Options: --steps N (optimizer steps in total, default 12), --save-every N (default 4),
--stop-after N (exit after N steps of this run, to try resuming), --ckpt DIR.
"""

import argparse
import json

import torch
import torch.nn as nn

import fsdpx.deepspeed as deepspeed  # was: import deepspeed

VOCAB, SEQ, MASK_ID = 100, 16, 0


class TinyBert(nn.Module):
    def __init__(self, hidden=32, layers=2, heads=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.pos = nn.Parameter(torch.zeros(SEQ, hidden))
        layer = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, tokens, labels):
        x = self.encoder(self.embed(tokens) + self.pos)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(
            logits.view(-1, VOCAB), labels.view(-1), ignore_index=-100
        )


class MaskedTokens(torch.utils.data.Dataset):
    def __init__(self, n=512, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(1, VOCAB, (n, SEQ), generator=g)
        # a learnable pattern: every token predicts its right neighbour's parity class
        self.tokens[:, 1::2] = (self.tokens[:, 0::2] * 7) % VOCAB
        self.mask = torch.rand(n, SEQ, generator=g) < 0.15

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        labels = torch.where(self.mask[i], self.tokens[i], torch.full_like(self.tokens[i], -100))
        inputs = torch.where(self.mask[i], torch.full_like(self.tokens[i], MASK_ID), self.tokens[i])
        return inputs, labels


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--stop-after", type=int, default=0)
    parser.add_argument("--ckpt", default="out/mlm")
    parser.add_argument("--losses", default=None, help="write rank 0's losses here (JSON)")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(42)
    model = TinyBert()
    no_decay = ["bias", "norm"]
    optimizer_grouped_parameters = [
        {
            "params": [
                p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)
            ],
            "weight_decay": 0.01,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    engine, optimizer, loader, _ = deepspeed.initialize(
        args=args,
        model=model,
        model_parameters=optimizer_grouped_parameters,
        training_data=MaskedTokens(),
    )
    _, client_state = engine.load_checkpoint(args.ckpt)
    losses = (client_state or {}).get("losses", [])
    start = engine.global_steps
    data = deepspeed.utils.RepeatingLoader(loader)
    for _ in range(engine.micro_steps):  # skip what the loaded run already consumed
        next(data)
    while engine.global_steps < args.steps:
        inputs, labels = next(data)
        loss = engine(inputs, labels)
        engine.backward(loss)
        engine.step()
        if engine.was_step_applied():
            mean = loss.detach().clone()
            deepspeed.comm.all_reduce(mean)
            losses.append(mean.item() / deepspeed.comm.get_world_size())
            if engine.global_steps % args.save_every == 0:
                engine.save_checkpoint(args.ckpt, client_state={"losses": losses})
            if args.stop_after and engine.global_steps - start >= args.stop_after:
                break
    if engine.global_rank == 0:
        print(f"step {engine.global_steps} losses {[round(x, 4) for x in losses]}")
        if args.losses:
            with open(args.losses, "w") as f:
                json.dump(losses, f)


if __name__ == "__main__":
    main()
