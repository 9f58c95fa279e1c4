"""What `exgrpo-async train` prints when a run ends: the held-out accuracy before and after, the paired gain
with its standard error, and the run's throughput, read from the run's summary.json."""

from __future__ import annotations

from exgrpo_async.layout import balance


def gain_lines(gain: dict | None) -> list[str]:
    """The held-out gain after - before, with the standard error of that paired difference (the same
    questions scored twice: learner/inbox.py paired_gain) and how many of those errors it is."""
    if not gain:
        return []
    out = []
    for name in ("sampled", "greedy"):
        d, se = gain[name], gain[f"{name}_se"]
        ratio = f" = {d / se:+.1f} SE" if se > 0 else ""
        out.append(f"{'held-out gain, ' + name + ' (paired SE)':38s}{f'{d:+.3f} ± {se:.3f}{ratio}':>20s}"
                   f"  over {gain[f'{name}_questions']} questions")
    return out


def print_summary(s: dict) -> None:
    before, after = s.get("before") or {}, s.get("after") or {}
    rows = [
        ("held-out accuracy (avg@n, sampled)", f"{before.get('accuracy', float('nan')):.3f}", f"{after.get('accuracy', float('nan')):.3f}"),
        ("held-out accuracy (greedy)", f"{before.get('greedy_accuracy', float('nan')):.3f}", f"{after.get('greedy_accuracy', float('nan')):.3f}"),
        # one evaluation's noise (learner/inbox.py standard_error): differences smaller than about twice it are not shown
        ("  its standard error (sampled)", f"{before.get('accuracy_se', float('nan')):.3f}", f"{after.get('accuracy_se', float('nan')):.3f}"),
    ]
    print("\n" + f"{'':38s}{'before':>10s}{'after':>10s}")
    for name, b, a in rows:
        print(f"{name:38s}{b:>10s}{a:>10s}")
    for line in gain_lines(s.get("gain")):
        print(line)
    curve = s.get("held_out_curve") or []
    if len(curve) > 2:  # evaluations during the run too (learner.eval_every)
        points = ", ".join(f"{p['step']}: {p['accuracy']:.3f}" for p in curve)
        print(f"{'held-out sampled, by step':38s}{points}")
    print(f"{'RL steps':38s}{s['steps']:>20d}")
    print(f"{'RL wall time (s)':38s}{s['rl_seconds']:>20.1f}")
    print(f"{'rollouts/s':38s}{s['rollouts_per_s']:>20.1f}")
    print(f"{'generated tokens/s':38s}{s['tokens_per_s']:>20.0f}")
    print(f"{'weight sync, mean broadcast (s)':38s}{s['sync_seconds_mean']:>20.4f}")
    print(f"{'stale groups dropped / skipped steps':38s}{str(s['stale_dropped']) + ' / ' + str(s['skipped_steps']):>20s}")
    print(balance(s.get("learner_idle_median"), s.get("actor_idle_median"), s.get("cores_busy_median")))
    print(f"final model: {s['final_model']}", flush=True)
