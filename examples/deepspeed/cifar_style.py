"""A DeepSpeed image-classifier script (the shape of DeepSpeed's CIFAR-10 example), run on
fsdpx by changing one line: `import deepspeed` -> `import fsdpx.deepspeed as deepspeed`.

The images are synthetic (a seeded generator: nothing is downloaded): 10 classes, each a
fixed random pattern plus noise, so the loss falls quickly.

Launch, from the repository root:

    torchrun --standalone --nproc_per_node=2 examples/deepspeed/cifar_style.py \
        --deepspeed --deepspeed_config examples/deepspeed/cifar_ds_config.json
    python examples/deepspeed/cifar_style.py --deepspeed_config examples/deepspeed/cifar_ds_config.json

Options: --epochs N (default 2), --out DIR (where save_16bit_model writes the weights).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import fsdpx.deepspeed as deepspeed  # was: import deepspeed


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-e", "--epochs", default=2, type=int, help="number of total epochs")
    parser.add_argument("--out", default="out/cifar_style", help="where the weights go")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class SyntheticImages(torch.utils.data.Dataset):
    def __init__(self, n=256, seed=0):
        g = torch.Generator().manual_seed(seed)
        patterns = torch.randn(10, 3, 16, 16, generator=g)
        self.labels = torch.randint(0, 10, (n,), generator=g)
        self.images = patterns[self.labels] + 0.5 * torch.randn(n, 3, 16, 16, generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 3)
        self.fc1 = nn.Linear(16 * 2 * 2, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


def main():
    args = add_argument()
    deepspeed.init_distributed()
    deepspeed.runtime.utils.set_random_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    trainset = SyntheticImages()
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset
    )
    criterion = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            inputs = data[0].to(model_engine.local_rank if torch.cuda.is_available() else "cpu")
            labels = data[1].to(inputs.device)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            running_loss += loss.item()
            if i % 8 == 7 and model_engine.global_rank == 0:
                print(f"[{epoch + 1}, {i + 1:5d}] loss: {running_loss / 8:.3f}", flush=True)
                running_loss = 0.0
    model_engine.save_16bit_model(args.out)
    if model_engine.global_rank == 0:
        print(f"steps {model_engine.global_steps} samples {model_engine.global_samples}")


if __name__ == "__main__":
    main()
