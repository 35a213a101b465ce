"""Hugging Face Llama- and Qwen-style models (built from a config) under Ulysses and ring
attention, mesh.sp = 2: the attention goes through transformers' registry ([Note: Hugging
Face attention under Ulysses], [Note: Hugging Face attention under ring]); logits and the
globally normalised .loss equal the unparallelised model's, and parameters after SGD steps
through engine.train_batch match (fp32 default tolerances)."""

from __future__ import annotations

from typing import Any

import pytest
from torch.testing import assert_close

from tests import sp_hf_bodies
from tests.dist import run_ranks

pytest.importorskip("transformers")


def test_hf_models_under_sp2_equal_the_unparallelised_models() -> None:
    steps = 2
    # Llama: 4 query / 2 kv heads (split); Qwen2: q/k/v biases and 1 kv head (repeated);
    # Llama under ring attention ([Note: Hugging Face attention under ring]).
    kinds = ["llama", "qwen2", "llama+ring"]
    results = run_ranks(sp_hf_bodies.sweep_body, 2, args=(kinds, steps))
    for kind in kinds:
        expected = sp_hf_bodies.reference(kind.partition("+")[0], steps)
        _check(kind, [r[kind] for r in results], expected)


def _check(kind: str, results: list[dict[str, Any]], expected: dict[str, Any]) -> None:
    prefix = "fsdpx_ring:" if kind.endswith("+ring") else "fsdpx_ulysses:sdpa:"
    for r in results:
        assert r["implementation"].startswith(prefix)
        assert_close(r["logits"], expected["logits"])
        assert_close(r["loss"], expected["loss"])
        # Python floats from fp32 arithmetic (the ring sums its softmax blockwise): fp32
        # tolerances, not the float64 ones assert_close picks for floats.
        assert_close(r["losses"], expected["losses"], rtol=1.3e-6, atol=1e-5)
        for name, value in expected["params"].items():
            assert_close(r["params"][name], value, msg=lambda m, n=name: f"{kind} {n}: {m}")
