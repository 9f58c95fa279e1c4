"""The per-step metrics row: the single source of truth for metrics.jsonl, Prometheus and the report.

Rewards are reported apart: `reward_mean` and `pass_at_1` are over the step's fresh completions only
(what the policy generated), `replay_reward_mean` over ExGRPO's replayed trajectories (correct when they
were stored, re-verified by the actor). Field meanings: docs/metrics.md.
"""

from __future__ import annotations

from learner.maths.batch import Batch
from learner.maths.result import UpdateResult


def is_stats(stats: list[dict]) -> dict:
    """Step-level importance-weight statistics from the per-micro-batch ones (token-weighted means)."""
    rows = [s for s in stats if "is_weight_mean" in s]
    if not rows:
        return {"is_weight_mean": None, "is_weight_max": None, "is_truncated_frac": None}
    n = sum(s["tokens"] for s in rows) or 1.0
    return {"is_weight_mean": sum(s["is_weight_mean"] * s["tokens"] for s in rows) / n,
            "is_weight_max": max(s["is_weight_max"] for s in rows),
            "is_truncated_frac": sum(s["is_truncated_frac"] * s["tokens"] for s in rows) / n}


def loss_stats(res: UpdateResult) -> dict:
    """Loss, gradient, ratio, clip, entropy and replay-weight statistics of the update."""
    st = res.stats
    tokens = sum(s["tokens"] for s in st)
    rep = [s for s in st if s.get("replay_tokens")]
    rep_tokens = sum(s["replay_tokens"] for s in rep)
    ent = [s for s in st if "entropy_sum" in s]
    mm, bh = res.kl["mismatch"], res.kl["behaviour"]
    return {
        "loss": sum(res.losses), "grad_norm": max(res.norms) if res.norms else None,
        "ratio_mean": sum(s["ratio_mean"] for s in st) / max(1, len(st)),
        "ratio_max": max((s["ratio_max"] for s in st), default=1.0),
        "clip_frac": sum(s["clip_frac"] for s in st) / max(1, len(st)),
        **is_stats(st),
        "mismatch_kl": mm[0] / mm[1] if mm[1] else None, "behaviour_kl": bh[0] / bh[1] if bh[1] else None,
        "logprob_diff_max": res.diff_max,
        "entropy": sum(s["entropy_sum"] for s in ent) / max(1.0, sum(s["tokens"] for s in ent)) if ent else None,
        "replay_w_mean": sum(s["replay_w_mean"] * s["replay_tokens"] for s in rep) / rep_tokens if rep_tokens else None,
        "replay_w_max": max((s["replay_w_max"] for s in rep), default=None),
        "replay_token_frac": rep_tokens / tokens if tokens else 0.0,
    }


def batch_stats(b: Batch) -> dict:
    """Rewards (fresh and replayed apart), staleness and lengths of the step's batch."""
    fresh = b.fresh_rewards
    return {
        "reward_mean": sum(fresh) / len(fresh) if fresh else 0.0,
        "pass_at_1": sum(1.0 for r in fresh if r >= 1.0) / len(fresh) if fresh else 0.0,
        "tokens_generated": b.fresh_tokens, "rollouts": len(b.seqs),
        "staleness_mean": sum(b.staleness) / len(b.staleness), "staleness_max": max(b.staleness),
        "staleness_hist": {str(lag): b.staleness.count(lag) for lag in sorted(set(b.staleness))},
        "truncated_frac": b.truncated / max(1, len(fresh)),
    }


def phase_seconds(res: UpdateResult, exgrpo_s: float) -> dict:
    """Where the lead rank's update went (`recompute_seconds`, `forward_seconds`, `backward_seconds`,
    `optimizer_seconds`) and ExGRPO's step-end bookkeeping, the selection forward included."""
    return {**{f"{k}_seconds": v for k, v in res.seconds.items()}, "exgrpo_seconds": exgrpo_s}
