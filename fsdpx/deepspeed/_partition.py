"""How `PipelineModule` cuts its layer list into stages (DeepSpeed's `partition_method`).

Every method returns stage boundaries `parts` (DeepSpeed's attribute of that name): stage
`s` holds layers `parts[s]` to `parts[s + 1] - 1`, `parts[0] == 0`, `parts[-1]` the
layer count.

[Note: balanced partition] 'parameters' and 'type:regex' weigh each layer (its trainable
parameter count, or 1 for a layer whose class name matches) and split the list into
contiguous stages whose heaviest stage is as light as possible (the linear partition
problem, solved exactly by dynamic programming: layer lists are short). Among the
partitions with that optimum, each stage takes as many layers as it can, so the
parameter-free layers after a layer (its ReLU, pooling) stay with it and the next stage
starts at a weighted layer. DeepSpeed's own solver minimises the spread between the
heaviest and lightest stage instead; both balance the weights, and the two can place a
boundary differently when several splits are equally good.
"""

from __future__ import annotations

import re
from collections.abc import Sequence


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries of `num_parts` stages of `num_items` layers, equal counts; the first
    `num_items % num_parts` stages take one more (as DeepSpeed's 'uniform').

    Example::

        partition_uniform(5, 2)  # [0, 3, 5]
    """
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    base, extra = divmod(num_items, num_parts)
    parts = [0]
    for p in range(num_parts):
        parts.append(parts[-1] + base + (1 if p < extra else 0))
    return parts


def partition_balanced(weights: Sequence[int], num_parts: int) -> list[int]:
    """Boundaries of `num_parts` non-empty contiguous stages minimising the heaviest
    stage's total weight ([Note: balanced partition]).

    Example::

        partition_balanced([10, 0, 0, 10, 0, 5], 2)  # [0, 3, 6]
    """
    n = len(weights)
    if n <= num_parts:
        return partition_uniform(n, num_parts)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[j][i]: the lightest possible heaviest stage splitting the first i layers into j.
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0
    for j in range(1, num_parts + 1):
        for i in range(j, n + 1):
            best[j][i] = min(max(best[j - 1][k], prefix[i] - prefix[k]) for k in range(j - 1, i))
    cap = best[num_parts][n]
    # Greedy fill under the optimal cap, leaving one layer for each later stage: packing
    # each stage as full as the cap allows needs the fewest stages, so the rest fits.
    parts, start = [0], 0
    for s in range(num_parts - 1):
        stop = start + 1
        while stop < n - (num_parts - s - 1) and prefix[stop + 1] - prefix[start] <= cap:
            stop += 1
        parts.append(stop)
        start = stop
    parts.append(n)
    return parts


def type_weights(class_names: Sequence[str | None], pattern: str) -> list[int]:
    """1 for each layer whose class (or function) name matches `pattern` (a regular
    expression, searched case-insensitively, as DeepSpeed's 'type:' method), else 0.

    Raises:
        ValueError: no layer matches.
    """
    regex = re.compile(pattern, re.IGNORECASE)
    weights = [1 if name is not None and regex.search(name) else 0 for name in class_names]
    if not any(weights):
        raise ValueError(
            f"partition_method 'type:{pattern}' matched no layer; the layers' class names "
            f"are {sorted({n for n in class_names if n is not None})}"
        )
    return weights
