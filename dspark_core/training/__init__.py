"""Drafter training: prompt sets, self-distilled responses, the target cache, losses and the trainer."""
