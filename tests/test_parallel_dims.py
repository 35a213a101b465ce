"""ParallelDims: mesh-size inference and its errors, and the named meshes build_mesh makes
on a real 4-rank gloo job."""

from __future__ import annotations

from typing import Any

import pytest

from fsdpx.config import MeshConfig
from fsdpx.parallel_dims import Axis, ParallelDims
from tests.dist import run_ranks


@pytest.mark.parametrize(
    ("mesh", "world", "shape"),
    [
        (MeshConfig(), 8, (1, 1, 8, 1)),
        (MeshConfig(), 1, (1, 1, 1, 1)),
        (MeshConfig(dp_replicate=2), 8, (1, 2, 4, 1)),
        (MeshConfig(dp_replicate=2, tp=2), 8, (1, 2, 2, 2)),
        (MeshConfig(pp=2, tp=3), 12, (2, 1, 2, 3)),
        (MeshConfig(dp_replicate=2, dp_shard=3), 6, (1, 2, 3, 1)),  # explicit and consistent
    ],
)
def test_from_config_infers_dp_shard(mesh: MeshConfig, world: int, shape: tuple[int, ...]) -> None:
    dims = ParallelDims.from_config(mesh, world_size=world)
    assert dims.shape == (*shape[:3], 1, shape[3])  # sp (size 1) sits before tp
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp) == shape
    assert dims.world_size == world
    assert dims.dp == shape[1] * shape[2]


def test_product_mismatch_names_every_factor_and_the_world_size() -> None:
    with pytest.raises(
        ValueError,
        match=r"^mesh sizes pp\(2\) \* dp_replicate\(3\) \* dp_shard\(5\) \* tp\(7\) = 210 do "
        r"not equal the world size 16; set mesh\.dp_shard to -1 to infer it$",
    ):
        ParallelDims.from_config(MeshConfig(pp=2, dp_replicate=3, dp_shard=5, tp=7), 16)


def test_non_divisible_inference() -> None:
    with pytest.raises(
        ValueError,
        match=r"^cannot infer mesh\.dp_shard: world size 8 is not divisible by pp\(1\) \* "
        r"dp_replicate\(3\) \* tp\(2\) = 6; choose mesh sizes whose product divides the "
        r"world size$",
    ):
        ParallelDims.from_config(MeshConfig(dp_replicate=3, tp=2), 8)


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"^world_size must be >= 1; got world_size=0$"):
        ParallelDims.from_config(MeshConfig(), 0)


def _mesh_body(rank: int, world_size: int) -> dict[str, Any]:
    import warnings

    import torch
    import torch.distributed as dist

    # torch deprecates slicing a flattened axis from the root mesh: no warning may appear.
    warnings.simplefilter("error")
    out: dict[str, Any] = {}
    for name, mesh_cfg in {"fsdp": MeshConfig(), "hsdp": MeshConfig(dp_replicate=2)}.items():
        dims = ParallelDims.from_config(mesh_cfg, world_size)
        mesh = dims.build_mesh("cpu")
        fsdp = ParallelDims.fsdp_mesh(mesh)
        dp = ParallelDims.dp_mesh(mesh)
        assert ParallelDims.dp_mesh(mesh) is dp  # looked up, not rebuilt
        summed = torch.tensor([float(rank)])
        dist.all_reduce(summed, group=dp.get_group())
        in_shard_group = torch.tensor([float(rank)])
        dist.all_reduce(in_shard_group, group=fsdp.get_group(Axis.DP_SHARD.value))
        out[name] = {
            "names": mesh.mesh_dim_names,
            "shape": tuple(mesh.shape),
            "fsdp_names": fsdp.mesh_dim_names,
            "fsdp_shape": tuple(fsdp.shape),
            "fsdp_ranks": fsdp.mesh.tolist(),
            "dp_names": dp.mesh_dim_names,
            "dp_size": dp.size(),
            "dp_sum": summed.item(),
            "shard_sum": in_shard_group.item(),
        }
    # sp = 2 on 4 ranks: (pp, dp_replicate, dp_shard, sp, tp) = (1, 1, 2, 2, 1).
    dims = ParallelDims.from_config(MeshConfig(sp=2), world_size)
    mesh = dims.build_mesh("cpu")
    fsdp = ParallelDims.fsdp_mesh(mesh)
    dp = ParallelDims.dp_mesh(mesh)
    sums = {}
    for key, group in {
        "fsdp": fsdp.get_group(),
        "dp": dp.get_group(),
        "sp": mesh[Axis.SP.value].get_group(),
    }.items():
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        sums[key] = t.item()
    out["sp"] = {
        "dims": (dims.dp_shard, dims.sp, dims.dp),
        "fsdp_names": fsdp.mesh_dim_names,
        "fsdp_size": fsdp.size(),
        "dp_size": dp.size(),
        "sums": sums,
    }
    return out


