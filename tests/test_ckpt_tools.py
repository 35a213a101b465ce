"""checkpoint_tools: consolidation to safetensors (single, sharded) and torch files that
load into the unwrapped model bitwise, dtype conversion, `latest` resolution, the CLI's
output and exit codes, bounded memory, and that the tools never load the fsdpx runtime."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from checkpoint_tools import consolidate, load_state_dict, resolve_checkpoint
from checkpoint_tools.cli import main, parse_size
from checkpoint_tools.format import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    RankWriter,
    model_name,
    optim_name,
    write_manifest,
)

REPO = Path(__file__).resolve().parents[1]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 6)
        self.fc = nn.Linear(6, 5)
        self.norm = nn.LayerNorm(5)
        self.register_buffer("count", torch.tensor([3, 1, 4], dtype=torch.int64))


def trained() -> tuple[Net, dict[str, dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.Adam(net.parameters())
    net.norm(net.fc(net.emb(torch.arange(13)))).sum().backward()
    opt.step()
    names = {id(p): n for n, p in net.named_parameters()}
    optim = {names[id(p)]: s for p, s in opt.state.items()}
    return net, optim


def save_sharded(
    d: Path, net: Net, optim: dict[str, dict[str, torch.Tensor]], world: int = 3
) -> None:
    """Pieces as an FSDP2 save would write them: dim-0 shards of uneven size; fc.weight
    split by columns (as TP would); 0-d Adam steps replicated on every rank."""
    tensors = {model_name(k): v for k, v in net.state_dict().items()}
    for fqn, states in optim.items():
        tensors.update({optim_name(fqn, key): v for key, v in states.items()})
    infos = []
    for rank in range(world):
        w = RankWriter(d, rank, chunk_bytes=32)
        for name, t in tensors.items():
            dim = 1 if name.endswith("fc.weight") else 0
            if t.dim() == 0:
                w.add(name, t, global_shape=(), offsets=())
                continue
            n = t.shape[dim]
            lo, hi = (n * rank) // world, (n * (rank + 1)) // world
            offs = [0] * t.dim()
            offs[dim] = lo
            w.add(name, t.narrow(dim, lo, hi - lo), global_shape=t.shape, offsets=offs)
        infos.append(w.close())
    write_manifest(d, world_size=world, rank_files=infos, state={"global_steps": 1})


@pytest.fixture
def ckpt(tmp_path: Path) -> tuple[Path, Net, dict[str, dict[str, torch.Tensor]]]:
    net, optim = trained()
    root = tmp_path / "ckpt"
    save_sharded(root / "global_step1", net, optim)
    (root / "latest").write_text("global_step1\n")
    return root, net, optim


def assert_state_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k], v), k


def test_consolidate_single_safetensors_loads_into_plain_model(ckpt, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    root, net, _ = ckpt
    paths = consolidate(root, tmp_path / "out")
    assert paths == [tmp_path / "out" / "model.safetensors"]
    state = safetensors.torch.load_file(paths[0])
    assert_state_equal(state, net.state_dict())
    fresh = Net()
    fresh.load_state_dict(state, strict=True)
    assert_state_equal(fresh.state_dict(), net.state_dict())


def test_consolidate_sharded_with_index(ckpt, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    root, net, _ = ckpt
    paths = consolidate(root, tmp_path / "out", max_shard_bytes=200)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = [p for p in paths if p.suffix == ".safetensors"]
    assert len(shards) > 1 and paths[-1].name == "model.safetensors.index.json"
    assert shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    merged: dict[str, torch.Tensor] = {}
    for p in shards:
        part = safetensors.torch.load_file(p)
        assert all(index["weight_map"][k] == p.name for k in part)
        merged.update(part)
    assert index["metadata"]["total_size"] == sum(
        v.numel() * v.element_size() for v in merged.values()
    )
    assert_state_equal({k: merged[k] for k in net.state_dict()}, net.state_dict())


def test_consolidate_replaces_an_earlier_sharding(ckpt, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    root, _, _ = ckpt
    consolidate(root, tmp_path / "out", max_shard_bytes=200)
    (tmp_path / "out" / "notes.txt").write_text("kept")
    consolidate(root, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "model.safetensors",
        "notes.txt",
    ]


def test_consolidate_torch_file_and_dtype(ckpt, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    root, net, optim = ckpt
    [path] = consolidate(root, tmp_path / "model.pt", dtype="bf16", include_optimizer=True)
    state = torch.load(path, weights_only=True)
    want = {
        k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in net.state_dict().items()
    }
    assert_state_equal({k: state[k] for k in want}, want)
    assert state["count"].dtype == torch.int64  # integer buffers are never cast
    # optimizer state keeps its stored dtype
    assert torch.equal(state["optim/fc.weight/exp_avg_sq"], optim["fc.weight"]["exp_avg_sq"])
    assert torch.equal(state["optim/emb.weight/step"], optim["emb.weight"]["step"])


def test_load_state_dict_api(ckpt) -> None:  # type: ignore[no-untyped-def]
    root, net, optim = ckpt
    assert_state_equal(load_state_dict(root), net.state_dict())
    full = load_state_dict(root / "global_step1", dtype="fp16", include_optimizer=True)
    assert full["fc.weight"].dtype == torch.float16
    assert torch.equal(full["optim/norm.bias/exp_avg"], optim["norm.bias"]["exp_avg"])
    with pytest.raises(
        ValueError, match=r"dtype must be one of \['bf16', 'fp16', 'fp32'\] or None; got 'fp64'"
    ):
        load_state_dict(root, dtype="fp64")


def test_resolve_checkpoint(ckpt, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    root, _, _ = ckpt
    assert resolve_checkpoint(root) == root / "global_step1"
    assert resolve_checkpoint(root / "global_step1") == root / "global_step1"
    (root / "latest").write_text("../../etc\n")
    with pytest.raises(CheckpointFormatError, match="latest must hold one plain directory name"):
        resolve_checkpoint(root)
    (root / "latest").write_text("global_step9\n")
    with pytest.raises(
        CheckpointNotFoundError, match="latest names 'global_step9', which does not exist"
    ):
        resolve_checkpoint(root)
    (root / "latest").unlink()
    with pytest.raises(CheckpointNotFoundError, match="committed checkpoints here: global_step1"):
        resolve_checkpoint(root)


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("1234") == 1234
    with pytest.raises(Exception, match="expected a size like 5GB"):
        parse_size("lots")


# --- CLI ----------------------------------------------------------------------------------


def test_cli_inspect(ckpt, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    root, _, _ = ckpt
    assert main(["inspect", str(root)]) == 0
    out, err = capsys.readouterr()
    assert "using" in err and "global_step1" in err
    assert "world size  3" in out and "state keys  global_steps" in out
    line = next(x for x in out.splitlines() if x.startswith("model/fc.weight "))
    assert "float32" in line and "5x6" in line and "3 pieces along dim 1" in line
    assert "x3 replicas" in next(x for x in out.splitlines() if x.startswith("optim/fc.bias/step"))
    assert main(["inspect", "--json", str(root)]) == 0
    info = json.loads(capsys.readouterr().out)
    row = next(r for r in info["tensors"] if r["name"] == "model/emb.weight")
    assert row["shape"] == [13, 6] and row["bytes"] == 13 * 6 * 4 and 0 < row["stored_ratio"] <= 1


def test_cli_verify_ok_and_corrupt(ckpt, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    root, _, _ = ckpt
    assert main(["verify", str(root)]) == 0
    assert "OK:" in capsys.readouterr().out
    data = root / "global_step1" / "rank-00002.data"
    raw = bytearray(data.read_bytes())
    raw[40] ^= 0x10
    data.write_bytes(bytes(raw))
    assert main(["verify", str(root), "--deep"]) == 1
    err = capsys.readouterr().err
    assert "FAILED: CheckpointCorruptError" in err and "rank-00002.data" in err
    m = re.search(r"tensor 'model/emb.weight', offset (\d+)\)", err)
    assert m is not None and 32 <= int(m.group(1)) <= 40, err  # the chunk holding byte 40


def test_cli_consolidate_and_errors(
    ckpt, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    root, net, _ = ckpt
    out = tmp_path / "one.safetensors"
    assert main(["consolidate", str(root), str(out), "--dtype", "fp16"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert safetensors.torch.load_file(out)["fc.weight"].dtype == torch.float16
    assert main(["consolidate", str(root), str(tmp_path / "o.pt"), "--max-shard-size", "1MB"]) == 2
    assert "needs a positive size and a safetensors output directory" in capsys.readouterr().err
    assert main(["verify", str(tmp_path / "missing")]) == 1
    assert "CheckpointNotFoundError: no such checkpoint directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["consolidate", str(root), "x", "--dtype", "int8"])
    assert exit_info.value.code == 2


def test_cli_imports_no_fsdpx_runtime() -> None:
    code = textwrap.dedent(
        """
        import sys
        import checkpoint_tools.cli, checkpoint_tools
        loaded = sorted(m for m in sys.modules if m == "fsdpx" or m.startswith("fsdpx."))
        assert not loaded, loaded
        import torch.distributed as dist
        assert not dist.is_initialized()
        checkpoint_tools.cli.main(["--help"])
        """
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "consolidate" in res.stdout and "verify" in res.stdout


# --- bounded memory -----------------------------------------------------------------------

_PEAK_CHILD = """
import os, sys
from checkpoint_tools import consolidate
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
# VmHWM is the process high-water mark; reset it so only consolidation counts.
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = rss("VmRSS:")
consolidate(sys.argv[1], sys.argv[2])
print(rss("VmHWM:") - before)
"""


def test_consolidate_peak_memory_is_bounded(tmp_path: Path) -> None:
    """A 200 MB checkpoint (4 ranks, row shards plus a column-split tensor) consolidates
    with RSS growth far below the model size: about one block plus one slab."""
    g = torch.Generator().manual_seed(0)
    tensors = {f"model/layer{i}.w": torch.randn(2500, 4000, generator=g) for i in range(5)}
    d = tmp_path / "big"
    infos = []
    for rank in range(4):
        w = RankWriter(d, rank)
        for i, (name, t) in enumerate(tensors.items()):
            dim = i % 2
            n = t.shape[dim]
            lo, hi = n * rank // 4, n * (rank + 1) // 4
            offs = [0, 0]
            offs[dim] = lo
            w.add(name, t.narrow(dim, lo, hi - lo), global_shape=t.shape, offsets=offs)
        infos.append(w.close())
    write_manifest(d, world_size=4, rank_files=infos, state={})
    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, "-c", _PEAK_CHILD, str(d), str(out)],
        check=True,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    growth = int(res.stdout.strip().splitlines()[-1])
    assert growth < 64 << 20, (
        f"consolidation grew RSS by {growth / 2**20:.1f} MiB for a 200 MB model"
    )
    with safetensors.safe_open(out / "model.safetensors", "pt") as f:
        for name, t in tensors.items():
            assert torch.equal(f.get_tensor(name.removeprefix("model/")), t)


def test_progress_bar_only_on_a_terminal() -> None:
    import io

    from checkpoint_tools.progress import Progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        with Progress("verify", 2**20, stream=stream) as bar:
            bar.update(2**19)
            bar.update(2**19)
    assert pipe.getvalue() == ""
    assert (
        "verify [" in tty.getvalue()
        and "100.0%" in tty.getvalue()
        and tty.getvalue().endswith("\n")
    )
