"""The lossless acceptance rule of speculative decoding with the DSpark drafts (docs/GENERATION-AND-DSPARK.md §3).

Shapes: k drafts per cycle (dspark_block_size), V vocab.

A cycle of a request at last fed position p with its pending token t (for position p + 1):
1. draft k tokens d_1 … d_k from the DSpark rings, sampling each from its draft distribution p_d;
2. verify: the target forward feeds [t, d_1 … d_k] at positions p + 1 … p + k + 1 (a snapshot of the
   cache is taken first), giving the target distributions p_t of positions p + 2 … p + k + 2;
3. accept d_i while u_i < min(1, p_t(d_i) / p_d(d_i)); at the first rejection sample from
   normalise(max(p_t − p_d, 0)), or, if all k were accepted, a bonus token from the last p_t;
4. roll the cache back to the accepted positions and feed their main rows to the DSpark rings.
The output distribution is the target's (standard speculative sampling); at temperature 0 both
distributions are one-hot and the output equals greedy decoding of the target. The engine runs these
cycles for many requests at once, each accepting its own prefix in the same verify forward.
"""

from __future__ import annotations

import torch

# A residual with less mass than this falls back to the target distribution (§3 step 5).
RESIDUAL_FLOOR = 1e-8
# Ratios are taken against max(p_d, this) (§3 step 4).
DRAFT_PROB_FLOOR = 1e-8


def accept_drafts(p_target: torch.Tensor, p_draft: torch.Tensor, drafts: torch.Tensor,
                  generator: torch.Generator) -> tuple[int, int]:
    """The standard rule on one sequence: p_target [k + 1, V], p_draft [k, V], drafts [k].

    → (accepted count a, the token that follows them: a residual sample or the bonus token).
    """
    k = drafts.shape[0]
    for i in range(k):
        d = int(drafts[i])
        ratio = p_target[i, d] / max(float(p_draft[i, d]), DRAFT_PROB_FLOOR)
        u = torch.rand((), generator=generator, device=p_target.device)
        if u >= min(1.0, float(ratio)):
            residual = (p_target[i] - p_draft[i]).clamp(min=0)
            mass = float(residual.sum())
            dist = residual / mass if mass > RESIDUAL_FLOOR else p_target[i]
            return i, int(torch.multinomial(dist, 1, generator=generator))
    return k, int(torch.multinomial(p_target[k], 1, generator=generator))
