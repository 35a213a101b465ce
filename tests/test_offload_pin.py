"""zero.offload_*.pin_memory on a machine without an accelerator (issue 13, item 1).

DeepSpeed runs `"offload_param": {"device": "cpu", "pin_memory": true}` (and the same in
offload_optimizer) on CPU; fsdpx used to hand pin_memory=True to FSDP2's CPUOffloadPolicy
(or to its own host buffers), which raises "Cannot access accelerator device when none is
available". Now the request is ignored where no accelerator exists and said once at INFO
([Note: pin_memory without an accelerator] in fsdpx/offload/pin.py). The DeepSpeed configs
are read with Config.from_deepspeed and trained end to end on 2 CPU ranks; each must be
bitwise equal to tests/test_offload.py's reference (no offload, the same optimizer
implementation), as test_offload's own offload cases are.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import fsdpx
from fsdpx.config import OffloadConfig
from fsdpx.offload import OffloadedAdamW, offload_policy, pin
from tests import offload_bodies as ob
from tests import offload_pin_bodies as pb
from tests.dist import run_ranks
from tests.test_offload import _check_bitwise

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="tests the behaviour on a machine without an accelerator"
)

PARAM_LOG = "zero.offload_param.pin_memory=true is ignored"
OPT_LOG = "zero.offload_optimizer.pin_memory=true is ignored"


def ds_config(
    *, param: bool | None = None, optimizer: bool | None = None, nvme_path: str | None = None
) -> dict[str, Any]:
    """A DeepSpeed ZeRO-3 config matching ob.config(3, clip=0.5): offload_param to cpu when
    `param` is not None (its pin_memory), offload_optimizer to cpu (or nvme at `nvme_path`)
    when `optimizer` is not None."""
    zero: dict[str, Any] = {"stage": 3}
    if param is not None:
        zero["offload_param"] = {"device": "cpu", "pin_memory": param}
    if optimizer is not None:
        device = {"device": "nvme", "nvme_path": nvme_path} if nvme_path else {"device": "cpu"}
        zero["offload_optimizer"] = {**device, "pin_memory": optimizer}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.5,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": ob.LR,
                "betas": list(ob.BETAS),
                "eps": ob.EPS,
                "weight_decay": ob.WEIGHT_DECAY,
            },
        },
        "zero_optimization": zero,
    }


# case -> (DeepSpeed config kwargs, the sections whose ignored pin request is logged)
CASES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "param_pin": ({"param": True}, [PARAM_LOG]),
    "param_nopin": ({"param": False}, []),
    "opt_pin": ({"optimizer": True}, [OPT_LOG]),
    "opt_nopin": ({"optimizer": False}, []),
    # The optimizer steps the host parameters in place: only offload_param's buffers exist.
    "both_pin": ({"param": True, "optimizer": True}, [PARAM_LOG]),
    "both_nopin": ({"param": False, "optimizer": False}, []),
    "opt_nvme_pin": ({"optimizer": True, "nvme_path": "swap"}, [OPT_LOG]),
}


@pytest.fixture(scope="module")
def parity(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One 2-rank launch: the reference and every DeepSpeed case."""
    root = tmp_path_factory.mktemp("offload_pin")
    (root / "swap").mkdir()
    cases: dict[str, dict[str, Any]] = {"ref": {"cfg": ob.config(3, clip=0.5), "same": True}}
    for name, (kw, _) in CASES.items():
        if "nvme_path" in kw:
            kw = {**kw, "nvme_path": str(root / kw["nvme_path"])}
        cases[name] = {"ds": ds_config(**kw)}
    return {"ranks": run_ranks(pb.ds_parity_body, 2, (cases, str(root / "ckpt")))}


@pytest.mark.parametrize("case", sorted(CASES))
def test_deepspeed_offload_config_trains_on_cpu_like_the_reference(
    parity: dict[str, Any], case: str
) -> None:
    _check_bitwise(parity, case, "ref")
    record = parity["ranks"][0][case]
    want = "AdamW" if case.startswith(("param", "both")) else "OffloadedAdamW"
    assert record["optimizer"] == want


@pytest.mark.parametrize("case", sorted(CASES))
def test_ignored_pin_request_is_said_once_per_section(parity: dict[str, Any], case: str) -> None:
    """Per rank, over translating, building (offload_policy runs more than once) and
    training: one INFO line for each section that asked to pin, none otherwise."""
    want = CASES[case][1]
    for rank, res in enumerate(parity["ranks"]):
        got = [
            next((w for w in want if line.startswith(w)), line) for line in res[case]["pin_logs"]
        ]
        assert got == want, f"rank {rank}: {res[case]['pin_logs']}"


@pytest.fixture
def fresh_pin_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pin, "_said", set())


@pytest.mark.usefixtures("fresh_pin_memory")
def test_offload_policy_ignores_pin_request_and_says_why_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = fsdpx.Config.from_deepspeed(ds_config(param=True), world_size=1)
    with caplog.at_level(logging.INFO, logger="fsdpx"):
        policies = [offload_policy(cfg) for _ in range(3)]
    assert all(getattr(p, "pin_memory", None) is False for p in policies), policies
    lines = [r for r in caplog.records if "pin_memory=true is ignored" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].levelno == logging.INFO and lines[0].name == "fsdpx"
    assert lines[0].getMessage() == (
        "zero.offload_param.pin_memory=true is ignored: pinning host memory needs a CUDA "
        "device and this machine has none (torch.cuda.is_available() is False); the "
        "offloaded buffers stay in ordinary pageable host memory, as DeepSpeed does on CPU"
    )


@pytest.mark.usefixtures("fresh_pin_memory")
@pytest.mark.parametrize("requested", [True, False, None])
def test_offloaded_adamw_host_buffers_unpinned_without_accelerator(
    caplog: pytest.LogCaptureFixture, requested: bool | None
) -> None:
    """OffloadedAdamW used directly (not through fsdpx.shard) resolves pin_memory alike."""
    params = [torch.nn.Parameter(torch.randn(4, 3))]
    offload = OffloadConfig(device="cpu", pin_memory=requested)
    with caplog.at_level(logging.INFO, logger="fsdpx"):
        opts = [OffloadedAdamW(params, offload=offload) for _ in range(2)]
    assert [o.pin_memory for o in opts] == [False, False]
    assert not any(t.is_pinned() for t in opts[0].host_tensors())
    lines = [
        r.getMessage() for r in caplog.records if "pin_memory=true is ignored" in r.getMessage()
    ]
    assert [line[: len(OPT_LOG)] for line in lines] == ([OPT_LOG] if requested else [])
    for o in opts:
        o.close()


@pytest.mark.usefixtures("fresh_pin_memory")
def test_pin_false_and_default_are_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="fsdpx"):
        assert pin.host_pin(False, section="offload_param", default=True) is False
        assert pin.host_pin(None, section="offload_param", default=False) is False
    assert not caplog.records
