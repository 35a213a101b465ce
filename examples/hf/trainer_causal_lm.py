"""A stock Hugging Face Trainer fine-tune of a causal LM, run on fsdpx: the import and one
argument change (`from fsdpx.hf import Trainer`, `fsdpx_config=` the DeepSpeed JSON a
`--deepspeed` run uses). Then the saved model is loaded back sharded with
`fsdpx.hf.from_pretrained` (each rank reads only its byte ranges) and with plain
transformers, and both give the same logits.

The model is a tiny Llama built from a config (nothing is downloaded); the text is random
tokens where every other token is predictable. Needs `pip install 'fsdpx[hf]'` (a clone's scripts/setup.sh installs it).

Launch, from the repository root:

    torchrun --standalone --nproc_per_node=2 examples/hf/trainer_causal_lm.py
    python examples/hf/trainer_causal_lm.py          # one rank

Options: --steps N (default 20), --out DIR (default out/hf_trainer), --resume (continue
from the newest checkpoint-N in DIR).
"""

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, TrainingArguments

import fsdpx
import fsdpx.hf
from fsdpx.hf import Trainer  # was: from transformers import Trainer

DS_CONFIG = Path(__file__).with_name("ds_config_zero3.json")


class PatternText(torch.utils.data.Dataset):
    def __init__(self, n, seq=32, vocab=128, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, vocab, (n, seq), generator=g)
        self.x[:, 1::2] = (self.x[:, 0::2] + 1) % vocab

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def build_model():
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="out/hf_trainer")
    parser.add_argument("--resume", action="store_true")
    cli = parser.parse_args()

    args = TrainingArguments(
        output_dir=cli.out,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=cli.steps,
        learning_rate=3e-3,
        warmup_steps=2,
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        logging_steps=5,
        save_steps=10,
        save_total_limit=2,
        eval_strategy="steps",
        eval_steps=10,
        report_to=[],
        optim="adamw_torch",
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=build_model(),
        args=args,
        train_dataset=PatternText(512),
        eval_dataset=PatternText(64, seed=1),
        fsdpx_config=str(DS_CONFIG),  # the only new argument
    )
    trainer.train(resume_from_checkpoint=True if cli.resume else None)
    trainer.save_model(f"{cli.out}/final")  # Hugging Face layout, gathered one tensor at a time

    # Load it back sharded: each rank reads only the bytes of its own shards.
    engine = fsdpx.hf.from_pretrained(
        AutoModelForCausalLM, f"{cli.out}/final", fsdpx.Config.from_dict({"zero": {"stage": 3}})
    )
    ids = PatternText(2, seed=2).x
    with torch.no_grad():
        sharded = engine.eval()(input_ids=ids).logits
    eval_loss = trainer.evaluate()["eval_loss"]  # every rank: evaluation gathers
    if trainer.is_world_process_zero():
        plain = AutoModelForCausalLM.from_pretrained(f"{cli.out}/final").eval()
        with torch.no_grad():
            same = torch.allclose(sharded, plain(input_ids=ids).logits, atol=1e-5)
        print(f"final eval loss {eval_loss:.4f}; reloaded logits match: {same}")


if __name__ == "__main__":
    main()