class TestBuildMesh:
    world_size = 4

    def test_named_meshes(self) -> None:
        # One spawn sweeps plain FSDP (1 x 4) and HSDP (2 x 2).
        results = run_ranks(_mesh_body, self.world_size)
        world_names = ("pp", "dp_replicate", "dp_shard", "sp", "tp")
        for rank, r in enumerate(results):
            fsdp, hsdp = r["fsdp"], r["hsdp"]
            assert fsdp["names"] == hsdp["names"] == world_names
            # Without replication FSDP gets the 1D shard mesh (no hybrid path); HSDP the 2D one.
            assert fsdp["fsdp_names"] == ("dp_shard",)
            assert hsdp["fsdp_names"] == ("dp_replicate", "dp_shard")
            assert fsdp["dp_names"] == hsdp["dp_names"] == ("dp",)
            assert fsdp["dp_size"] == hsdp["dp_size"] == 4
            assert fsdp["dp_sum"] == hsdp["dp_sum"] == 0 + 1 + 2 + 3

            assert fsdp["shape"] == (1, 1, 4, 1, 1)
            assert fsdp["fsdp_shape"] == (4,)
            assert fsdp["fsdp_ranks"] == [0, 1, 2, 3]
            assert fsdp["shard_sum"] == 6

            # HSDP: shard within {0, 1} and {2, 3}, replicate across them.
            assert hsdp["shape"] == (1, 2, 2, 1, 1)
            assert hsdp["fsdp_shape"] == (2, 2)
            assert hsdp["fsdp_ranks"] == [[0, 1], [2, 3]]
            assert hsdp["shard_sum"] == (1 if rank < 2 else 5)

            # sp = 2: FSDP shards over all 4 ranks (dp_shard x sp); the sp ranks {0, 1},
            # {2, 3} see the same samples, so the data-parallel groups are {0, 2}, {1, 3}.
            sp = r["sp"]
            assert sp["dims"] == (2, 2, 2)
            assert sp["fsdp_names"] == ("dp_shard_sp",)
            assert sp["fsdp_size"] == 4 and sp["dp_size"] == 2
            assert sp["sums"] == {
                "fsdp": 6,
                "dp": (2 if rank % 2 == 0 else 4),
                "sp": (1 if rank < 2 else 5),
            }


def test_sp_divides_the_world_or_the_error_names_it() -> None:
    assert ParallelDims.from_config(MeshConfig(sp=2, tp=2), 8).dp_shard == 2
    with pytest.raises(
        ValueError,
        match=r"^cannot infer mesh\.dp_shard: world size 6 is not divisible by pp\(1\) \* "
        r"dp_replicate\(1\) \* sp\(4\) \* tp\(1\) = 4;",
    ):
        ParallelDims.from_config(MeshConfig(sp=4), 6)


def test_expert_and_sequence_parallel_together_are_refused() -> None:
    from fsdpx.config import MeshConfig

    with pytest.raises(ValueError, match=r"mesh.ep \(2\) together with mesh.sp \(2\) is not"):
        ParallelDims.from_config(MeshConfig(dp_shard=-1, sp=2, ep=2), 8)
