"""The learner's maths: functions and small classes over tensors and the experience buffer (the GRPO loss,
log-probs, packing, attention, compiled regions, the update, the buffer, replay and experience rules).
It imports nothing of the process shell around it; it reduces over ranks through collectives.py."""
