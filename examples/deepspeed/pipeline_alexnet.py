"""A DeepSpeed pipeline-parallel script (the shape of DeepSpeed's pipeline AlexNet example:
the model as a layer list in a PipelineModule, trained with engine.train_batch), run on
fsdpx by changing one line: `import deepspeed` -> `import fsdpx.deepspeed as deepspeed`.
(The module is reached as `deepspeed.pipe.PipelineModule`, which works in both; a
`from deepspeed.pipe import PipelineModule` line would be a second line to change.)

The images are synthetic (a seeded generator: nothing is downloaded): 10 classes, each a
fixed random pattern plus noise. The AlexNet is torchvision's layout at a small width
(features / avgpool / flatten / classifier), with dropout off so that runs on different
layouts draw no random masks and can be compared.

Launch, from the repository root (2 ranks = 2 pipeline stages):

    torchrun --standalone --nproc_per_node=2 examples/deepspeed/pipeline_alexnet.py \
        --deepspeed_config examples/deepspeed/pipeline_ds_config.json -p 2 --steps 20

Options: -p/--pipeline-parallel-size (stages, default 2), -s/--steps (default 20),
--seed (default 1138), --out DIR (where the final checkpoint goes: engine.save_checkpoint).
"""

import argparse

import torch
import torch.nn as nn

import fsdpx.deepspeed as deepspeed  # was: import deepspeed


class SyntheticImages(torch.utils.data.Dataset):
    def __init__(self, n=512, seed=0):
        g = torch.Generator().manual_seed(seed)
        patterns = torch.randn(10, 3, 32, 32, generator=g)
        self.labels = torch.randint(0, 10, (n,), generator=g)
        self.images = patterns[self.labels] + 0.5 * torch.randn(n, 3, 32, 32, generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


class AlexNet(nn.Module):
    def __init__(self, num_classes=10, width=8, dropout=0.0):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2),
            nn.Conv2d(width, 2 * width, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2),
            nn.Conv2d(2 * width, 4 * width, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(4 * width, 4 * width, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout),
            nn.Linear(4 * width * 2 * 2, 64),
            nn.ReLU(inplace=True),
            nn.Dropout(p=dropout),
            nn.Linear(64, 64),
            nn.ReLU(inplace=True),
            nn.Linear(64, num_classes),
        )

    def forward(self, x):
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def join_layers(vision_model):
    layers = [
        *vision_model.features,
        vision_model.avgpool,
        lambda x: torch.flatten(x, 1),
        *vision_model.classifier,
    ]
    return layers


def get_args():
    parser = argparse.ArgumentParser(description="pipeline AlexNet")
    parser.add_argument("-s", "--steps", type=int, default=20, help="training steps")
    parser.add_argument(
        "-p", "--pipeline-parallel-size", type=int, default=2, help="pipeline stages"
    )
    parser.add_argument("--seed", type=int, default=1138, help="PRNG seed")
    parser.add_argument("--out", default="out/pipeline_alexnet", help="where the weights go")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def train_pipe(args, part="parameters"):
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)

    net = AlexNet(num_classes=10)
    net = deepspeed.pipe.PipelineModule(
        layers=join_layers(net),
        loss_fn=torch.nn.CrossEntropyLoss(),
        num_stages=args.pipeline_parallel_size,
        partition_method=part,
        activation_checkpoint_interval=0,
    )

    trainset = SyntheticImages()
    engine, _, _, _ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=trainset,
    )
    data_iter = iter(deepspeed.utils.RepeatingLoader(engine.training_dataloader))
    for step in range(args.steps):
        loss = engine.train_batch(data_iter)
        if engine.global_rank == 0:
            print(f"step {step + 1} loss {loss.item()!r}", flush=True)
    engine.save_checkpoint(args.out)


if __name__ == "__main__":
    args = get_args()
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    train_pipe(args)
